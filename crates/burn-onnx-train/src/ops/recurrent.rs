//! `RNN`, `GRU` and `LSTM` (opsets 7 to 22), unrolled over time with Burn tensor ops, so
//! differentiable in X, W, R, B, `initial_h`, `initial_c` and the LSTM peepholes P.
//!
//! Each direction projects the whole sequence through `W` in one product (`X W^T` plus
//! the biases that sit outside the recurrence), then steps through time with one product
//! by `R^T` per step. Gate orders are the spec's: GRU `z, r, h`, LSTM `i, o, f, c`
//! (peepholes `i, o, f`).
//!
//! `sequence_lens` is honoured as onnxruntime does: a batch entry's steps past its length
//! leave its state unchanged and give zeros in `Y`, so `Y_h`/`Y_c` hold its last valid
//! state (zeros for a length of 0); the reverse direction of an entry starts at its own last
//! valid step. The reverse direction runs the forward recurrence over the time-reversed
//! prefix of each entry (a row gather that is its own inverse) and gathers its outputs back.
//!
//! Activations are the spec's list, case-insensitive; `activation_alpha`/`activation_beta`
//! are consumed in order by the activations that take them (Affine, LeakyRelu,
//! ThresholdedRelu, ScaledTanh, HardSigmoid, Elu), the rest falling back to the ONNX
//! operators' defaults, as onnxruntime reads them. `clip` bounds every activation's input
//! (LSTM's `h(C)` included, while the cell state itself stays unclipped).

use burn::tensor::activation;
use burn::tensor::{Bool, Int, Tensor, TensorData};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::graph::attributes::Attr;
use crate::op_bail;
use crate::value::{FloatValue, Value, int_tensor_1d, padded};

/// Which recurrent op.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cell {
    Rnn,
    Gru,
    Lstm,
}

impl Cell {
    /// Gates stacked in W and R.
    fn gates(self) -> usize {
        match self {
            Cell::Rnn => 1,
            Cell::Gru => 3,
            Cell::Lstm => 4,
        }
    }

    /// The default activations of one direction.
    fn default_activations(self) -> &'static [&'static str] {
        match self {
            Cell::Rnn => &["Tanh"],
            Cell::Gru => &["Sigmoid", "Tanh"],
            Cell::Lstm => &["Sigmoid", "Tanh", "Tanh"],
        }
    }
}

/// One activation function with its parameters.
#[derive(Clone, Copy, Debug)]
enum Act {
    Relu,
    Tanh,
    Sigmoid,
    Affine(f32, f32),
    LeakyRelu(f32),
    ThresholdedRelu(f32),
    ScaledTanh(f32, f32),
    HardSigmoid(f32, f32),
    Elu(f32),
    Softsign,
    Softplus,
}

impl Act {
    /// Parse an activation name, taking its alpha and beta from the front of the lists
    /// when it has them (the default otherwise).
    fn parse(
        name: &str,
        alphas: &mut impl Iterator<Item = f32>,
        betas: &mut impl Iterator<Item = f32>,
    ) -> OpResult<Act> {
        let mut alpha = |default: f32| alphas.next().unwrap_or(default);
        Ok(match name.to_ascii_lowercase().as_str() {
            "relu" => Act::Relu,
            "tanh" => Act::Tanh,
            "sigmoid" => Act::Sigmoid,
            "softsign" => Act::Softsign,
            "softplus" => Act::Softplus,
            "leakyrelu" => Act::LeakyRelu(alpha(0.01)),
            "thresholdedrelu" => Act::ThresholdedRelu(alpha(1.0)),
            "elu" => Act::Elu(alpha(1.0)),
            "affine" => {
                let a = alpha(1.0);
                Act::Affine(a, betas.next().unwrap_or(0.0))
            }
            "scaledtanh" => {
                let a = alpha(1.0);
                Act::ScaledTanh(a, betas.next().unwrap_or(1.0))
            }
            "hardsigmoid" => {
                let a = alpha(0.2);
                Act::HardSigmoid(a, betas.next().unwrap_or(0.5))
            }
            _ => op_bail!(
                "unknown activation {name:?} (expected Relu, Tanh, Sigmoid, Affine, LeakyRelu, \
                 ThresholdedRelu, ScaledTanh, HardSigmoid, Elu, Softsign or Softplus)"
            ),
        })
    }

