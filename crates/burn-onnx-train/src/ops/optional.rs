//! `Optional`, `OptionalHasElement` and `OptionalGetElement` on tensors and sequences: an
//! optional that holds a value is carried as that value, and an absent input (an empty
//! name, or an optional graph input not given) is the empty optional. An empty optional as a value (`Optional` without input)
//! is not represented yet: it is an error naming the node.

use ndarray::{ArrayD, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::Value;

/// `Optional(input?)`: the input itself; without one, an error (no empty-optional value).
pub fn optional(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    match inputs.opt(0) {
        Some(v) => Ok(v.into()),
        None => op_bail!("an empty optional (Optional without input) is not supported"),
    }
}

/// `OptionalHasElement(input?)`: a scalar bool, false when the input is absent.
pub fn optional_has_element(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let has = inputs.opt(0).is_some();
    Ok(Value::Bool(ArrayD::from_elem(IxDyn(&[]), has)).into())
}

/// `OptionalGetElement(input)`: the tensor the optional holds; an absent input is an error.
pub fn optional_get_element(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    match inputs.opt(0) {
        Some(v) => Ok(v.into()),
        None => op_bail!("the optional input is empty: there is no element to get"),
    }
}
