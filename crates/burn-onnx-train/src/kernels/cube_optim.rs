//! The `#[cube]` kernels of the multi-tensor optimizer (see `fused_adam/`) and their
//! launches. The parameters of a model lie end to end in flat f32 buffers (one, or one per
//! group where a device caps an allocation's size), each padded to a whole number of
//! chunks of `chunk` values, so a chunk belongs to one parameter:
//! `chunk_starts[t]` is the first chunk of parameter `t` (the last entry is the chunk
//! count; f32 holds chunk indices exactly up to 2^24 chunks). `factors[t]` is parameter
//! `t`'s weight-decay term for this step. One cube updates one chunk.
//!
//! - Adam / AdamW: one launch updates parameters and both moments in place.
//! - LAMB: three launches: the direction `u` with per-chunk partial sums of `p^2` and
//!   `u^2`; one cube per parameter turns its partials into the trust ratio `|p| / |u|`; the
//!   update `p - (u * trust) * lr`.
//!
//! The arithmetic is Burn's `Adam`, `AdamW` and `Lamb` operation by operation, in f32.
//!
//! The gradients reach the flat layout four parameters a launch ([`lay_out_four`]), each
//! written at its offset with zeros to its padded end. A clipped update measures the flat
//! gradient ([`chunk_squares`]: partial sums of squares per chunk, one launch per flat
//! buffer, all into one vector; [`clip_factor`]: one cube for the sum and
//! `clip_grad_norm_`'s factor) and the update kernels multiply each
//! gradient by that factor as they read it: the norm and the factor stay on the device, so
//! the update never waits for a read-back, and the gradient is not rewritten scaled.

use burn::backend::DType;
use burn::backend::TensorMetadata;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use super::FLAT_CHUNK as CHUNK;
use super::cube::reduce_shared;

/// Threads per cube (a power of two for the tree reductions).
const THREADS: u32 = 256;

/// The parameter that chunk `chunk` belongs to (binary search in `chunk_starts`).
#[cube]
fn owner(chunk_starts: &Tensor<f32>, chunk: usize) -> usize {
    let mut lo = 0;
    let mut hi = chunk_starts.len() - 1;
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if (u32::cast_from(chunk_starts[mid]) as usize) <= chunk {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// How an update reads the clip buffer `[sum of squares, factor, finite]` of
/// [`clip_factor`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClipMode {
    /// No buffer: the gradients as they are.
    None,
    /// Each gradient multiplied by the factor.
    Scale,
    /// Each gradient multiplied by the factor, and nothing written at all when the buffer
    /// says a gradient was inf or NaN (a loss-scaled update, skipped on overflow).
    ScaleOrSkip,
}

impl ClipMode {
    /// Whether the gradients are multiplied by the factor.
    pub fn scales(self) -> bool {
        self != ClipMode::None
    }
}

/// Whether the update runs: always, except under [`ClipMode::ScaleOrSkip`] with a
/// gradient that was not finite.
#[cube]
fn runs(clip: &Tensor<f32>, #[comptime] mode: ClipMode) -> bool {
    let mut run = true;
    if comptime![mode == ClipMode::ScaleOrSkip] {
        run = clip[2] == 1.0;
    }
    run
}

/// Burn's moment update at `i` for gradient `g` (`m = m b1 + g (1 - b1)`,
/// `v = v b2 + g^2 (1 - b2)`), returning Adam's direction `m^ / (sqrt(v^) + eps)`.
#[cube]
fn adam_direction(
    g: f32,
    moment_1: &mut Tensor<f32>,
    moment_2: &mut Tensor<f32>,
    i: usize,
    hyper: &Tensor<f32>,
) -> f32 {
    let m = moment_1[i] * hyper[1] + g * hyper[3];
    let v = moment_2[i] * hyper[2] + (g * g) * hyper[4];
    moment_1[i] = m;
    moment_2[i] = v;
    (m / hyper[5]) / (f32::sqrt(v / hyper[6]) + hyper[7])
}

/// Adam (`decoupled` false: L2 decay `factors[t]` added to the gradient) or AdamW
/// (`decoupled`: the parameter multiplied by `factors[t] = 1 - lr * decay` first); with
/// a clip buffer ([`ClipMode`]), each gradient multiplied by `clip[1]` first.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn adam_kernel(
    params: &mut Tensor<f32>,
    grads: &Tensor<f32>,
    moment_1: &mut Tensor<f32>,
    moment_2: &mut Tensor<f32>,
    chunk_starts: &Tensor<f32>,
    factors: &Tensor<f32>,
    hyper: &Tensor<f32>,
    clip: &Tensor<f32>,
    #[comptime] chunk: u32,
    #[comptime] decoupled: bool,
    #[comptime] mode: ClipMode,
) {
    let c = CUBE_POS;
    let size = chunk as usize;
    if c * size < params.len() && runs(clip, mode) {
        let lr = hyper[0];
        let f = factors[owner(chunk_starts, c)];
        let mut j = UNIT_POS_X as usize;
        while j < size {
            let i = c * size + j;
            let p = params[i];
            let mut g = grads[i];
            if comptime![mode.scales()] {
                g *= clip[1];
            }
            if !comptime![decoupled] {
                g += p * f;
            }
            let delta = adam_direction(g, moment_1, moment_2, i, hyper);
            let mut kept = p;
            if comptime![decoupled] {
                kept = p * f;
            }
            params[i] = kept - delta * lr;
            j += CUBE_DIM_X as usize;
        }
    }
}

