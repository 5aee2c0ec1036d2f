//! Control flow with subgraphs: `If`, `Loop` and `Scan` (opset 8's batched form and the
//! opset 9+ form).
//!
//! A subgraph ([`Body`]) was decoded and checked at load. The outer values it reads arrive
//! as the node's trailing inputs ([`crate::graph::attributes::CAPTURED`]), so the interpreter
//! fetches them (parameters included) and keeps them alive like any other input. A body runs node by node with the same Burn ops as the main graph: `If` records
//! the taken branch on the autodiff tape, and `Loop`/`Scan` unroll, so gradients reach
//! every parameter a branch or body reads. State updates of ops inside a body (training-mode
//! batch-norm running statistics) are not propagated.

use std::cell::RefCell;
use std::collections::HashMap;

use burn::tensor::Tensor;
use ndarray::{ArrayD, Axis, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::{OpError, OpResult};
use crate::graph::{Body, Dim, TensorInfo};
use crate::op_bail;
use crate::util::seeds::mix_seed;
use crate::value::host_tensor::dtype;
use crate::value::{FloatValue, MAX_RANK, Value, norm_axis};

/// A body ready to run repeatedly: the outer values it reads and its constants, uploaded
/// once. State its nodes update in training (batch-norm running statistics read from the
/// outer graph) is kept here: later nodes and iterations read the updated values, and the
/// op hands the last ones on as its own state updates ([`Runner::state_updates`]).
pub(super) struct Runner<'a> {
    ctx: &'a OpContext<'a>,
    body: &'a Body,
    outer: &'a HashMap<&'a str, Value>,
    constants: HashMap<&'a str, Value>,
    state: RefCell<HashMap<String, FloatValue>>,
}

impl<'a> Runner<'a> {
    /// A runner of `body` reading outer values from `outer`.
    pub(super) fn new(
        ctx: &'a OpContext<'a>,
        body: &'a Body,
        outer: &'a HashMap<&'a str, Value>,
    ) -> OpResult<Self> {
        let constants = body
            .constants
            .iter()
            .map(|(n, t)| Ok((n.as_str(), Value::from_host(t, ctx.device)?)))
            .collect::<OpResult<_>>()?;
        Ok(Runner {
            ctx,
            body,
            outer,
            constants,
            state: RefCell::default(),
        })
    }

    /// The outer values the body updated, as state updates of the op's own inputs: the
    /// captured values follow its `formal` inputs, in the order of its `captured` list.
    pub(super) fn state_updates(&self, formal: usize) -> Vec<(usize, FloatValue)> {
        let captured = self.ctx.attrs.captured();
        self.state
            .take()
            .into_iter()
            .filter_map(|(name, v)| {
                let k = captured.iter().position(|c| *c == name)?;
                Some((formal + k, v))
            })
            .collect()
    }

    fn fetch(&self, env: &HashMap<&str, Value>, name: &str) -> OpResult<Value> {
        if let Some(v) = self.state.borrow().get(name) {
            return Ok(Value::Float(v.clone()));
        }
        match env
            .get(name)
            .or_else(|| self.constants.get(name))
            .or_else(|| self.outer.get(name))
        {
            Some(v) => Ok(v.clone()),
            None => op_bail!(
                "{}: value '{name}' was not computed (an optional output this importer does not produce?)",
                self.body.name
            ),
        }
    }

