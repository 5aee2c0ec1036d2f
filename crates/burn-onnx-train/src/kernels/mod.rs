//! Fused kernels, reached through Burn's backend extensions: `#[cube]` kernels (one source
//! compiled for WGSL, CUDA and HIP) on devices that run CubeCL, plain Rust over host
//! buffers on the CPU's Flex backend where that pays, and otherwise the plain Burn
//! composition each is tested against.
//!
//! - [`cross_entropy_rows`]: softmax cross-entropy per row, forward and backward each one
//!   kernel, with no probability tensor materialised (CubeCL and Flex);
//! - [`head_cross_entropy_sum`]: the head's product and that cross-entropy a block of rows
//!   at a time, their gradients computed with the value, so the `[tokens, vocabulary]`
//!   logits never exist whole (any backend; in training on CubeCL devices);
//! - [`unscale_and_check`]: divide a gradient by the loss scale and note inf/NaN in the
//!   same pass, with one read-back for all gradients (CubeCL);
//! - [`tanh`], [`gelu_tanh`] and [`softmax`]: one pass each way with vectorizable
//!   `exp`/`tanh` (Flex), compiled for AVX-512 or AVX2 when the CPU has them (`simd`);
//!   [`gelu_tanh_biased`]: the bias of the product before it added inside the GELU's
//!   kernels (CubeCL);
//! - [`layer_norm`]: layer normalisation of rows, forward and backward each one pass,
//!   saving only the input and each row's mean and inverse deviation (Flex);
//! - [`masked_fill`]: `Where` with a constant scalar branch (attention masks), the mask
//!   kept at its own period instead of broadcast to the scores' size (Flex);
//! - [`masked_softmax`]: the attention softmax with its scaling and masking folded in,
//!   one kernel each way over the scores (CubeCL);
//! - [`attention_core`]: `softmax(masked(q kt)) v` keeping no scores or probabilities for
//!   its backward, which makes them again from each row's log-sum-exp, every `[.., t, s]`
//!   tensor written once in the precision of the product reading it (`attention_rows`), a
//!   slice of the batch at a time past [`TRANSIENT_BYTES`] (CubeCL);
//! - [`matmul`]: the matrix product written by the GEMM into an uninitialised buffer, its
//!   backward the same kernel on transposed views (Flex);
//! - [`matmul_autocast`] (and [`matmul`] of f32 on CubeCL): the product writing f32 from
//!   operands cast and laid out once, kept so for the backward, which prepares the
//!   gradient once for both its products (CubeCL);
//! - [`reshape`]: a reshape that is a view wherever the strides allow, where Burn's
//!   copies every strided tensor of our fixed rank (CubeCL);
//! - [`narrow`]: a slice along one axis whose backward writes the input's whole gradient
//!   in one pass, and [`pad_end`], its converse, keeping its input's layout (CubeCL);
//! - [`conv2d`]: one-group convolution as im2col + GEMM per image, forward and backward,
//!   straight on NCHW (Flex);
//! - [`max_pool2d`]: max pooling with window bounds worked out once per call and a
//!   backward that finds each maximum again instead of keeping indices (Flex);
//! - [`FusedAdam`]: Adam, AdamW and LAMB over all parameters in one pass (three for LAMB)
//!   on flat buffers, one launch per group of up to 128 MiB on CubeCL devices, one
//!   parallel loop on the CPU: the
//!   optimizer of replicated runs.

mod activation;
mod attention_core;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod attention_rows;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod bias_residual;
mod conv;
mod cross_entropy;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube_matmul;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube_optim;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube_rows;
pub mod device_graph;
mod fast_math;
mod fused_adam;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gelu_bias;
mod given_gradients;
mod head_cross_entropy;
mod host;
mod host_optim;
pub mod launch_tally;
mod layer_norm;
mod masked_fill;
mod masked_softmax;
mod matmul;
mod narrow;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod offload_step;
mod pool;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod reshape_view;
mod simd;
mod transpose;
mod unscale;

pub use activation::{gelu_tanh, gelu_tanh_biased, softmax, tanh};
pub use attention_core::attention_core;
pub use conv::conv2d;
pub use cross_entropy::{
    cross_entropy_fused_for, cross_entropy_rows, cross_entropy_rows_gradient,
    cross_entropy_rows_reference, cross_entropy_rows_within,
};
pub use fused_adam::FusedAdam;
pub use head_cross_entropy::{block_rows, head_cross_entropy_sum, head_cross_entropy_value};
pub use layer_norm::{layer_norm, layer_norm_fused_here, layer_norm_in};
pub use masked_fill::{masked_fill, masked_fill_fused_here};
pub use masked_softmax::{masked_softmax, masked_softmax_fused_here};
pub use matmul::{matmul, matmul_autocast};
pub use narrow::{SplitPieces, narrow, pad_end};
pub use pool::max_pool2d;
pub use unscale::{NonFiniteFlag, unscale_and_check, unscale_and_check_reference};

use burn::tensor::{DType, Device, FloatDType, Tensor};

use crate::value::{MAX_RANK, PhysTensor};