/// LAMB's direction `u = m^ / (sqrt(v^) + eps) + p * decay` into `direction`, and the
/// chunk's sums of `p^2` and `u^2` into `partials[2c]`, `partials[2c + 1]`; with
/// a clip buffer ([`ClipMode`]), each gradient multiplied by `clip[1]` first.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn lamb_direction_kernel(
    params: &Tensor<f32>,
    grads: &Tensor<f32>,
    moment_1: &mut Tensor<f32>,
    moment_2: &mut Tensor<f32>,
    direction: &mut Tensor<f32>,
    partials: &mut Tensor<f32>,
    chunk_starts: &Tensor<f32>,
    factors: &Tensor<f32>,
    hyper: &Tensor<f32>,
    clip: &Tensor<f32>,
    #[comptime] chunk: u32,
    #[comptime] threads: u32,
    #[comptime] mode: ClipMode,
) {
    let c = CUBE_POS;
    let size = chunk as usize;
    if c * size < params.len() && runs(clip, mode) {
        let decay = factors[owner(chunk_starts, c)];
        let mut pp = f32::new(0.0);
        let mut uu = f32::new(0.0);
        let mut j = UNIT_POS_X as usize;
        while j < size {
            let i = c * size + j;
            let p = params[i];
            let mut g = grads[i];
            if comptime![mode.scales()] {
                g *= clip[1];
            }
            let u = adam_direction(g, moment_1, moment_2, i, hyper) + p * decay;
            direction[i] = u;
            pp += p * p;
            uu += u * u;
            j += CUBE_DIM_X as usize;
        }
        let unit = UNIT_POS_X as usize;
        let mut shared_p = Shared::new_slice(threads as usize);
        let mut shared_u = Shared::new_slice(threads as usize);
        shared_p[unit] = pp;
        shared_u[unit] = uu;
        sync_cube();
        reduce_shared::<f32>(&mut shared_p, false);
        reduce_shared::<f32>(&mut shared_u, false);
        if unit == 0 {
            partials[2 * c] = shared_p[0];
            partials[2 * c + 1] = shared_u[0];
        }
    }
}

/// One cube per parameter: `trust[t] = |p| / |u|` from its chunks' partial sums (1 when
/// either norm is 0, as Burn's LAMB).
#[cube(launch)]
fn lamb_trust_kernel(
    partials: &Tensor<f32>,
    chunk_starts: &Tensor<f32>,
    trust: &mut Tensor<f32>,
    #[comptime] threads: u32,
) {
    let t = CUBE_POS;
    if t < trust.len() {
        let first = u32::cast_from(chunk_starts[t]) as usize;
        let end = u32::cast_from(chunk_starts[t + 1]) as usize;
        let mut pp = f32::new(0.0);
        let mut uu = f32::new(0.0);
        let mut k = first + UNIT_POS_X as usize;
        while k < end {
            pp += partials[2 * k];
            uu += partials[2 * k + 1];
            k += CUBE_DIM_X as usize;
        }
        let unit = UNIT_POS_X as usize;
        let mut shared_p = Shared::new_slice(threads as usize);
        let mut shared_u = Shared::new_slice(threads as usize);
        shared_p[unit] = pp;
        shared_u[unit] = uu;
        sync_cube();
        reduce_shared::<f32>(&mut shared_p, false);
        reduce_shared::<f32>(&mut shared_u, false);
        if unit == 0 {
            let p_norm = f32::sqrt(shared_p[0]);
            let u_norm = f32::sqrt(shared_u[0]);
            let mut ratio = f32::new(1.0);
            if p_norm > 0.0 && u_norm > 0.0 {
                ratio = p_norm / u_norm;
            }
            trust[t] = ratio;
        }
    }
}

