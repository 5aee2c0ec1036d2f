//! Run-time values of the interpreter.
//!
//! Float tensors live on the Burn device, with autodiff when the device has it. Burn tensors
//! carry their rank in the type, ONNX values do not: every float value is stored as a
//! rank-[`MAX_RANK`] tensor whose leading dimensions are 1, with its logical rank beside it.
//! Padding on the left is exactly NumPy/ONNX broadcasting, so element-wise ops need no
//! rank bookkeeping at all. Integer and boolean values (shapes, ids, masks) are small and
//! stay on the host as `ndarray` arrays.

pub mod host_tensor;
pub mod unary_op;
pub mod uploads;

use burn::tensor::{Device, Int, Tensor, TensorData};
use ndarray::{ArrayD, IxDyn};

use crate::error::OpResult;
use crate::op_bail;
use crate::value::host_tensor::{HostTensor, into_row_major_vec};

/// Highest tensor rank the interpreter handles.
pub const MAX_RANK: usize = 8;

/// The physical Burn tensor behind every float value.
pub type PhysTensor = Tensor<MAX_RANK>;

/// Left-pad a logical shape with ones to the physical rank.
pub fn padded(shape: &[usize]) -> OpResult<[usize; MAX_RANK]> {
    if shape.len() > MAX_RANK {
        op_bail!(
            "rank {} is above the supported maximum {MAX_RANK} (shape {shape:?})",
            shape.len()
        );
    }
    let mut out = [1; MAX_RANK];
    out[MAX_RANK - shape.len()..].copy_from_slice(shape);
    Ok(out)
}

/// Normalise a possibly negative ONNX axis against a rank.
pub fn norm_axis(axis: i64, rank: usize) -> OpResult<usize> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r.max(1) {
        op_bail!("axis {axis} is out of range for rank {rank}");
    }
    Ok(a as usize)
}

/// A float tensor on the device with its logical rank.
#[derive(Clone, Debug)]
pub struct FloatValue {
    /// Physical tensor, shape `[1, .., 1, d0, .., d(rank-1)]`.
    pub tensor: PhysTensor,
    /// Logical rank.
    pub rank: usize,
}

impl FloatValue {
    /// Wrap a physical tensor of logical rank `rank`.
    pub fn new(tensor: PhysTensor, rank: usize) -> Self {
        FloatValue { tensor, rank }
    }

    /// [`Self::from_array`] taking the array: its buffer becomes the tensor's without a
    /// copy when it is in standard layout.
    pub fn from_owned_array(a: ArrayD<f32>, device: &Device) -> OpResult<Self> {
        let shape = padded(a.shape())?.to_vec();
        let rank = a.ndim();
        let values = into_row_major_vec(a);
        Ok(FloatValue::new(
            Tensor::from_data(TensorData::new(values, shape), device),
            rank,
        ))
    }

    /// Upload a host array.
    pub fn from_array(a: &ArrayD<f32>, device: &Device) -> OpResult<Self> {
        let data = TensorData::new(
            a.iter().copied().collect::<Vec<f32>>(),
            padded(a.shape())?.to_vec(),
        );
        Ok(FloatValue::new(Tensor::from_data(data, device), a.ndim()))
    }

    /// Logical shape.
    pub fn shape(&self) -> Vec<usize> {
        self.tensor.dims()[MAX_RANK - self.rank..].to_vec()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.tensor.dims().iter().product()
    }

    /// Physical axis of a logical (possibly negative) axis.
    pub fn axis(&self, axis: i64) -> OpResult<usize> {
        Ok(norm_axis(axis, self.rank)? + MAX_RANK - self.rank)
    }

    /// Reshape to a logical shape with the same number of elements.
    pub fn reshape(self, shape: &[usize]) -> OpResult<Self> {
        let n: usize = shape.iter().product();
        if n != self.numel() {
            op_bail!(
                "cannot reshape {:?} ({} elements) to {shape:?}",
                self.shape(),
                self.numel()
            );
        }
        if n == 0 {
            // Burn cannot reshape a zero-size tensor; a fresh empty one is the same value.
            let empty = PhysTensor::zeros(padded(shape)?, &self.tensor.device());
            return Ok(FloatValue::new(empty, shape.len()));
        }
        Ok(FloatValue::new(
            self.tensor.reshape(padded(shape)?),
            shape.len(),
        ))
    }

