//! The calling convention every op implements: what it is given ([`OpContext`], its
//! [`Inputs`]), what it returns ([`OpOutput`]), and the function type [`OpFn`] a [`Node`]
//! holds. The implementations live in `crate::ops`.
//!
//! [`Node`]: super::Node

use burn::tensor::{Device, FloatDType, Tensor};

use super::attributes::Attributes;
use crate::collective::Collectives;
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, Value};

/// What an op sees besides its inputs.
pub struct OpContext<'a> {
    /// Device for values created by the op.
    pub device: &'a Device,
    /// Training mode: dropout active, batch norm on batch statistics.
    pub train: bool,
    /// The model's `ai.onnx` opset version.
    pub opset: i64,
    /// The node's attributes.
    pub attrs: &'a Attributes,
    /// How many outputs the node declares.
    pub num_outputs: usize,
    /// Seed for this node's randomness (dropout masks): a pure function of the forward
    /// pass's seed and the node's position, so masks do not depend on threads or devices.
    pub seed: u64,
    /// The low precision of the autocast list (MatMul, Gemm, Conv, ConvTranspose), if any.
    pub autocast: Option<FloatDType>,
    /// The groups the model's collective ops run on (none outside a parallel run).
    pub collectives: &'a Collectives,
}

impl OpContext<'_> {
    /// `f` of `operands`, computed in the autocast precision when there is one: the
    /// operands are cast down and the result back to f32 (both casts differentiable, so
    /// gradients reach f32 parameters in f32).
    pub fn autocast<const N: usize>(
        &self,
        operands: [FloatValue; N],
        f: impl FnOnce([FloatValue; N]) -> OpResult<FloatValue>,
    ) -> OpResult<FloatValue> {
        let Some(low) = self.autocast else {
            return f(operands);
        };
        let out = f(operands.map(|v| FloatValue::new(v.tensor.cast(low), v.rank)))?;
        Ok(FloatValue::new(out.tensor.cast(FloatDType::F32), out.rank))
    }

    /// A bias added inside an autocast op, cast to the operands' precision.
    pub fn autocast_bias<const D: usize>(&self, bias: Option<Tensor<D>>) -> Option<Tensor<D>> {
        match self.autocast {
            Some(low) => bias.map(|b| b.cast(low)),
            None => bias,
        }
    }
}

/// What an op returns.
#[derive(Default)]
pub struct OpOutput {
    /// One value per node output, in order (trailing optional outputs may be missing).
    pub values: Vec<Value>,
    /// New values for stateful inputs, by input slot (batch norm running statistics).
    pub state_updates: Vec<(usize, FloatValue)>,
}

impl From<Vec<Value>> for OpOutput {
    fn from(values: Vec<Value>) -> Self {
        OpOutput {
            values,
            state_updates: Vec::new(),
        }
    }
}

impl From<Value> for OpOutput {
    fn from(value: Value) -> Self {
        vec![value].into()
    }
}

/// A node's inputs; empty input names (omitted optional inputs) are `None`.
pub struct Inputs(pub Vec<Option<Value>>);

impl Inputs {
    /// Take a required input.
    pub fn take(&mut self, i: usize, what: &str) -> OpResult<Value> {
        match self.0.get_mut(i).and_then(Option::take) {
            Some(v) => Ok(v),
            None => op_bail!("missing required input {i} ({what})"),
        }
    }

    /// Take an optional input.
    pub fn opt(&mut self, i: usize) -> Option<Value> {
        self.0.get_mut(i).and_then(Option::take)
    }

    /// Take a required input as a float tensor (ints/bools are converted).
    pub fn float(&mut self, i: usize, what: &str, device: &Device) -> OpResult<FloatValue> {
        self.take(i, what)?.into_float(device)
    }

    /// Take an optional input as a list of ints (axes, pads, shapes).
    pub fn int_list(&mut self, i: usize, what: &str) -> OpResult<Option<Vec<i64>>> {
        self.opt(i).map(|v| v.int_list(what)).transpose()
    }
}

/// Signature shared by every op.
pub type OpFn = fn(&OpContext, Inputs) -> OpResult<OpOutput>;