    /// Run the body on its formal inputs; `iteration` keys the random streams of its nodes.
    pub(super) fn run(&self, formal: Vec<Value>, iteration: u64) -> OpResult<Vec<Value>> {
        let body = self.body;
        if formal.len() != body.inputs.len() {
            op_bail!(
                "{}: the subgraph declares {} inputs, the op binds {}",
                body.name,
                body.inputs.len(),
                formal.len()
            );
        }
        let mut env: HashMap<&str, Value> = body
            .inputs
            .iter()
            .map(|i| i.name.as_str())
            .zip(formal)
            .collect();
        let seed = mix_seed(self.ctx.seed, iteration);
        let memo = self.ctx.memo.clone();
        for (i, node) in body.nodes.iter().enumerate() {
            let err = |e: OpError| {
                OpError(format!(
                    "{}: node `{}` ({}): {}",
                    body.name, node.name, node.op_type, e.0
                ))
            };
            let args = node
                .inputs
                .iter()
                .map(|name| {
                    if name.is_empty() {
                        Ok(None)
                    } else {
                        self.fetch(&env, name).map(Some)
                    }
                })
                .collect::<OpResult<Vec<_>>>()
                .map_err(err)?;
            super::refuse_unsupported_kinds(&node.op_type, &args).map_err(err)?;
            let ctx = OpContext {
                device: self.ctx.device,
                train: self.ctx.train,
                opset: self.ctx.opset,
                attrs: &node.attrs,
                num_outputs: node.outputs.len(),
                seed: mix_seed(seed, i as u64),
                autocast: self.ctx.autocast,
                collectives: self.ctx.collectives,
                memo: &memo,
            };
            let out = (node.op)(&ctx, Inputs(args)).map_err(err)?;
            for (slot, v) in out.state_updates {
                match node.inputs.get(slot) {
                    Some(name) if self.outer.contains_key(name.as_str()) => {
                        self.state.borrow_mut().insert(name.clone(), v);
                    }
                    _ => {}
                }
            }
            for name in &node.inputs {
                if body.last_use.get(name) == Some(&i)
                    && !body.outputs.iter().any(|o| &o.name == name)
                {
                    env.remove(name.as_str());
                }
            }
            for (name, v) in node.outputs.iter().zip(out.values) {
                if !name.is_empty() {
                    env.insert(name, v);
                }
            }
        }
        body.outputs
            .iter()
            .map(|o| self.fetch(&env, &o.name))
            .collect()
    }
}

/// The node's formal inputs and, by name, the outer values its subgraphs read (its
/// trailing inputs).
pub(super) fn split_inputs<'a>(
    ctx: &'a OpContext,
    inputs: Inputs,
) -> OpResult<(Vec<Option<Value>>, HashMap<&'a str, Value>)> {
    let captured = ctx.attrs.captured();
    let mut args = inputs.0;
    if args.len() < captured.len() {
        op_bail!(
            "expects {} outer values after its inputs, got {} inputs in all",
            captured.len(),
            args.len()
        );
    }
    let outer_values = args.split_off(args.len() - captured.len());
    let outer = captured
        .iter()
        .map(String::as_str)
        .zip(outer_values)
        .filter_map(|(n, v)| v.map(|v| (n, v)))
        .collect();
    Ok((args, outer))
}

/// A one-element boolean (or numeric, non-zero is true) condition.
fn flag(v: Value, what: &str) -> OpResult<bool> {
    let a = v.into_bool()?;
    match a.len() {
        1 => Ok(*a.iter().next().expect("one element")),
        n => op_bail!("{what} must hold one element, got {n}"),
    }
}

fn int_scalar(v: i64) -> Value {
    Value::Int(ArrayD::from_elem(IxDyn(&[]), v))
}

fn bool_scalar(v: bool) -> Value {
    Value::Bool(ArrayD::from_elem(IxDyn(&[]), v))
}

/// Element `i` of `v` along logical `axis`, that axis removed.
fn index_axis(v: &Value, axis: usize, i: usize) -> OpResult<Value> {
    Ok(match v {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => {
            let mut shape = f.shape();
            let phys = f.axis(axis as i64)?;
            shape.remove(axis);
            Value::Float(f.clone().narrow(phys, i, 1).reshape(&shape)?)
        }
        Value::Int(a) => Value::Int(a.index_axis(Axis(axis), i).to_owned()),
        Value::Bool(a) => Value::Bool(a.index_axis(Axis(axis), i).to_owned()),
    })
}

