//! The calling convention every op implements: what it is given ([`OpContext`], its
//! [`Inputs`], the [`PassMemo`] of device forms of masks and constants made during the
//! pass), what it returns
//! ([`OpOutput`]), and the function type [`OpFn`] a [`Node`] holds. The implementations
//! live in `crate::ops`.
//!
//! [`Node`]: super::Node

use std::sync::Arc;

use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use ndarray::ArrayD;

use super::attributes::Attributes;
use crate::collective::Collectives;
use crate::error::OpResult;
use crate::op_bail;
use crate::value::uploads::{DeviceUploads, HostKey, Made};
use crate::value::{FloatValue, MAX_RANK, PhysTensor, Value};

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
    /// Device forms of host masks, and constants, already made during this pass over the
    /// graph.
    pub memo: &'a PassMemo,
}

/// The device tensors a pass makes from host values: masks' device forms, constants and
/// gather indices, asked of the model's [`DeviceUploads`] by content, so that a value
/// equal to one made before (another layer's copy of the causal mask, dynamo's per-layer
/// `Not` of it; the position ids of every pass) is shared instead of converted and
/// uploaded again: each later reader pays a comparison of the bytes (a `memcmp`).
#[derive(Default, Clone)]
pub struct PassMemo {
    uploads: Arc<DeviceUploads>,
}

impl PassMemo {
    /// A pass's memo over `uploads` (the model's).
    pub fn new(uploads: Arc<DeviceUploads>) -> Self {
        PassMemo { uploads }
    }

    /// The device copies this memo asks.
    pub fn uploads(&self) -> &Arc<DeviceUploads> {
        &self.uploads
    }

    /// The `form` made of `mask` on `device`: `make` runs unless an equal mask had its
    /// `form` made already, whose tensor is shared then.
    pub fn device_form(
        &self,
        mask: &ArrayD<bool>,
        form: &'static str,
        device: &Device,
        make: impl FnOnce() -> OpResult<PhysTensor>,
    ) -> OpResult<PhysTensor> {
        let made = self
            .uploads
            .made(HostKey::Mask(mask, form), device, || make().map(Made::Phys))?;
        Ok(phys(made))
    }

    /// A one-element tensor holding `value` on `device` (broadcast to any rank), uploaded
    /// by its first reader and shared by the rest: the absent bias or mask of each
    /// layer's fused attention softmax, say, which were an upload per layer.
    pub fn constant(&self, value: f32, device: &Device) -> PhysTensor {
        let upload = || {
            let data = TensorData::new(vec![value], [1; MAX_RANK]);
            Ok(Made::Phys(PhysTensor::from_data(data, device)))
        };
        let made = self
            .uploads
            .made(HostKey::Scalar(value.to_bits()), device, upload);
        phys(made.expect("an upload does not fail"))
    }
}

fn phys(made: Made) -> PhysTensor {
    match made {
        Made::Phys(t) => t,
        _ => unreachable!("masks' forms and constants are only ever made at the physical rank"),
    }
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

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use burn::tensor::{Device, TensorData};
    use ndarray::{ArrayD, IxDyn};

    use super::*;

    #[test]
    fn each_form_of_equal_masks_is_made_once() {
        let (memo, made) = (PassMemo::default(), Cell::new(0));
        let device = Device::flex();
        let make = |v: f32| {
            made.set(made.get() + 1);
            Ok(PhysTensor::from_data(
                TensorData::new(vec![v], [1; 8]),
                &device,
            ))
        };
        let read = |t: PhysTensor| t.into_data().try_to_vec::<f32>().unwrap()[0];
        let mask = |values: &[bool], shape: &[usize]| {
            ArrayD::from_shape_vec(IxDyn(shape), values.to_vec()).unwrap()
        };
        let causal = mask(&[true, false, true, true], &[2, 2]);
        let first = memo
            .device_form(&causal, "keep", &device, || make(1.0))
            .unwrap();
        // An equal mask computed again (another layer's), and one in another memory order.
        let again = memo
            .device_form(&causal.clone(), "keep", &device, || make(2.0))
            .unwrap();
        let transposed = mask(&[true, true, false, true], &[2, 2]).reversed_axes();
        let reordered = memo
            .device_form(&transposed, "keep", &device, || make(3.0))
            .unwrap();
        assert_eq!(
            (read(first), read(again), read(reordered), made.get()),
            (1.0, 1.0, 1.0, 1)
        );
        // Another form, other values, another shape of the same values: made anew.
        let other_form = memo
            .device_form(&causal, "drop", &device, || make(4.0))
            .unwrap();
        let other = mask(&[true, true, true, true], &[2, 2]);
        let other_values = memo
            .device_form(&other, "keep", &device, || make(5.0))
            .unwrap();
        let flat = mask(&[true, false, true, true], &[4]);
        let other_shape = memo
            .device_form(&flat, "keep", &device, || make(6.0))
            .unwrap();
        let got = (read(other_form), read(other_values), read(other_shape));
        assert_eq!((got, made.get()), ((4.0, 5.0, 6.0), 4));
    }

    #[test]
    fn each_constant_is_uploaded_once() {
        let memo = PassMemo::default();
        let device = Device::flex();
        let read = |t: PhysTensor| {
            assert_eq!(t.dims(), [1; 8]);
            t.into_data().try_to_vec::<f32>().unwrap()[0]
        };
        let held = || memo.uploads().len();
        // Each layer's absent bias: one tensor for the pass.
        let zeros: Vec<f32> = (0..12).map(|_| read(memo.constant(0.0, &device))).collect();
        assert_eq!((zeros, held()), (vec![0.0; 12], 1));
        // Another value is another tensor, by its bits (-0.0 is not 0.0's; a NaN fill is
        // found again).
        let others = [1.0, -0.0, f32::NEG_INFINITY, f32::NAN, f32::NAN, 1.0];
        let got: Vec<f32> = others
            .iter()
            .map(|&v| read(memo.constant(v, &device)))
            .collect();
        assert_eq!(got[0], 1.0);
        assert!(got[1] == 0.0 && got[1].is_sign_negative());
        assert_eq!(got[2], f32::NEG_INFINITY);
        assert!(got[3].is_nan() && got[4].is_nan());
        assert_eq!((got[5], held()), (1.0, 5));
    }
}