    /// The logical tensor as a Burn tensor of rank `D` (which must equal the logical rank).
    pub fn into_rank<const D: usize>(self) -> OpResult<Tensor<D>> {
        if self.rank != D {
            op_bail!("expected a rank-{D} tensor, got shape {:?}", self.shape());
        }
        let mut dims = [0; D];
        dims.copy_from_slice(&self.shape());
        Ok(self.tensor.reshape(dims))
    }

    /// Wrap a rank-`D` Burn tensor.
    pub fn from_rank<const D: usize>(t: Tensor<D>) -> OpResult<Self> {
        let dims = padded(&t.dims())?;
        Ok(FloatValue::new(t.reshape(dims), D))
    }

    /// Download to the host.
    pub fn to_array(&self) -> OpResult<ArrayD<f32>> {
        let values = burn_ort_dist::host_values(self.tensor.clone())?;
        Ok(ArrayD::from_shape_vec(IxDyn(&self.shape()), values)?)
    }

    /// Elements `start..start + len` along physical axis `phys`; an empty range gives a
    /// zero-size tensor (Burn's `narrow` refuses one), which carries no gradient.
    pub fn narrow(self, phys: usize, start: usize, len: usize) -> Self {
        if len == 0 {
            let mut dims = self.tensor.dims();
            dims[phys] = 0;
            let empty = PhysTensor::zeros(dims, &self.tensor.device());
            return FloatValue::new(empty, self.rank);
        }
        FloatValue::new(self.tensor.narrow(phys, start, len), self.rank)
    }

    /// Broadcast to a logical shape (NumPy rules).
    pub fn broadcast_to(self, shape: &[usize]) -> OpResult<Self> {
        let target = padded(shape)?;
        if self.tensor.dims() == target {
            return Ok(FloatValue::new(self.tensor, shape.len().max(self.rank)));
        }
        Ok(FloatValue::new(
            self.tensor.expand(target),
            shape.len().max(self.rank),
        ))
    }
}

/// A value flowing along a graph edge.
#[derive(Clone, Debug)]
pub enum Value {
    /// Float tensor on the device.
    Float(FloatValue),
    /// Integer tensor on the host.
    Int(ArrayD<i64>),
    /// Boolean tensor on the host.
    Bool(ArrayD<bool>),
    /// A string tensor on the host (ONNX `STRING`): only `Identity`, `Equal`, the string
    /// ops and `ai.onnx.ml`'s `LabelEncoder` take one; any other op refuses it by name.
    Str(ArrayD<String>),
    /// An ONNX sequence: tensors of one element type, any shapes (`SequenceConstruct`,
    /// `SplitToSequence`, ...). Only the sequence ops, `Identity`, `If`, `Loop` and the
    /// optional ops take one; any other op refuses it by name (`ops::takes_sequences`).
    Sequence(Vec<Value>),
}

impl Value {
    /// Make a value from a host tensor; floats are uploaded to `device`.
    pub fn from_host(h: &HostTensor, device: &Device) -> OpResult<Self> {
        Ok(match h {
            HostTensor::Float(a) => Value::Float(FloatValue::from_array(a, device)?),
            HostTensor::Int(a) => Value::Int(a.clone()),
            HostTensor::Bool(a) => Value::Bool(a.clone()),
        })
    }