    /// The function of `x`, its input first bounded to `[-clip, clip]` when there is a clip.
    fn apply(self, x: Tensor<2>, clip: Option<f32>) -> Tensor<2> {
        let x = match clip {
            Some(c) => x.clamp(-c, c),
            None => x,
        };
        match self {
            Act::Relu => activation::relu(x),
            Act::Tanh => x.tanh(),
            Act::Sigmoid => activation::sigmoid(x),
            Act::Affine(a, b) => x.mul_scalar(a).add_scalar(b),
            Act::LeakyRelu(a) => activation::leaky_relu(x, a as f64),
            Act::ThresholdedRelu(a) => {
                let below = x.clone().lower_equal_elem(a);
                x.mask_fill(below, 0.0)
            }
            Act::ScaledTanh(a, b) => x.mul_scalar(b).tanh().mul_scalar(a),
            Act::HardSigmoid(a, b) => activation::hard_sigmoid(x, a as f64, b as f64),
            Act::Elu(a) => activation::elu(x, a as f64),
            Act::Softsign => x.clone() / x.abs().add_scalar(1.0),
            Act::Softplus => activation::softplus(x, 1.0),
        }
    }
}

/// The node's activations, one list per direction.
fn activations(ctx: &OpContext, cell: Cell, directions: usize) -> OpResult<Vec<Vec<Act>>> {
    let per = cell.default_activations().len();
    let names: Vec<String> = match ctx.attrs.get("activations") {
        None => cell
            .default_activations()
            .iter()
            .cycle()
            .take(per * directions)
            .map(|s| s.to_string())
            .collect(),
        Some(Attr::Strings(v)) => v.clone(),
        Some(other) => {
            op_bail!("attribute `activations` should be a list of strings, got {other:?}")
        }
    };
    let floats = |name: &str| -> OpResult<Vec<f32>> {
        match ctx.attrs.get(name) {
            None => Ok(Vec::new()),
            Some(Attr::Floats(v)) => Ok(v.clone()),
            Some(Attr::Float(v)) => Ok(vec![*v]),
            Some(other) => op_bail!("attribute `{name}` should be a list of floats, got {other:?}"),
        }
    };
    let (alphas, betas) = (floats("activation_alpha")?, floats("activation_beta")?);
    let (mut alphas, mut betas) = (alphas.into_iter(), betas.into_iter());
    let acts = names
        .iter()
        .map(|n| Act::parse(n, &mut alphas, &mut betas))
        .collect::<OpResult<Vec<_>>>()?;
    if acts.len() == per * directions {
        Ok(acts.chunks(per).map(<[Act]>::to_vec).collect())
    } else if acts.len() == per {
        // One direction's list given for a bidirectional node: both use it.
        Ok(vec![acts; directions])
    } else {
        op_bail!(
            "attribute `activations` has {} entries, expected {} ({per} per direction)",
            acts.len(),
            per * directions
        )
    }
}

/// An optional float input.
fn opt_float(inputs: &mut Inputs, i: usize, ctx: &OpContext) -> OpResult<Option<FloatValue>> {
    inputs.opt(i).map(|v| v.into_float(ctx.device)).transpose()
}

/// Refuse a value whose shape is not `want`.
fn check_shape(v: &FloatValue, want: &[usize], what: &str) -> OpResult<()> {
    if v.shape() != want {
        op_bail!("{what} has shape {:?}, expected {want:?}", v.shape());
    }
    Ok(())
}

/// `a [m, k] x b [k, n]` through the crate's matmul kernel.
fn mm(a: Tensor<2>, b: Tensor<2>) -> OpResult<Tensor<2>> {
    let (da, db) = (a.dims(), b.dims());
    let a = a.reshape(padded(&da)?);
    let b = b.reshape(padded(&db)?);
    Ok(crate::kernels::matmul(a, b).reshape([da[0], db[1]]))
}

/// Row `d` of a `[directions, ..]` tensor as `[rows, cols]`.
fn direction_slice(t: &Tensor<3>, d: usize) -> Tensor<2> {
    let [_, rows, cols] = t.dims();
    t.clone().narrow(0, d, 1).reshape([rows, cols])
}

