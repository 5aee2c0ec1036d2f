//! `TreeEnsemble` (`ai.onnx.ml`, opset 5): decision trees over the features of each row
//! of `X`, their leaves' weights added (or averaged, or the least or greatest kept) per
//! target. Evaluated on the host; not differentiable (a tree is piecewise constant).

use ndarray::{ArrayD, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::{OpError, OpResult};
use crate::graph::attributes::Attr;
use crate::op_bail;
use crate::value::host_tensor::HostTensor;
use crate::value::{FloatValue, Value};

/// How a node compares its feature with its split (`nodes_modes`).
#[derive(Debug, Clone, Copy)]
enum Mode {
    Leq,
    Lt,
    Gte,
    Gt,
    Eq,
    Neq,
    Member,
}

impl Mode {
    fn of(code: i64) -> OpResult<Mode> {
        Ok(match code {
            0 => Mode::Leq,
            1 => Mode::Lt,
            2 => Mode::Gte,
            3 => Mode::Gt,
            4 => Mode::Eq,
            5 => Mode::Neq,
            6 => Mode::Member,
            c => op_bail!("nodes_modes holds {c}, not a mode (0 to 6)"),
        })
    }
}

/// Where a branch goes: another node or a leaf, by index.
#[derive(Debug, Clone, Copy)]
enum Next {
    Node(usize),
    Leaf(usize),
}

/// One interior node.
#[derive(Debug)]
struct Split {
    mode: Mode,
    feature: usize,
    value: f32,
    members: Vec<f32>,
    missing_true: bool,
    yes: Next,
    no: Next,
}

impl Split {
    fn holds(&self, x: f32) -> bool {
        if x.is_nan() {
            return self.missing_true;
        }
        match self.mode {
            Mode::Leq => x <= self.value,
            Mode::Lt => x < self.value,
            Mode::Gte => x >= self.value,
            Mode::Gt => x > self.value,
            Mode::Eq => x == self.value,
            Mode::Neq => x != self.value,
            Mode::Member => self.members.contains(&x),
        }
    }
}

/// The ensemble as the attributes describe it.
struct Ensemble {
    splits: Vec<Split>,
    roots: Vec<Next>,
    leaf_weights: Vec<f32>,
    leaf_targets: Vec<usize>,
    targets: usize,
}

/// An integer list given as `ints` or as a tensor (`nodes_modes` is a uint8 tensor).
fn ints(ctx: &OpContext, name: &str) -> OpResult<Vec<i64>> {
    match ctx.attrs.get(name) {
        Some(Attr::Tensor(t)) => Ok(int_values(t)),
        Some(_) => Ok(ctx.attrs.ints(name)?.unwrap_or_default()),
        None => op_bail!("missing attribute {name}"),
    }
}

fn int_values(t: &HostTensor) -> Vec<i64> {
    match t {
        HostTensor::Int(a) => a.iter().copied().collect(),
        HostTensor::Float(a) => a.iter().map(|&v| v as i64).collect(),
        HostTensor::Bool(a) => a.iter().map(|&v| i64::from(v)).collect(),
    }
}

fn floats(ctx: &OpContext, name: &str) -> OpResult<Option<Vec<f32>>> {
    Ok(match ctx.attrs.tensor(name)? {
        Some(HostTensor::Float(a)) => Some(a.iter().copied().collect()),
        Some(t) => Some(int_values(t).into_iter().map(|v| v as f32).collect()),
        None => None,
    })
}

fn index(v: i64, len: usize, what: &str) -> OpResult<usize> {
    usize::try_from(v)
        .ok()
        .filter(|&i| i < len)
        .ok_or_else(|| OpError(format!("{what} {v} is outside 0..{len}")))
}

impl Ensemble {
    fn from_attributes(ctx: &OpContext) -> OpResult<Ensemble> {
        let modes = ints(ctx, "nodes_modes")?;
        let n = modes.len();
        let features = ints(ctx, "nodes_featureids")?;
        let split_values = floats(ctx, "nodes_splits")?
            .ok_or_else(|| OpError("missing attribute nodes_splits".into()))?;
        let (yes, no) = (
            ints(ctx, "nodes_truenodeids")?,
            ints(ctx, "nodes_falsenodeids")?,
        );
        let (yes_leaf, no_leaf) = (
            ints(ctx, "nodes_trueleafs")?,
            ints(ctx, "nodes_falseleafs")?,
        );
        let missing = ctx.attrs.ints("nodes_missing_value_tracks_true")?;
        let leaf_weights = floats(ctx, "leaf_weights")?
            .ok_or_else(|| OpError("missing attribute leaf_weights".into()))?;
        let leaves = leaf_weights.len();
        let leaf_targets = ints(ctx, "leaf_targetids")?;
        if [
            features.len(),
            split_values.len(),
            yes.len(),
            no.len(),
            yes_leaf.len(),
            no_leaf.len(),
        ]
        .iter()
        .any(|&l| l != n)
            || leaf_targets.len() != leaves
        {
            op_bail!(
                "the nodes_* attributes differ in length, or leaf_targetids from leaf_weights"
            );
        }
        let targets = ctx.attrs.int("n_targets", 1)?.max(1) as usize;
        let next = |id: i64, leaf: i64| -> OpResult<Next> {
            Ok(if leaf != 0 {
                Next::Leaf(index(id, leaves, "leaf")?)
            } else {
                Next::Node(index(id, n, "node")?)
            })
        };
        let mut splits = Vec::with_capacity(n);
        for i in 0..n {
            splits.push(Split {
                mode: Mode::of(modes[i])?,
                feature: index(features[i], usize::MAX, "feature")?,
                value: split_values[i],
                members: Vec::new(),
                missing_true: missing.as_ref().is_some_and(|m| m.get(i) == Some(&1)),
                yes: next(yes[i], yes_leaf[i])?,
                no: next(no[i], no_leaf[i])?,
            });
        }
        let roots = ints(ctx, "tree_roots")?
            .into_iter()
            .map(|r| {
                let r = index(r, n, "tree root")?;
                // A tree that is one leaf: both branches the same leaf.
                Ok(match (splits[r].yes, splits[r].no) {
                    (Next::Leaf(a), Next::Leaf(b)) if a == b => Next::Leaf(a),
                    _ => Next::Node(r),
                })
            })
            .collect::<OpResult<Vec<_>>>()?;
        let mut ensemble = Ensemble {
            splits,
            roots,
            leaf_weights,
            leaf_targets: leaf_targets
                .into_iter()
                .map(|t| index(t, targets, "leaf target"))
                .collect::<OpResult<_>>()?,
            targets,
        };
        ensemble.assign_members(floats(ctx, "membership_values")?.unwrap_or_default())?;
        Ok(ensemble)
    }

    /// `membership_values` holds one NaN-terminated set per membership node, in the order
    /// a depth-first walk (true branch first) of the trees meets them.
    fn assign_members(&mut self, values: Vec<f32>) -> OpResult<()> {
        let mut sets = values.split(|v| v.is_nan()).map(<[f32]>::to_vec);
        let mut stack: Vec<Next> = self.roots.iter().rev().copied().collect();
        while let Some(next) = stack.pop() {
            let Next::Node(i) = next else { continue };
            if let Mode::Member = self.splits[i].mode {
                self.splits[i].members = sets
                    .next()
                    .ok_or_else(|| OpError("membership_values has too few sets".into()))?;
            }
            stack.push(self.splits[i].no);
            stack.push(self.splits[i].yes);
        }
        Ok(())
    }

    /// The leaf `row` reaches from `root`.
    fn leaf(&self, mut at: Next, row: &[f32]) -> OpResult<usize> {
        for _ in 0..=self.splits.len() {
            match at {
                Next::Leaf(l) => return Ok(l),
                Next::Node(i) => {
                    let s = &self.splits[i];
                    let Some(&x) = row.get(s.feature) else {
                        op_bail!("node {i} reads feature {} of {}", s.feature, row.len())
                    };
                    at = if s.holds(x) { s.yes } else { s.no };
                }
            }
        }
        op_bail!("the trees have a cycle")
    }
}

/// `TreeEnsemble(X)`: `[N, n_targets]`, each row's leaves aggregated per target
/// (`aggregate_function` 0 average, 1 sum, 2 min, 3 max; `post_transform` 0 only).
pub fn tree_ensemble(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "X")?.into_float(ctx.device)?.to_array()?;
    let ensemble = Ensemble::from_attributes(ctx)?;
    if ctx.attrs.int("post_transform", 0)? != 0 {
        op_bail!("post_transform other than 0 (none) is not implemented");
    }
    let aggregate = ctx.attrs.int("aggregate_function", 1)?;
    let (rows, cols) = match x.shape() {
        [r, c] => (*r, *c),
        [c] => (1, *c),
        s => op_bail!("X must be [N, F], got {s:?}"),
    };
    let flat: Vec<f32> = x.iter().copied().collect();
    let start = match aggregate {
        0 | 1 => 0.0,
        2 => f32::MAX,
        3 => f32::MIN,
        a => op_bail!("aggregate_function {a} is not 0 to 3"),
    };
    let mut out = vec![start; rows * ensemble.targets];
    for r in 0..rows {
        let row = &flat[r * cols..(r + 1) * cols];
        for &root in &ensemble.roots {
            let leaf = ensemble.leaf(root, row)?;
            let (w, t) = (ensemble.leaf_weights[leaf], ensemble.leaf_targets[leaf]);
            let slot = &mut out[r * ensemble.targets + t];
            *slot = match aggregate {
                0 => *slot + w / ensemble.roots.len() as f32,
                1 => *slot + w,
                2 => slot.min(w),
                _ => slot.max(w),
            };
        }
    }
    let y = ArrayD::from_shape_vec(IxDyn(&[rows, ensemble.targets]), out)?;
    Ok(Value::Float(FloatValue::from_array(&y, ctx.device)?).into())
}