/// `values` (of equal shapes) stacked along a new logical `axis`.
fn stack(values: Vec<Value>, axis: usize, ctx: &OpContext) -> OpResult<Value> {
    let Some(first) = values.first() else {
        op_bail!("nothing to stack")
    };
    let shape = first.shape();
    if let Some(v) = values.iter().find(|v| v.shape() != shape) {
        op_bail!(
            "scan outputs of different shapes cannot be stacked: {shape:?} and {:?}",
            v.shape()
        );
    }
    let mut stacked = shape.clone();
    stacked.insert(axis, 1);
    if values.iter().any(|v| matches!(v, Value::Float(_))) {
        let parts = values
            .into_iter()
            .map(|v| Ok(v.into_float(ctx.device)?.reshape(&stacked)?.tensor))
            .collect::<OpResult<Vec<_>>>()?;
        let phys = MAX_RANK - stacked.len() + axis;
        return Ok(Value::Float(FloatValue::new(
            Tensor::cat(parts, phys),
            stacked.len(),
        )));
    }
    if values.iter().all(|v| matches!(v, Value::Bool(_))) {
        let parts = values
            .into_iter()
            .map(Value::into_bool)
            .collect::<OpResult<Vec<_>>>()?;
        let views: Vec<_> = parts.iter().map(|a| a.view()).collect();
        return Ok(Value::Bool(ndarray::stack(Axis(axis), &views)?));
    }
    let parts = values
        .into_iter()
        .map(Value::into_int)
        .collect::<OpResult<Vec<_>>>()?;
    let views: Vec<_> = parts.iter().map(|a| a.view()).collect();
    Ok(Value::Int(ndarray::stack(Axis(axis), &views)?))
}

/// The scan output of zero iterations: empty along `axis`, the other dims as the body
/// declares them (none when any is unknown), of the declared element type.
fn empty_scan_output(info: &TensorInfo, axis: i64, ctx: &OpContext) -> OpResult<Value> {
    let mut shape: Vec<usize> = info
        .dims
        .iter()
        .map(|d| match d {
            Dim::Fixed(n) => Some(*n),
            Dim::Symbolic(_) => None,
        })
        .collect::<Option<_>>()
        .unwrap_or_default();
    let axis = norm_axis(axis, shape.len() + 1)?;
    shape.insert(axis, 0);
    Ok(if info.elem_type == dtype::BOOL {
        Value::Bool(ArrayD::from_elem(IxDyn(&shape), false))
    } else if dtype::is_int(info.elem_type) {
        Value::Int(ArrayD::zeros(IxDyn(&shape)))
    } else {
        Value::Float(FloatValue::from_array(
            &ArrayD::zeros(IxDyn(&shape)),
            ctx.device,
        )?)
    })
}

/// `If`: the outputs of `then_branch` or `else_branch`, as the condition says.
pub fn if_op(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let (mut formal, outer) = split_inputs(ctx, inputs)?;
    let Some(cond) = formal.get_mut(0).and_then(Option::take) else {
        op_bail!("missing required input 0 (cond)")
    };
    let branch = if flag(cond, "cond")? {
        "then_branch"
    } else {
        "else_branch"
    };
    let body = ctx.attrs.graph(branch)?;
    let runner = Runner::new(ctx, body, &outer)?;
    let values = runner.run(Vec::new(), 0)?;
    Ok(OpOutput {
        values,
        state_updates: runner.state_updates(formal.len()),
    })
}