/// What one direction needs, besides the sequence.
struct DirParams {
    /// `R^T`, `[hidden, gates * hidden]`.
    r_t: Tensor<2>,
    /// `Rb_h` for GRU with `linear_before_reset` (it goes inside the reset product).
    rb_h: Option<Tensor<2>>,
    /// LSTM peepholes `i, o, f`, each `[1, hidden]`.
    peep: Option<[Tensor<2>; 3]>,
    /// The direction's activations.
    acts: Vec<Act>,
    /// Whether the direction runs backwards in time.
    reverse: bool,
}

/// Settings shared by every direction.
struct Setup {
    cell: Cell,
    hidden: usize,
    clip: Option<f32>,
    linear_before_reset: bool,
    input_forget: bool,
}

/// One time step: the new hidden (and cell) state from the projected input `xt`
/// (`[batch, gates * hidden]`, input biases included) and the previous states.
fn step(
    s: &Setup,
    p: &DirParams,
    xt: Tensor<2>,
    h: Tensor<2>,
    c: Option<Tensor<2>>,
) -> OpResult<(Tensor<2>, Option<Tensor<2>>)> {
    let hs = s.hidden;
    let f = p.acts[0];
    Ok(match s.cell {
        Cell::Rnn => (f.apply(xt + mm(h, p.r_t.clone())?, s.clip), None),
        Cell::Gru => {
            let g = p.acts[1];
            let (zr, h_pre) = if s.linear_before_reset {
                let hr = mm(h.clone(), p.r_t.clone())?;
                let zr = xt.clone().narrow(1, 0, 2 * hs) + hr.clone().narrow(1, 0, 2 * hs);
                let mut rh = hr.narrow(1, 2 * hs, hs);
                if let Some(b) = &p.rb_h {
                    rh = rh + b.clone();
                }
                (zr, Some(rh))
            } else {
                let hr = mm(h.clone(), p.r_t.clone().narrow(1, 0, 2 * hs))?;
                (xt.clone().narrow(1, 0, 2 * hs) + hr, None)
            };
            let z = f.apply(zr.clone().narrow(1, 0, hs), s.clip);
            let r = f.apply(zr.narrow(1, hs, hs), s.clip);
            let xh = xt.narrow(1, 2 * hs, hs);
            let pre = match h_pre {
                Some(rh) => xh + r * rh,
                None => xh + mm(r * h.clone(), p.r_t.clone().narrow(1, 2 * hs, hs))?,
            };
            let cand = g.apply(pre, s.clip);
            // (1 - z) * cand + z * h
            (cand.clone() + z * (h - cand), None)
        }
        Cell::Lstm => {
            let (g, hact) = (p.acts[1], p.acts[2]);
            let Some(c) = c else {
                op_bail!("internal error: LSTM step without a cell state")
            };
            let gates = xt + mm(h, p.r_t.clone())?;
            let mut i_pre = gates.clone().narrow(1, 0, hs);
            let mut o_pre = gates.clone().narrow(1, hs, hs);
            let mut f_pre = gates.clone().narrow(1, 2 * hs, hs);
            let c_pre = gates.narrow(1, 3 * hs, hs);
            if let Some([pi, _, pf]) = &p.peep {
                i_pre = i_pre + pi.clone() * c.clone();
                f_pre = f_pre + pf.clone() * c.clone();
            }
            let i = f.apply(i_pre, s.clip);
            let forget = if s.input_forget {
                i.clone().neg().add_scalar(1.0)
            } else {
                f.apply(f_pre, s.clip)
            };
            let cand = g.apply(c_pre, s.clip);
            let c_new = forget * c + i * cand;
            if let Some([_, po, _]) = &p.peep {
                o_pre = o_pre + po.clone() * c_new.clone();
            }
            let o = f.apply(o_pre, s.clip);
            let h_new = o * hact.apply(c_new.clone(), s.clip);
            (h_new, Some(c_new))
        }
    })
}

/// Per-entry lengths and the masks they imply.
struct Lengths {
    lens: Vec<usize>,
    min: usize,
    max: usize,
}

impl Lengths {
    /// `[batch, hidden]` mask of the entries whose step `t` is valid.
    fn valid_at(&self, t: usize, hidden: usize, ctx: &OpContext) -> Tensor<2, Bool> {
        let data: Vec<bool> = self
            .lens
            .iter()
            .flat_map(|&l| std::iter::repeat_n(t < l, hidden))
            .collect();
        Tensor::from_data(TensorData::new(data, [self.lens.len(), hidden]), ctx.device)
    }