/// `p = p - (u * trust[t]) * lr` (not at all when [`ClipMode`] skips it).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn lamb_apply_kernel(
    params: &mut Tensor<f32>,
    direction: &Tensor<f32>,
    chunk_starts: &Tensor<f32>,
    trust: &Tensor<f32>,
    hyper: &Tensor<f32>,
    clip: &Tensor<f32>,
    #[comptime] chunk: u32,
    #[comptime] mode: ClipMode,
) {
    let c = CUBE_POS;
    let size = chunk as usize;
    if c * size < params.len() && runs(clip, mode) {
        let lr = hyper[0];
        let ratio = trust[owner(chunk_starts, c)];
        let mut j = UNIT_POS_X as usize;
        while j < size {
            let i = c * size + j;
            params[i] -= (direction[i] * ratio) * lr;
            j += CUBE_DIM_X as usize;
        }
    }
}

/// The buffers of one update: parameters, gradients and the two moments (flat, of a whole
/// number of chunks), the chunk table, this step's per-parameter factors, and `hyper` =
/// `[lr, beta_1, beta_2, 1 - beta_1, 1 - beta_2, 1 - beta_1^t, 1 - beta_2^t, epsilon]`.
pub struct FlatBuffers {
    /// Parameters (updated in place).
    pub params: CubeTensor,
    /// Gradients.
    pub grads: CubeTensor,
    /// First moments (updated in place).
    pub moment_1: CubeTensor,
    /// Second moments (updated in place).
    pub moment_2: CubeTensor,
    /// First chunk of every parameter, then the chunk count.
    pub chunk_starts: CubeTensor,
    /// Per-parameter decay factor of this step.
    pub factors: CubeTensor,
    /// The step's scalars.
    pub hyper: CubeTensor,
    /// The clip buffer of [`clip_factor`] and how the update reads it (`None`: the
    /// gradients as they are, [`ClipMode::None`]).
    pub clip: Option<(CubeTensor, ClipMode)>,
}

/// Copies `src` into `flat[start..end]`, zeros past `src`'s end, for unit `i` of the part.
#[cube]
fn lay_out_part(src: &Tensor<f32>, flat: &mut Tensor<f32>, start: usize, end: usize, i: usize) {
    let at = start + i;
    if at < end {
        let mut v = f32::new(0.0);
        if i < src.len() {
            v = src[i];
        }
        flat[at] = v;
    }
}

/// Grid `z` = part (0..4); units along `x` then `y` index the part's values.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn lay_out_four_kernel(
    a: &Tensor<f32>,
    b: &Tensor<f32>,
    c: &Tensor<f32>,
    d: &Tensor<f32>,
    flat: &mut Tensor<f32>,
    starts: Sequence<usize>,
    ends: Sequence<usize>,
) {
    let i = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X) as usize;
    let part = CUBE_POS_Z;
    if part == 0 {
        lay_out_part(a, flat, starts[0], ends[0], i);
    } else if part == 1 {
        lay_out_part(b, flat, starts[1], ends[1], i);
    } else if part == 2 {
        lay_out_part(c, flat, starts[2], ends[2], i);
    } else {
        lay_out_part(d, flat, starts[3], ends[3], i);
    }
}

/// Writes `parts` (flat, f32) into `flat` at `starts`, each followed by zeros up to its
/// `ends` entry: one launch. Returns `flat`.
pub fn lay_out_four(
    flat: CubeTensor,
    parts: [CubeTensor; 4],
    starts: [usize; 4],
    ends: [usize; 4],
) -> CubeTensor {
    let [a, b, c, d] = parts.map(|p| readable(p, "gradients"));
    let longest = (0..4).map(|k| ends[k] - starts[k]).max().unwrap_or(0);
    let cubes = longest.div_ceil(THREADS as usize).max(1);
    let x = cubes.min(65_535);
    let client = flat.client.clone();
    let sequence = |v: [usize; 4]| {
        let mut seq = SequenceArg::<usize>::new();
        for value in v {
            seq.push(value);
        }
        seq
    };
    lay_out_four_kernel::launch(
        &client,
        CubeCount::Static(x as u32, cubes.div_ceil(x) as u32, 4),
        CubeDim::new_1d(THREADS),
        a.into_tensor_arg(),
        b.into_tensor_arg(),
        c.into_tensor_arg(),
        d.into_tensor_arg(),
        flat.clone().into_tensor_arg(),
        sequence(starts),
        sequence(ends),
    );
    flat
}

