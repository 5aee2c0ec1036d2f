//! The `#[cube]` kernels and their launches on CubeCL tensors (wgpu, CUDA, HIP from one
//! source). Every input is made contiguous first; outputs are fresh contiguous tensors
//! (the cross-entropy's gradient may take its logits' buffer instead):
//! `empty_device_contiguous_dtype`, not `empty_device_dtype`, whose CUDA allocation pads
//! rows to an aligned pitch that flat indexing would write across (on wgpu it does not,
//! which hid the difference until the kernels first ran on CUDA).

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

/// Threads per cube of the row kernels (a power of two: the tree reductions halve it).
const ROW_THREADS: u32 = 256;
/// Threads per cube of the element-wise kernels.
const ELEMWISE_THREADS: u32 = 256;

/// Tree reduction of `shared[0..threads]` into `shared[0]` (max or sum) by the cube's
/// `threads` units.
#[cube]
pub(super) fn reduce_shared<F: Float>(shared: &mut Shared<[F]>, #[comptime] max: bool) {
    let unit = UNIT_POS_X as usize;
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if unit < stride {
            if comptime![max] {
                let a = shared[unit];
                let b = shared[unit + stride];
                shared[unit] = F::max(a, b);
            } else {
                shared[unit] = shared[unit] + shared[unit + stride];
            }
        }
        sync_cube();
        stride /= 2;
    }
}

/// Softmax statistics of the row starting at `base` of the contiguous `[rows, classes]`
/// `logits`, in f32 whatever their precision: leaves the row's max in `shared[threads]` and
/// the sum of `exp(x - max)` in `shared[0]` (`shared` holds `threads + 1` values).
#[cube]
pub(super) fn row_softmax_stats<F: Float>(
    logits: &Tensor<F>,
    base: usize,
    classes: usize,
    shared: &mut Shared<[f32]>,
    #[comptime] threads: u32,
) {
    let unit = UNIT_POS_X as usize;
    let step = CUBE_DIM_X as usize;
    // Each thread starts from an element of the row (WGSL has no -inf literal).
    let mut local = f32::cast_from(logits[base]);
    let mut j = unit;
    while j < classes {
        let x = f32::cast_from(logits[base + j]);
        local = f32::max(local, x);
        j += step;
    }
    shared[unit] = local;
    sync_cube();
    reduce_shared::<f32>(shared, true);
    if unit == 0 {
        let m = shared[0];
        shared[threads as usize] = m;
    }
    sync_cube();
    let row_max = shared[threads as usize];
    let mut sum = 0.0f32;
    let mut j = unit;
    while j < classes {
        sum += f32::exp(f32::cast_from(logits[base + j]) - row_max);
        j += step;
    }
    shared[unit] = sum;
    sync_cube();
    reduce_shared::<f32>(shared, false);
}

/// One cube per row: `loss[row] = max + ln(sum exp(x - max)) - x[target]` over the row's
/// first `classes` columns, in f32 whatever the logits' precision.
#[cube(launch)]
fn cross_entropy_forward_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    loss: &mut Tensor<f32>,
    classes: usize,
    #[comptime] threads: u32,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let row = CUBE_POS_X as usize;
    let base = row * logits.shape(1);
    let mut shared = Shared::new_slice(threads as usize + 1);
    row_softmax_stats::<F>(logits, base, classes, &mut shared, threads);
    let row_max = shared[threads as usize];
    let total = shared[0];
    if UNIT_POS_X == 0 {
        let t = u32::cast_from(targets[row]) as usize;
        loss[row] = row_max + f32::ln(total) - f32::cast_from(logits[base + t]);
    }
}

/// What the gradient of a row's loss needs: the row's softmax statistics (max, sum of
/// exponentials), its target and the loss's gradient.
type RowLoss = ((f32, f32), usize, f32);

/// The row this cube differentiates: its first index, its width and its [`RowLoss`]. Every
/// unit has passed the statistics' last `sync_cube` when it returns, so none reads the row
/// again for them.
#[cube]
fn row_loss<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    grad: &Tensor<f32>,
    classes: usize,
    #[comptime] threads: u32,
) -> (usize, usize, RowLoss) {
    let row = CUBE_POS_X as usize;
    let width = logits.shape(1);
    let base = row * width;
    let mut shared = Shared::new_slice(threads as usize + 1);
    row_softmax_stats::<F>(logits, base, classes, &mut shared, threads);
    let stats = (shared[threads as usize], shared[0]);
    let target = u32::cast_from(targets[row]) as usize;
    (base, width, (stats, target, grad[row]))
}