    /// Element family, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Float(_) => "float",
            Value::Int(_) => "int",
            Value::Bool(_) => "bool",
            Value::Str(_) => "string",
            Value::Sequence(_) => "sequence",
        }
    }

    /// Logical shape; a sequence has none (empty, as a scalar's).
    pub fn shape(&self) -> Vec<usize> {
        match self {
            Value::Float(f) => f.shape(),
            Value::Int(a) => a.shape().to_vec(),
            Value::Bool(a) => a.shape().to_vec(),
            Value::Str(a) => a.shape().to_vec(),
            Value::Sequence(_) => Vec::new(),
        }
    }

    /// Logical rank; 0 for a sequence.
    pub fn rank(&self) -> usize {
        match self {
            Value::Float(f) => f.rank,
            Value::Int(a) => a.ndim(),
            Value::Bool(a) => a.ndim(),
            Value::Str(a) => a.ndim(),
            Value::Sequence(_) => 0,
        }
    }

    /// The error of a tensor operation given a sequence.
    fn not_a_tensor<T>(what: &str) -> OpResult<T> {
        op_bail!("{what} must be a tensor, got a sequence")
    }

    /// The error of a numeric operation given strings or a sequence.
    fn not_numeric<T>(what: &str) -> OpResult<T> {
        op_bail!("{what} must be a numeric tensor")
    }

    /// Reshape to a logical shape with the same number of elements, any element family.
    pub fn reshape_to(self, shape: &[usize]) -> OpResult<Value> {
        Ok(match self {
            Value::Float(f) => Value::Float(f.reshape(shape)?),
            Value::Int(a) => Value::Int(a.into_shape_with_order(IxDyn(shape))?),
            Value::Bool(a) => Value::Bool(a.into_shape_with_order(IxDyn(shape))?),
            Value::Str(a) => Value::Str(a.into_shape_with_order(IxDyn(shape))?),
            Value::Sequence(_) => return Self::not_a_tensor("a reshaped value"),
        })
    }

    /// As a float tensor on `device`: ints and bools are converted (ONNX `Cast` semantics).
    pub fn into_float(self, device: &Device) -> OpResult<FloatValue> {
        match self {
            Value::Float(f) => Ok(f),
            Value::Int(a) => FloatValue::from_array(&a.mapv(|v| v as f32), device),
            Value::Bool(a) => {
                FloatValue::from_array(&a.mapv(|v| if v { 1.0 } else { 0.0 }), device)
            }
            Value::Str(_) | Value::Sequence(_) => Self::not_numeric("a float operand"),
        }
    }

    /// As a host integer array: floats are downloaded and truncated toward zero (`Cast`).
    pub fn into_int(self) -> OpResult<ArrayD<i64>> {
        match self {
            Value::Int(a) => Ok(a),
            Value::Bool(a) => Ok(a.mapv(i64::from)),
            Value::Float(f) => Ok(f.to_array()?.mapv(|v| v as i64)),
            Value::Str(_) | Value::Sequence(_) => Self::not_numeric("an integer operand"),
        }
    }

    /// As a host boolean array (non-zero is true).
    pub fn into_bool(self) -> OpResult<ArrayD<bool>> {
        match self {
            Value::Bool(a) => Ok(a),
            Value::Int(a) => Ok(a.mapv(|v| v != 0)),
            Value::Float(f) => Ok(f.to_array()?.mapv(|v| v != 0.0)),
            Value::Str(_) | Value::Sequence(_) => Self::not_numeric("a boolean operand"),
        }
    }

    /// The elements of an integer value as a `Vec<i64>` (shape inputs, axes, ...).
    pub fn int_list(&self, what: &str) -> OpResult<Vec<i64>> {
        match self {
            Value::Int(a) => Ok(a.iter().copied().collect()),
            Value::Float(f) => Ok(f.to_array()?.iter().map(|&v| v as i64).collect()),
            Value::Bool(_) => op_bail!("{what} must be an integer tensor, got bool"),
            Value::Str(_) | Value::Sequence(_) => Self::not_numeric(what),
        }
    }

    /// The elements of an integer value as dimensions (shape inputs); negatives are errors.
    pub fn dims_list(&self, what: &str) -> OpResult<Vec<usize>> {
        self.int_list(what)?
            .into_iter()
            .map(|d| {
                usize::try_from(d)
                    .map_err(|_| format!("{what} has a negative dimension {d}").into())
            })
            .collect()
    }

    /// A single float (scalar inputs such as Dropout's ratio).
    pub fn scalar_f32(&self, what: &str) -> OpResult<f32> {
        let v: Vec<f32> = match self {
            Value::Float(f) => f.to_array()?.iter().copied().collect(),
            Value::Int(a) => a.iter().map(|&v| v as f32).collect(),
            Value::Bool(a) => a.iter().map(|&v| if v { 1.0 } else { 0.0 }).collect(),
            Value::Str(_) | Value::Sequence(_) => return Self::not_numeric(what),
        };
        match v.as_slice() {
            [x] => Ok(*x),
            _ => op_bail!("{what} must hold one element, got {}", v.len()),
        }
    }
}

/// Upload host integer indices as a 1-D device tensor.
pub fn int_tensor_1d(values: Vec<i64>, device: &Device) -> Tensor<1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, vec![n]), device)
}