/// A tensor this launch may write: contiguous f32, and not shared with another handle.
fn writable(t: CubeTensor, what: &str) -> CubeTensor {
    assert_eq!(
        t.dtype,
        DType::F32,
        "multi-tensor update: {what} must be f32"
    );
    let t = burn_cubecl::kernel::into_contiguous(t);
    if t.can_mut() { t } else { t.copy() }
}

fn readable(t: CubeTensor, what: &str) -> CubeTensor {
    assert_eq!(
        t.dtype,
        DType::F32,
        "multi-tensor update: {what} must be f32"
    );
    burn_cubecl::kernel::into_contiguous(t)
}

/// The clip buffer to bind and how the kernel reads it (without one, `hyper` is bound in
/// its place and never read).
fn clip_arg(clip: Option<(CubeTensor, ClipMode)>, hyper: &CubeTensor) -> (CubeTensor, ClipMode) {
    match clip {
        Some((c, mode)) => (readable(c, "the clip factor"), mode),
        None => (hyper.clone(), ClipMode::None),
    }
}

/// One cube per chunk: the chunk's sum of squares of `grads` into `partials[first + c]`.
#[cube(launch)]
fn chunk_squares_kernel(
    grads: &Tensor<f32>,
    partials: &mut Tensor<f32>,
    first: u32,
    #[comptime] chunk: u32,
    #[comptime] threads: u32,
) {
    let c = CUBE_POS;
    let size = chunk as usize;
    if c * size < grads.len() {
        let mut sum = f32::new(0.0);
        let mut j = UNIT_POS_X as usize;
        while j < size {
            let g = grads[c * size + j];
            sum += g * g;
            j += CUBE_DIM_X as usize;
        }
        let total = cube_sum(sum, threads);
        if UNIT_POS_X == 0 {
            partials[first as usize + c] = total;
        }
    }
}

/// The sum of every unit's `value` over the cube (`threads` units), for every unit.
#[cube]
fn cube_sum(value: f32, #[comptime] threads: u32) -> f32 {
    let mut shared = Shared::new_slice(threads as usize);
    shared[UNIT_POS_X as usize] = value;
    sync_cube();
    reduce_shared::<f32>(&mut shared, false);
    shared[0]
}

/// One cube: `out = [sum of squares, factor, finite]` of gradients multiplied by `1 /
/// unscale` (a loss scale; 1 without one): the sum of squares of the divided gradients,
/// `unscale` times `clip_grad_norm_`'s `max_norm / (norm + 1e-6)` when their norm exceeds
/// `max_norm` (> 0) (else `unscale`), and 1 when the sum is finite, 0 when a gradient was
/// inf or NaN (or the sum overflowed).
#[cube(launch)]
fn clip_factor_kernel(
    partials: &Tensor<f32>,
    out: &mut Tensor<f32>,
    max_norm: f32,
    unscale: f32,
    #[comptime] threads: u32,
) {
    let mut sum = f32::new(0.0);
    let mut k = UNIT_POS_X as usize;
    while k < partials.len() {
        sum += partials[k];
        k += CUBE_DIM_X as usize;
    }
    let squares = cube_sum(sum, threads);
    if UNIT_POS_X == 0 {
        let norm = f32::sqrt(squares) * unscale;
        let mut factor = unscale;
        if max_norm > 0.0 && norm > max_norm {
            factor = unscale * (max_norm / (norm + 1e-6));
        }
        let mut finite = f32::new(1.0);
        if f32::is_nan(squares) || f32::is_inf(squares) {
            finite = 0.0;
        }
        out[0] = squares * unscale * unscale;
        out[1] = factor;
        out[2] = finite;
    }
}

/// The sums of squares of `grads` (flat, a whole number of chunks) chunk by chunk, into
/// `partials` from its entry `first` on: one launch. Returns `partials`.
pub fn chunk_squares(grads: CubeTensor, partials: CubeTensor, first: usize) -> CubeTensor {
    let grads = readable(grads, "gradients");
    let partials = writable(partials, "partial sums");
    let client = grads.client.clone();
    let chunks = grads.shape().num_elements() / CHUNK;
    assert!(
        first + chunks <= partials.shape().num_elements(),
        "multi-tensor update: chunks {first}..{} past the {} partial sums",
        first + chunks,
        partials.shape().num_elements()
    );
    let dim = CubeDim::new_1d(THREADS);
    chunk_squares_kernel::launch(
        &client,
        calculate_cube_count_elemwise(&client, chunks * THREADS as usize, dim),
        dim,
        grads.into_tensor_arg(),
        partials.clone().into_tensor_arg(),
        first as u32,
        CHUNK as u32,
        THREADS,
    );
    partials
}