/// The bytes one tensor that a fused op makes and drops within itself may take (the
/// head's logits a block of rows at a time, `head_cross_entropy.rs`; one layer's
/// attention scores a slice of the batch at a time, `attention_core.rs`): CubeCL's pool
/// sizes its pages after the largest allocation, so such a tensor would otherwise set the
/// update's granularity (GPT-2 124M at 16 x 1024 tokens: 1.6 GB of logits, 768 MiB of
/// scores a layer).
pub const TRANSIENT_BYTES: usize = 256 << 20;

/// `dtype` as a float precision (f32 for any that is not f16 or bf16).
pub(crate) fn float_dtype(dtype: DType) -> FloatDType {
    match dtype {
        DType::F16 => FloatDType::F16,
        DType::BF16 => FloatDType::BF16,
        _ => FloatDType::F32,
    }
}

/// Values per chunk of the fused optimizers' flat buffers (`fused_adam/`, and the
/// CubeCL kernel in `cube_optim.rs`): a chunk belongs to one parameter, a multiple of the
/// kernel's cube size.
pub(crate) const FLAT_CHUNK: usize = 2048;

/// `x` reshaped to `dims` (the same element count, none zero): a view wherever the
/// strides allow on CubeCL devices (`reshape_view.rs`), Burn's reshape elsewhere.
pub fn reshape(x: PhysTensor, dims: [usize; MAX_RANK]) -> PhysTensor {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if runs_cubecl(&x.device()) {
        use reshape_view::ReshapeViewOps;
        return PhysTensor::from_dispatch(
            <burn::backend::Dispatch as ReshapeViewOps>::reshape_view(
                x.into_dispatch(),
                dims.into(),
            ),
        );
    }
    x.reshape(dims)
}

/// The largest allocation `device` makes at once, in bytes, where it runs CubeCL kernels
/// (cubecl's page limit: wgpu without 64-bit indexing caps it at 128 MiB); `None`
/// elsewhere.
pub fn largest_allocation(device: &Device) -> Option<u64> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if let burn::backend::DispatchDevice::Cube(cube) = device.clone().inner().as_dispatch() {
        return Some(cube.client().properties().memory.max_page_size);
    }
    let _ = device;
    None
}

/// Where `t`'s values live on a CubeCL device: its allocation (cubecl's id of it) and its
/// offset there in bytes; `None` elsewhere. Two tensors at one place are views of one
/// buffer; a tensor at the place it had before an op was written in place by it.
pub fn device_place<const D: usize>(t: &Tensor<D>) -> Option<(usize, u64)> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        let cube = t
            .clone()
            .inner()
            .try_into_primitive::<burn::backend::Cube>()
            .ok()?;
        let id = cube.handle.memory.clone().binding().id().value;
        Some((id, cube.handle.offset_start.unwrap_or(0)))
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = t;
        None
    }
}

/// Write `values` over the flat f32 tensor `t`'s own buffer on a CubeCL device (after the
/// work queued before on its stream, so kernels already launched read the old values), so
/// that `t` keeps its device place; `false` (nothing written) elsewhere, or where `t` is
/// not a whole contiguous f32 buffer of `values.len()` values.
pub fn write_floats(t: &Tensor<1>, values: &[f32]) -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        use burn::backend::TensorMetadata;
        let Ok(cube) = t
            .clone()
            .inner()
            .try_into_primitive::<burn::backend::Cube>()
        else {
            return false;
        };
        // The write starts where the handle does: the tensor's first value.
        let whole = cube.is_contiguous() && cube.shape().num_elements() == values.len();
        if cube.dtype != DType::F32 || !whole {
            return false;
        }
        let bytes = burn::tensor::Bytes::from_elems(values.to_vec());
        cube.client.write(&cube.handle, bytes);
        true
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (t, values);
        false
    }
}

/// `x + bias + residual` (`bias` broadcast to `x`): one op each way on CubeCL devices when
/// `bias` is as long as `x`'s rows and `residual` is shaped and typed as `x`
/// (`bias_residual.rs`), the two additions elsewhere.
pub fn add_bias_residual(x: PhysTensor, bias: PhysTensor, residual: PhysTensor) -> PhysTensor {
    let (xd, bd) = (x.dims(), bias.dims());
    let row_bias =
        bd[..MAX_RANK - 1].iter().all(|&d| d == 1) && bd[MAX_RANK - 1] == xd[MAX_RANK - 1];
    let f32_all = [&x, &bias, &residual]
        .iter()
        .all(|t| t.dtype() == burn::tensor::DType::F32);
    let fused = row_bias && f32_all && residual.dims() == xd && runs_cubecl(&x.device());
    if !fused {
        return x + bias + residual;
    }
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return PhysTensor::from_dispatch(
        <burn::backend::Dispatch as bias_residual::BiasResidualOps>::add_bias_residual(
            x.into_dispatch(),
            bias.into_dispatch(),
            residual.into_dispatch(),
        ),
    );
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    unreachable!("no CubeCL device in this build")
}

/// Whether `device` (or the device an autodiff device wraps) runs CubeCL kernels.
pub fn runs_cubecl(device: &Device) -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        matches!(
            device.clone().inner().as_dispatch(),
            burn::backend::DispatchDevice::Cube(_)
        )
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = device;
        false
    }
}