    /// `[batch, hidden]` mask of the entries of length 0, if there are any.
    fn empty(&self, hidden: usize, ctx: &OpContext) -> Option<Tensor<2, Bool>> {
        (self.min == 0).then(|| {
            let data: Vec<bool> = self
                .lens
                .iter()
                .flat_map(|&l| std::iter::repeat_n(l == 0, hidden))
                .collect();
            Tensor::from_data(TensorData::new(data, [self.lens.len(), hidden]), ctx.device)
        })
    }

    /// Row indices into a flattened `[seq * batch, ..]` tensor that reverse each entry's
    /// first `len` steps and leave its padding in place (its own inverse).
    fn reversal(&self, seq: usize, ctx: &OpContext) -> Tensor<1, Int> {
        let batch = self.lens.len();
        let idx = (0..seq)
            .flat_map(|t| {
                self.lens.iter().enumerate().map(move |(b, &l)| {
                    let src = if t < l { l - 1 - t } else { t };
                    (src * batch + b) as i64
                })
            })
            .collect();
        int_tensor_1d(idx, ctx.device)
    }
}

/// Reorder the time steps of a `[seq, batch, width]` tensor by a reversal index.
fn reorder(t: Tensor<3>, idx: Tensor<1, Int>) -> Tensor<3> {
    let [seq, batch, width] = t.dims();
    t.reshape([seq * batch, width])
        .select(0, idx)
        .reshape([seq, batch, width])
}

/// Run one direction over `xw` (`[seq, batch, gates * hidden]`, the input projection with
/// the biases outside the recurrence): `Y` `[seq, batch, hidden]`, the final hidden state and
/// (LSTM) the final cell state.
fn run_direction(
    s: &Setup,
    p: &DirParams,
    xw: Tensor<3>,
    h0: Tensor<2>,
    c0: Option<Tensor<2>>,
    lens: &Lengths,
    ctx: &OpContext,
) -> OpResult<(Tensor<3>, Tensor<2>, Option<Tensor<2>>)> {
    let [seq, batch, _] = xw.dims();
    let hs = s.hidden;
    let reversal = p.reverse.then(|| lens.reversal(seq, ctx));
    let xw = match &reversal {
        Some(idx) => reorder(xw, idx.clone()),
        None => xw,
    };
    let (mut h, mut c) = (h0, c0);
    let mut ys = Vec::with_capacity(seq);
    for t in 0..lens.max {
        let xt = xw.clone().narrow(0, t, 1).reshape([batch, xw.dims()[2]]);
        let (h_new, c_new) = step(s, p, xt, h.clone(), c.clone())?;
        if t < lens.min {
            ys.push(h_new.clone());
            (h, c) = (h_new, c_new);
        } else {
            // Entries already past their length keep their state and output zeros.
            let valid = lens.valid_at(t, hs, ctx);
            ys.push(h_new.clone().mask_fill(valid.clone().bool_not(), 0.0));
            h = h.mask_where(valid.clone(), h_new);
            c = match (c, c_new) {
                (Some(c), Some(c_new)) => Some(c.mask_where(valid, c_new)),
                _ => None,
            };
        }
    }
    if let Some(empty) = lens.empty(hs, ctx) {
        h = h.mask_fill(empty.clone(), 0.0);
        c = c.map(|c| c.mask_fill(empty, 0.0));
    }
    let dtype = h.dtype();
    let mut y = if ys.is_empty() {
        Tensor::zeros([seq, batch, hs], (ctx.device, dtype))
    } else {
        Tensor::stack::<3>(ys, 0)
    };
    if lens.max > 0 && lens.max < seq {
        let pad = Tensor::zeros([seq - lens.max, batch, hs], (ctx.device, dtype));
        y = Tensor::cat(vec![y, pad], 0);
    }
    if let Some(idx) = reversal {
        y = reorder(y, idx);
    }
    Ok((y, h, c))
}