/// `(exp(x - max) / sum - [j == target]) * g` for column `j < classes` of a row, 0 past
/// its classes.
#[cube]
fn row_gradient(x: f32, j: usize, row: RowLoss, classes: usize) -> f32 {
    let ((row_max, total), target, g) = row;
    let mut d = 0.0f32;
    if j < classes {
        let p = f32::exp(x - row_max) / total;
        let mut hot = 0.0f32;
        if j == target {
            hot = 1.0;
        }
        d = (p - hot) * g;
    }
    d
}

/// One cube per row: `dx[row, j] = (exp(x - max) / sum - [j == target]) * grad[row]` for
/// the first `classes` columns, 0 for the rest of the row; computed in f32 and written in
/// the logits' precision.
#[cube(launch)]
fn cross_entropy_backward_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    grad: &Tensor<f32>,
    dx: &mut Tensor<F>,
    classes: usize,
    #[comptime] threads: u32,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let (base, width, row) = row_loss::<F, I>(logits, targets, grad, classes, threads);
    let mut j = UNIT_POS_X as usize;
    while j < width {
        let x = f32::cast_from(logits[base + j]);
        dx[base + j] = F::cast_from(row_gradient(x, j, row, classes));
        j += CUBE_DIM_X as usize;
    }
}

/// [`cross_entropy_backward_kernel`] writing the gradient over the logits it reads: the
/// row's statistics are complete before any unit writes ([`row_loss`]), and each unit
/// then reads and writes only its own columns.
#[cube(launch)]
fn cross_entropy_backward_in_place_kernel<F: Float, I: Numeric>(
    logits: &mut Tensor<F>,
    targets: &Tensor<I>,
    grad: &Tensor<f32>,
    classes: usize,
    #[comptime] threads: u32,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let (base, width, row) = row_loss::<F, I>(&*logits, targets, grad, classes, threads);
    let mut j = UNIT_POS_X as usize;
    while j < width {
        let x = f32::cast_from(logits[base + j]);
        logits[base + j] = F::cast_from(row_gradient(x, j, row, classes));
        j += CUBE_DIM_X as usize;
    }
}

/// `out = grad * factor`; `flag[0] = 1` where a value is inf or NaN (every writer writes
/// the same value, so the unsynchronised store is benign). Gradients are f32: the master
/// weights' precision.
#[cube(launch)]
fn unscale_kernel(grad: &Tensor<f32>, flag: &mut Tensor<f32>, out: &mut Tensor<f32>, factor: f32) {
    let i = ABSOLUTE_POS;
    if i < grad.len() {
        let g = grad[i];
        if f32::is_nan(g) || f32::is_inf(g) {
            flag[0] = 1.0;
        }
        out[i] = g * factor;
    }
}

/// `output[i] = input[at(i)]` cast to the output's type, where `at(i)` reads the
/// contiguous output's index `i` through the input's strides.
#[cube(launch)]
fn cast_contiguous_kernel<I: Float, O: Float>(
    input: &Tensor<I>,
    output: &mut Tensor<O>,
    #[define(I, O)] _dtypes: [ElemType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < output.len() {
        let mut rest = i;
        let mut at = 0usize;
        let mut d = output.rank();
        while d > 0 {
            d -= 1;
            let extent = output.shape(d);
            at += (rest % extent) * input.stride(d);
            rest /= extent;
        }
        output[i] = O::cast_from(input[at]);
    }
}

fn rows_and_classes(logits: &CubeTensor) -> (usize, usize) {
    let dims = logits.shape().dims::<2>();
    (dims[0], dims[1])
}