/// `[sum of squares, factor, finite]` of a gradient whose sums of squares per chunk are
/// `partials` ([`chunk_squares`]), divided by a loss scale (`unscale` = 1 / scale; 1
/// without one), for the limit `max_norm` (0: no clipping), on the device
/// ([`clip_factor_kernel`]): one launch.
pub fn clip_factor(partials: CubeTensor, max_norm: f32, unscale: f32) -> CubeTensor {
    let partials = readable(partials, "partial sums");
    let client = partials.client.clone();
    let out = empty_device_contiguous_dtype(
        client.clone(),
        partials.device.clone(),
        [3].into(),
        DType::F32,
    );
    clip_factor_kernel::launch(
        &client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(THREADS),
        partials.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        max_norm,
        unscale,
        THREADS,
    );
    out
}

/// One Adam (`decoupled` false) or AdamW step; returns `(params, moment_1, moment_2)`.
pub fn adam(b: FlatBuffers, decoupled: bool) -> (CubeTensor, CubeTensor, CubeTensor) {
    let params = writable(b.params, "parameters");
    let (m1, m2) = (
        writable(b.moment_1, "moments"),
        writable(b.moment_2, "moments"),
    );
    let client = params.client.clone();
    let chunks = params.shape().num_elements() / CHUNK;
    let dim = CubeDim::new_1d(THREADS);
    let hyper = readable(b.hyper, "hyper-parameters");
    let (clip, mode) = clip_arg(b.clip, &hyper);
    adam_kernel::launch(
        &client,
        calculate_cube_count_elemwise(&client, chunks * THREADS as usize, dim),
        dim,
        params.clone().into_tensor_arg(),
        readable(b.grads, "gradients").into_tensor_arg(),
        m1.clone().into_tensor_arg(),
        m2.clone().into_tensor_arg(),
        readable(b.chunk_starts, "the chunk table").into_tensor_arg(),
        readable(b.factors, "factors").into_tensor_arg(),
        hyper.into_tensor_arg(),
        clip.into_tensor_arg(),
        CHUNK as u32,
        decoupled,
        mode,
    );
    (params, m1, m2)
}

/// One LAMB step; returns `(params, moment_1, moment_2)`.
pub fn lamb(b: FlatBuffers) -> (CubeTensor, CubeTensor, CubeTensor) {
    let params = writable(b.params, "parameters");
    let (m1, m2) = (
        writable(b.moment_1, "moments"),
        writable(b.moment_2, "moments"),
    );
    let (starts, hyper) = (
        readable(b.chunk_starts, "the chunk table"),
        readable(b.hyper, "hyper-parameters"),
    );
    let client = params.client.clone();
    let (n, device) = (params.shape().num_elements(), params.device.clone());
    let chunks = n / CHUNK;
    let tensors = starts.shape().num_elements() - 1;
    let empty = |len: usize| {
        empty_device_contiguous_dtype(client.clone(), device.clone(), [len].into(), DType::F32)
    };
    let (direction, partials, trust) = (empty(n), empty(2 * chunks), empty(tensors));
    let dim = CubeDim::new_1d(THREADS);
    let per_chunk = calculate_cube_count_elemwise(&client, chunks * THREADS as usize, dim);
    let (clip, mode) = clip_arg(b.clip, &hyper);
    lamb_direction_kernel::launch(
        &client,
        per_chunk.clone(),
        dim,
        params.clone().into_tensor_arg(),
        readable(b.grads, "gradients").into_tensor_arg(),
        m1.clone().into_tensor_arg(),
        m2.clone().into_tensor_arg(),
        direction.clone().into_tensor_arg(),
        partials.clone().into_tensor_arg(),
        starts.clone().into_tensor_arg(),
        readable(b.factors, "factors").into_tensor_arg(),
        hyper.clone().into_tensor_arg(),
        clip.clone().into_tensor_arg(),
        CHUNK as u32,
        THREADS,
        mode,
    );
    lamb_trust_kernel::launch(
        &client,
        calculate_cube_count_elemwise(&client, tensors * THREADS as usize, dim),
        dim,
        partials.into_tensor_arg(),
        starts.clone().into_tensor_arg(),
        trust.clone().into_tensor_arg(),
        THREADS,
    );
    lamb_apply_kernel::launch(
        &client,
        per_chunk,
        dim,
        params.clone().into_tensor_arg(),
        direction.into_tensor_arg(),
        starts.into_tensor_arg(),
        trust.into_tensor_arg(),
        hyper.into_tensor_arg(),
        clip.into_tensor_arg(),
        CHUNK as u32,
        mode,
    );
    (params, m1, m2)
}