/// The shared body of the three ops.
fn recurrent(ctx: &OpContext, mut inputs: Inputs, cell: Cell) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let w = inputs.float(1, "W", ctx.device)?;
    let r = inputs.float(2, "R", ctx.device)?;
    let b = opt_float(&mut inputs, 3, ctx)?;
    let seq_lens = inputs.opt(4).map(Value::into_int).transpose()?;
    let init_h = opt_float(&mut inputs, 5, ctx)?;
    let (init_c, peep) = match cell {
        Cell::Lstm => (
            opt_float(&mut inputs, 6, ctx)?,
            opt_float(&mut inputs, 7, ctx)?,
        ),
        _ => (None, None),
    };

    let direction = ctx.attrs.string("direction", "forward")?;
    let (nd, dirs): (usize, &[bool]) = match direction.as_str() {
        "forward" => (1, &[false]),
        "reverse" => (1, &[true]),
        "bidirectional" => (2, &[false, true]),
        other => op_bail!(
            "attribute `direction` must be \"forward\", \"reverse\" or \"bidirectional\", got \
             {other:?}"
        ),
    };
    let layout = ctx.attrs.int("layout", 0)?;
    if layout != 0 && layout != 1 {
        op_bail!("attribute `layout` must be 0 or 1, got {layout}");
    }
    let batch_major = layout == 1;
    let clip = if ctx.attrs.has("clip") {
        let c = ctx.attrs.float("clip", 0.0)?;
        if c.is_nan() || c < 0.0 {
            op_bail!("attribute `clip` must be a non-negative threshold, got {c}");
        }
        Some(c)
    } else {
        None
    };
    let acts = activations(ctx, cell, nd)?;

    // Shapes.
    let gates = cell.gates();
    let [d0, d1, input] = x.shape()[..] else {
        op_bail!("X must be 3-D, got shape {:?}", x.shape())
    };
    let (seq, batch) = if batch_major { (d1, d0) } else { (d0, d1) };
    let r_shape = r.shape();
    let hs = match r_shape[..] {
        [_, _, h] => h,
        _ => op_bail!("R must be 3-D, got shape {r_shape:?}"),
    };
    if ctx.attrs.has("hidden_size") {
        let attr = ctx.attrs.int("hidden_size", 0)?;
        if attr != hs as i64 {
            op_bail!("attribute `hidden_size` is {attr} but R has shape {r_shape:?}");
        }
    }
    if hs == 0 || seq == 0 || batch == 0 || input == 0 {
        op_bail!(
            "empty sequences are not supported: X has shape {:?}, hidden size {hs}",
            x.shape()
        );
    }
    check_shape(&w, &[nd, gates * hs, input], "W")?;
    check_shape(&r, &[nd, gates * hs, hs], "R")?;
    if let Some(b) = &b {
        check_shape(b, &[nd, 2 * gates * hs], "B")?;
    }
    let state_shape = if batch_major {
        [batch, nd, hs]
    } else {
        [nd, batch, hs]
    };
    if let Some(v) = &init_h {
        check_shape(v, &state_shape, "initial_h")?;
    }
    if let Some(v) = &init_c {
        check_shape(v, &state_shape, "initial_c")?;
    }
    if let Some(p) = &peep {
        check_shape(p, &[nd, 3 * hs], "P")?;
    }
    let lens = match seq_lens {
        None => vec![seq; batch],
        Some(a) => {
            if a.len() != batch {
                op_bail!(
                    "sequence_lens has {} elements, expected one per batch entry ({batch})",
                    a.len()
                );
            }
            a.iter()
                .map(|&l| match usize::try_from(l) {
                    Ok(l) if l <= seq => Ok(l),
                    _ => op_bail!("sequence_lens holds {l}, outside 0..={seq}"),
                })
                .collect::<OpResult<Vec<_>>>()?
        }
    };
    let lens = Lengths {
        min: lens.iter().copied().min().unwrap_or(0),
        max: lens.iter().copied().max().unwrap_or(0),
        lens,
    };

    let setup = Setup {
        cell,
        hidden: hs,
        clip,
        linear_before_reset: cell == Cell::Gru && ctx.attrs.int("linear_before_reset", 0)? != 0,
        input_forget: cell == Cell::Lstm && ctx.attrs.int("input_forget", 0)? != 0,
    };

    // Everything as [seq, batch, ..] and [directions, batch, hidden].
    let x = x.into_rank::<3>()?;
    let x = if batch_major { x.swap_dims(0, 1) } else { x };
    let x2 = x.reshape([seq * batch, input]);
    let state = |v: Option<FloatValue>| -> OpResult<Option<Tensor<3>>> {
        v.map(|v| {
            let t = v.into_rank::<3>()?;
            Ok(if batch_major { t.swap_dims(0, 1) } else { t })
        })
        .transpose()
    };
    let init_h = state(init_h)?;
    let init_c = state(init_c)?;
    let w = w.into_rank::<3>()?;
    let r = r.into_rank::<3>()?;
    let b = b
        .map(|b| b.reshape(&[nd, 1, 2 * gates * hs])?.into_rank::<3>())
        .transpose()?;
    let peep = peep
        .map(|p| p.reshape(&[nd, 1, 3 * hs])?.into_rank::<3>())
        .transpose()?;
    let dtype = x2.dtype();
    let zeros = || Tensor::<2>::zeros([batch, hs], (ctx.device, dtype));

    let (mut ys, mut hs_out, mut cs_out) = (Vec::new(), Vec::new(), Vec::new());
    for (d, &reverse) in dirs.iter().enumerate() {
        let w_d = direction_slice(&w, d);
        let r_d = direction_slice(&r, d);
        let mut xw = mm(x2.clone(), w_d.transpose())?;
        let mut rb_h = None;
        if let Some(b) = &b {
            let b_d = direction_slice(b, d);
            let wb = b_d.clone().narrow(1, 0, gates * hs);
            let rb = b_d.narrow(1, gates * hs, gates * hs);
            let bias = if setup.linear_before_reset {
                rb_h = Some(rb.clone().narrow(1, 2 * hs, hs));
                let zeros_h = Tensor::<2>::zeros([1, hs], (ctx.device, dtype));
                wb + Tensor::cat(vec![rb.narrow(1, 0, 2 * hs), zeros_h], 1)
            } else {
                wb + rb
            };
            xw = xw + bias;
        }
        let xw = xw.reshape([seq, batch, gates * hs]);
        let params = DirParams {
            r_t: r_d.transpose(),
            rb_h,
            peep: peep.as_ref().map(|p| {
                let p_d = direction_slice(p, d);
                [0, 1, 2].map(|k| p_d.clone().narrow(1, k * hs, hs))
            }),
            acts: acts[d].clone(),
            reverse,
        };
        let h0 = init_h
            .as_ref()
            .map_or_else(zeros, |h| direction_slice(h, d));
        let c0 = (cell == Cell::Lstm).then(|| {
            init_c
                .as_ref()
                .map_or_else(zeros, |c| direction_slice(c, d))
        });
        let (y, h, c) = run_direction(&setup, &params, xw, h0, c0, &lens, ctx)?;
        ys.push(y);
        hs_out.push(h);
        cs_out.extend(c);
    }

    // Y [seq, directions, batch, hidden]; Y_h, Y_c [directions, batch, hidden] (layout 0).
    let y = Tensor::stack::<4>(ys, 1);
    let y_h = Tensor::stack::<3>(hs_out, 0);
    let y_c = (!cs_out.is_empty()).then(|| Tensor::stack::<3>(cs_out, 0));
    let (y, y_h, y_c) = if batch_major {
        (
            y.permute([2, 0, 1, 3]),
            y_h.swap_dims(0, 1),
            y_c.map(|c| c.swap_dims(0, 1)),
        )
    } else {
        (y, y_h, y_c)
    };
    let mut values = vec![
        Value::Float(FloatValue::from_rank(y)?),
        Value::Float(FloatValue::from_rank(y_h)?),
    ];
    if let Some(c) = y_c {
        values.push(Value::Float(FloatValue::from_rank(c)?));
    }
    values.truncate(ctx.num_outputs.max(1));
    Ok(values.into())
}

/// `RNN` (opsets 7, 14, 22): `H_t = f(X_t W^T + H_{t-1} R^T + Wb + Rb)`, default `f` Tanh.
pub fn rnn(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    recurrent(ctx, inputs, Cell::Rnn)
}

/// `GRU` (opsets 7, 14, 22), gates `z, r, h`, default activations Sigmoid, Tanh; with
/// `linear_before_reset` the reset gate multiplies `H_{t-1} R_h^T + Rb_h` instead of
/// `H_{t-1}`.
pub fn gru(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    recurrent(ctx, inputs, Cell::Gru)
}

/// `LSTM` (opsets 7, 14, 22), gates `i, o, f, c`, peepholes `i, o, f`, default activations
/// Sigmoid, Tanh, Tanh; with `input_forget` the forget gate is `1 - i`.
pub fn lstm(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    recurrent(ctx, inputs, Cell::Lstm)
}