/// Per-row softmax cross-entropy of `[rows, width]` logits (f32, or a low precision) over
/// their first `classes` columns, in f32 (see the kernel).
pub fn cross_entropy_forward(
    logits: CubeTensor,
    targets: CubeTensor,
    classes: usize,
) -> CubeTensor {
    let (logits, targets) = (into_contiguous(logits), into_contiguous(targets));
    let (rows, _) = rows_and_classes(&logits);
    let client = logits.client.clone();
    let loss = empty_device_contiguous_dtype(
        client.clone(),
        logits.device.clone(),
        Shape::new([rows]),
        DType::F32,
    );
    let dtypes = [
        dtype_to_storage_type(logits.dtype),
        dtype_to_storage_type(targets.dtype),
    ];
    cross_entropy_forward_kernel::launch(
        &client,
        CubeCount::Static(rows as u32, 1, 1),
        CubeDim::new_1d(ROW_THREADS),
        logits.into_tensor_arg(),
        targets.into_tensor_arg(),
        loss.clone().into_tensor_arg(),
        classes,
        ROW_THREADS,
        dtypes,
    );
    loss
}

/// Gradient of [`cross_entropy_forward`] with respect to the logits, in their precision,
/// from the loss's f32 gradient `grad`. Written over the logits when nothing else holds
/// them (the loss's backward is their last reader): the backward's peak then holds one
/// `[rows, vocabulary]` tensor, not two (1.65 GB less for GPT-2 at 16 x 1024 tokens in
/// bf16).
pub fn cross_entropy_backward(
    logits: CubeTensor,
    targets: CubeTensor,
    grad: CubeTensor,
    classes: usize,
) -> CubeTensor {
    let grad = match grad.dtype {
        DType::F32 => into_contiguous(grad),
        _ => cast_contiguous(grad, DType::F32),
    };
    let (logits, targets) = (into_contiguous(logits), into_contiguous(targets));
    let (rows, width) = rows_and_classes(&logits);
    let client = logits.client.clone();
    let count = CubeCount::Static(rows as u32, 1, 1);
    let dtypes = [
        dtype_to_storage_type(logits.dtype),
        dtype_to_storage_type(targets.dtype),
    ];
    if logits.can_mut() {
        cross_entropy_backward_in_place_kernel::launch(
            &client,
            count,
            CubeDim::new_1d(ROW_THREADS),
            logits.clone().into_tensor_arg(),
            targets.into_tensor_arg(),
            grad.into_tensor_arg(),
            classes,
            ROW_THREADS,
            dtypes,
        );
        return logits;
    }
    let dx = empty_device_contiguous_dtype(
        client.clone(),
        logits.device.clone(),
        Shape::new([rows, width]),
        logits.dtype,
    );
    cross_entropy_backward_kernel::launch(
        &client,
        count,
        CubeDim::new_1d(ROW_THREADS),
        logits.into_tensor_arg(),
        targets.into_tensor_arg(),
        grad.into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        classes,
        ROW_THREADS,
        dtypes,
    );
    dx
}

/// The grid of an element-wise kernel over `n` elements: one unit each, in cubes of
/// `ELEMWISE_THREADS` units.
pub(super) fn elementwise_grid(client: &cubecl::client::Client, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new_1d(ELEMWISE_THREADS);
    (calculate_cube_count_elemwise(client, n, dim), dim)
}

/// `input` cast to `dtype` into a fresh contiguous tensor, read through its strides (one
/// pass, where a copy and a cast would be two).
pub fn cast_contiguous(input: CubeTensor, dtype: DType) -> CubeTensor {
    let client = input.client.clone();
    let n = input.shape().num_elements();
    let output =
        empty_device_contiguous_dtype(client.clone(), input.device.clone(), input.shape(), dtype);
    let (count, dim) = elementwise_grid(&client, n);
    let dtypes = [
        dtype_to_storage_type(input.dtype),
        dtype_to_storage_type(dtype),
    ];
    cast_contiguous_kernel::launch(
        &client,
        count,
        dim,
        input.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        dtypes,
    );
    output
}

/// `grad * factor` with the inf/NaN flag raised in `flag` (see the kernel).
pub fn unscale(grad: CubeTensor, flag: CubeTensor, factor: f32) -> CubeTensor {
    let grad = into_contiguous(grad);
    let client = grad.client.clone();
    let n = grad.shape().num_elements();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        grad.device.clone(),
        grad.shape(),
        grad.dtype,
    );
    let (count, dim) = elementwise_grid(&client, n);
    assert!(
        grad.dtype == DType::F32 && flag.dtype == DType::F32,
        "unscale: gradients are f32 (got {:?})",
        grad.dtype
    );
    unscale_kernel::launch(
        &client,
        count,
        dim,
        grad.into_tensor_arg(),
        flag.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        factor,
    );
    out
}
