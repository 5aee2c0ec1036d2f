//! Backward through a slice of the graph by hand: the inputs a slice receives become
//! gradient leaves, and the gradient of what it produced is pushed through with a
//! vector-Jacobian product (the gradient of `sum_i <output_i, grad_i>`). Pipeline stages
//! and activation recomputation are built on it.

use burn::tensor::{Gradients, Tensor};

use crate::value::{FloatValue, Value};

/// `values` with every float cut from any tape and made a gradient leaf, and those leaves
/// in order.
pub fn track(values: Vec<Value>) -> (Vec<Value>, Vec<FloatValue>) {
    let mut leaves = Vec::new();
    let tracked = values
        .into_iter()
        .map(|v| match v {
            Value::Float(f) => {
                let leaf = FloatValue::new(f.tensor.detach().require_grad(), f.rank);
                leaves.push(leaf.clone());
                Value::Float(leaf)
            }
            other => other,
        })
        .collect();
    (tracked, leaves)
}

/// The floats among `values`, in order.
pub fn floats(values: &[Value]) -> Vec<&FloatValue> {
    values
        .iter()
        .filter_map(|v| {
            if let Value::Float(f) = v {
                Some(f)
            } else {
                None
            }
        })
        .collect()
}

/// The scalar whose gradient is the vector-Jacobian product of `outputs` with `grads`
/// (`None` without outputs). Backward of an untracked one reaches nothing.
pub fn surrogate(outputs: &[&FloatValue], grads: Vec<FloatValue>) -> Option<Tensor<1>> {
    outputs
        .iter()
        .zip(grads)
        .map(|(o, g)| o.tensor.clone().mul(g.tensor).sum())
        .reduce(|a, b| a.add(b))
}

/// The gradients `grads` holds for `leaves` (zeros for a leaf nothing reached).
pub fn leaf_grads(leaves: &[FloatValue], grads: Option<&Gradients>) -> Vec<FloatValue> {
    leaves
        .iter()
        .map(|leaf| {
            let g = grads.and_then(|gr| leaf.tensor.grad(gr));
            FloatValue::new(g.unwrap_or_else(|| leaf.tensor.zeros_like()), leaf.rank)
        })
        .collect()
}