/// `Loop`: runs the body while the trip count `M` (if given) is not reached and the
/// condition (if given, then as the body returns it) holds; outputs the final loop-carried
/// values, then each scan output stacked along a new axis 0.
pub fn loop_op(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let (mut formal, outer) = split_inputs(ctx, inputs)?;
    let formal_count = formal.len();
    let body = ctx.attrs.graph("body")?;
    if formal.len() < 2 {
        formal.resize_with(2, || None);
    }
    let trip_count = match formal[0].take() {
        Some(m) => {
            let v = m.int_list("M")?;
            let [m] = v[..] else {
                op_bail!("M must hold one element, got {}", v.len())
            };
            m.max(0) as u64
        }
        None => u64::MAX,
    };
    let mut keep = match formal[1].take() {
        Some(c) => flag(c, "cond")?,
        None => true,
    };
    let mut carried = formal
        .into_iter()
        .skip(2)
        .enumerate()
        .map(|(i, v)| v.ok_or_else(|| OpError(format!("loop-carried input {} is missing", i + 2))))
        .collect::<OpResult<Vec<_>>>()?;
    let n = carried.len();
    if body.inputs.len() != n + 2 || body.outputs.len() < n + 1 {
        op_bail!(
            "the body takes {} inputs and gives {} outputs; with {n} loop-carried values it must take {} and give at least {}",
            body.inputs.len(),
            body.outputs.len(),
            n + 2,
            n + 1
        );
    }
    let k = body.outputs.len() - 1 - n;
    let runner = Runner::new(ctx, body, &outer)?;
    let mut scans: Vec<Vec<Value>> = (0..k).map(|_| Vec::new()).collect();
    let mut i = 0u64;
    while i < trip_count && keep {
        let mut ins = Vec::with_capacity(n + 2);
        ins.push(int_scalar(i as i64));
        ins.push(bool_scalar(keep));
        ins.append(&mut carried);
        let mut out = runner.run(ins, i)?.into_iter();
        keep = flag(
            out.next().expect("checked above"),
            "the body's condition output",
        )?;
        carried = out.by_ref().take(n).collect();
        for (s, v) in scans.iter_mut().zip(out) {
            s.push(v);
        }
        i += 1;
    }
    let mut values = carried;
    for (j, s) in scans.into_iter().enumerate() {
        values.push(if s.is_empty() {
            empty_scan_output(&body.outputs[1 + n + j], 0, ctx)?
        } else {
            stack(s, 0, ctx)?
        });
    }
    Ok(OpOutput {
        values,
        state_updates: runner.state_updates(formal_count),
    })
}

/// The settings of one scan: axes and directions of the scan inputs and outputs.
struct ScanPlan {
    in_axes: Vec<i64>,
    in_reverse: Vec<bool>,
    out_axes: Vec<i64>,
    out_reverse: Vec<bool>,
}

/// One scan (opset 9+ semantics): iterate the body over slices of `scans`, carrying
/// `states`; the final states, then the stacked scan outputs.
fn scan_once(
    runner: &Runner,
    mut states: Vec<Value>,
    scans: &[Value],
    plan: &ScanPlan,
) -> OpResult<Vec<Value>> {
    let ctx = runner.ctx;
    let n = states.len();
    let k = runner.body.outputs.len().saturating_sub(n);
    let mut axes = Vec::with_capacity(scans.len());
    let mut length = None;
    for (j, v) in scans.iter().enumerate() {
        let axis = norm_axis(plan.in_axes.get(j).copied().unwrap_or(0), v.rank())?;
        let len = v.shape()[axis];
        if length.is_some_and(|l| l != len) {
            op_bail!(
                "scan inputs differ in length: {} and {len} (scan input {j})",
                length.unwrap_or(0)
            );
        }
        length = Some(len);
        axes.push(axis);
    }
    let length = length.unwrap_or(0);
    let mut outs: Vec<Vec<Value>> = (0..k).map(|_| Vec::with_capacity(length)).collect();
    for t in 0..length {
        let mut ins = Vec::with_capacity(n + scans.len());
        ins.append(&mut states);
        for (j, v) in scans.iter().enumerate() {
            let at = if plan.in_reverse.get(j).copied().unwrap_or(false) {
                length - 1 - t
            } else {
                t
            };
            ins.push(index_axis(v, axes[j], at)?);
        }
        let mut out = runner.run(ins, t as u64)?.into_iter();
        states = out.by_ref().take(n).collect();
        for (s, v) in outs.iter_mut().zip(out) {
            s.push(v);
        }
    }
    let mut values = states;
    for (j, mut s) in outs.into_iter().enumerate() {
        let axis = plan.out_axes.get(j).copied().unwrap_or(0);
        if s.is_empty() {
            values.push(empty_scan_output(&runner.body.outputs[n + j], axis, ctx)?);
            continue;
        }
        if plan.out_reverse.get(j).copied().unwrap_or(false) {
            s.reverse();
        }
        let axis = norm_axis(axis, s[0].rank() + 1)?;
        values.push(stack(s, axis, ctx)?);
    }
    Ok(values)
}

fn flags(v: Option<Vec<i64>>) -> Vec<bool> {
    v.unwrap_or_default().into_iter().map(|d| d != 0).collect()
}

/// `Scan`. Opset 9+: inputs are the initial states, then `num_scan_inputs` scan inputs
/// sliced along `scan_input_axes` (in `scan_input_directions`); outputs are the final
/// states, then the scan outputs stacked along `scan_output_axes` (in
/// `scan_output_directions`). Opset 8: a leading optional `sequence_lens` input, and a
/// batch axis 0 on every state and scan input (the scan axis is 1), each batch entry
/// scanned on its own; sequences shorter than the scan axis are not supported.
pub fn scan_op(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let (mut formal, outer) = split_inputs(ctx, inputs)?;
    let formal_count = formal.len();
    let body = ctx.attrs.graph("body")?;
    let m = ctx.attrs.int("num_scan_inputs", -1)?;
    if m < 1 {
        op_bail!("attribute `num_scan_inputs` must be at least 1, got {m}");
    }
    let m = m as usize;
    let runner = Runner::new(ctx, body, &outer)?;
    if ctx.opset < 9 {
        let lens = match formal.first_mut().and_then(Option::take) {
            Some(v) => Some(v.int_list("sequence_lens")?),
            None => None,
        };
        let values = formal
            .into_iter()
            .skip(1)
            .enumerate()
            .map(|(i, v)| v.ok_or_else(|| OpError(format!("input {} is missing", i + 1))))
            .collect::<OpResult<Vec<_>>>()?;
        if values.len() < m {
            op_bail!("{} inputs, fewer than num_scan_inputs = {m}", values.len());
        }
        let n = values.len() - m;
        let batch = values[0].shape().first().copied().unwrap_or(0);
        let plan = ScanPlan {
            in_axes: vec![0; m],
            in_reverse: flags(ctx.attrs.ints("directions")?),
            out_axes: Vec::new(),
            out_reverse: Vec::new(),
        };
        if batch == 0 {
            op_bail!("an empty batch is not supported");
        }
        let mut per_batch: Vec<Vec<Value>> = Vec::new();
        for b in 0..batch {
            let sliced = values
                .iter()
                .map(|v| index_axis(v, 0, b))
                .collect::<OpResult<Vec<_>>>()?;
            if let Some(lens) = &lens {
                let full = sliced[n].shape().first().copied().unwrap_or(0) as i64;
                if lens.get(b).is_some_and(|&l| l != full) {
                    op_bail!(
                        "sequence_lens[{b}] = {} is shorter than the scan axis ({full}): not supported",
                        lens[b]
                    );
                }
            }
            let (states, scans) = sliced.split_at(n);
            let out = scan_once(&runner, states.to_vec(), scans, &plan)?;
            for (j, v) in out.into_iter().enumerate() {
                if per_batch.len() <= j {
                    per_batch.push(Vec::with_capacity(batch));
                }
                per_batch[j].push(v);
            }
        }
        let values = per_batch
            .into_iter()
            .map(|v| stack(v, 0, ctx))
            .collect::<OpResult<Vec<_>>>()?;
        return Ok(OpOutput {
            values,
            state_updates: runner.state_updates(formal_count),
        });
    }
    let values = formal
        .into_iter()
        .enumerate()
        .map(|(i, v)| v.ok_or_else(|| OpError(format!("input {i} is missing"))))
        .collect::<OpResult<Vec<_>>>()?;
    if values.len() < m {
        op_bail!("{} inputs, fewer than num_scan_inputs = {m}", values.len());
    }
    let n = values.len() - m;
    let plan = ScanPlan {
        in_axes: ctx.attrs.ints("scan_input_axes")?.unwrap_or_default(),
        in_reverse: flags(ctx.attrs.ints("scan_input_directions")?),
        out_axes: ctx.attrs.ints("scan_output_axes")?.unwrap_or_default(),
        out_reverse: flags(ctx.attrs.ints("scan_output_directions")?),
    };
    let (states, scans) = values.split_at(n);
    let values = scan_once(&runner, states.to_vec(), scans, &plan)?;
    Ok(OpOutput {
        values,
        state_updates: runner.state_updates(formal_count),
    })
}
