//! Gradients on the wire in IEEE half precision (ORT's `allreduce_in_fp16`, DeepSpeed's
//! fp16 all-reduce, PyTorch DDP's `fp16_compress_hook`): half the bytes of the f32
//! collectives. A ring reduce-scatter (and, for an all-reduce, a ring all-gather) over the
//! communicator's point-to-point `send`/`recv`, so every communicator (threads, MPI, NCCL)
//! carries it unchanged; the f16 values travel packed two to an f32 slot (copied, never
//! computed on).
//!
//! - **Scale.** Every rank multiplies by the same power of two `2^k`, chosen from the
//!   largest magnitude on any rank (one all-gather of a scalar) so that no partial sum can
//!   exceed 2^15 (f16 overflows at 65504). Small gradients keep as many bits as f16 allows
//!   below the largest one, without depending on the loss scale; the division by `2^k`
//!   afterwards is exact.
//! - **Rounding.** A rank adds the f16 partial sum it receives to its own f32 value and
//!   rounds the result to f16 before passing it on (one rounding per hop, as NCCL's
//!   half-precision ring). Each chunk's final sum is rounded to f16 on its owner too, so
//!   that every rank ends with bit-identical gradients.
//! - **Non-finite values.** When any rank holds inf or NaN, the buffer goes through the
//!   f32 collective instead, so they reach the update as they would uncompressed.
//! - **Deadlock freedom.** Even ranks send before they receive, odd ranks receive first,
//!   so blocking sends (MPI's rendezvous protocol) always meet a receiver.

use std::sync::Arc;

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::comm::communicator::{Communicator, Forwarding, ReduceOp, check_reduce_scatter};
use crate::error::DistResult;

/// Largest partial sum the ring may form: below f16's maximum (65504) with margin.
const SUM_LIMIT: f64 = 32768.0;

/// `values` as f16, two to an f32 slot (the last slot's upper half 0 for an odd count),
/// into `out` (`values.len().div_ceil(2)` slots). Vectorised (F16C where the CPU has it).
fn pack(values: &[f32], out: &mut [f32]) {
    let halves: &mut [u16] = bytemuck::cast_slice_mut(out);
    halves[values.len()..].fill(0);
    halves[..values.len()]
        .reinterpret_cast_mut::<f16>()
        .convert_from_f32_slice(values);
}

/// Values converted at a time by [`unpack_into`] (on the stack).
const BLOCK: usize = 1024;

/// The f16 values of `packed` (as many as `acc` holds), added into `acc` (`add`) or
/// written over it.
fn unpack_into(packed: &[f32], acc: &mut [f32], add: bool) {
    let halves: &[u16] = bytemuck::cast_slice(packed);
    let mut block = [0.0f32; BLOCK];
    for (a, h) in acc.chunks_mut(BLOCK).zip(halves.chunks(BLOCK)) {
        let b = &mut block[..a.len()];
        h[..a.len()]
            .reinterpret_cast::<f16>()
            .convert_to_f32_slice(b);
        if add {
            a.iter_mut().zip(b.iter()).for_each(|(x, y)| *x += *y);
        } else {
            a.copy_from_slice(b);
        }
    }
}

/// Send `out` to the next rank of the ring and receive `into` from the previous one.
fn exchange(comm: &dyn Communicator, out: &[f32], into: &mut [f32]) -> DistResult<()> {
    let (r, n) = (comm.rank(), comm.world_size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    if r.is_multiple_of(2) {
        comm.send(out, next)?;
        comm.recv(into, prev)
    } else {
        comm.recv(into, prev)?;
        comm.send(out, next)
    }
}

/// The shared power of two for the buffers `local` of every rank; `None` when a rank
/// holds inf or NaN.
fn shared_scale(comm: &dyn Communicator, local: &[f32]) -> DistResult<Option<f32>> {
    // The largest magnitude as bits (non-negative floats order as integers; inf and NaN
    // above every finite value): one vectorisable pass.
    let bits = local
        .iter()
        .fold(0u32, |m, x| m.max(x.to_bits() & 0x7fff_ffff));
    let mut all = vec![0.0f32; comm.world_size()];
    comm.all_gather(&[f32::from_bits(bits)], &mut all)?;
    if all.iter().any(|m| !m.is_finite()) {
        return Ok(None);
    }
    let max = all.into_iter().fold(0.0f32, f32::max);
    if max == 0.0 {
        return Ok(Some(1.0));
    }
    let k = (SUM_LIMIT / (f64::from(max) * comm.world_size() as f64))
        .log2()
        .floor()
        .clamp(-126.0, 126.0);
    Ok(Some(2f64.powi(k as i32) as f32))
}

/// The ring's chunks of a buffer of `len` values: `world` ranges of `ceil(len / world)`
/// (the last ones shorter or empty).
struct Chunks {
    len: usize,
    size: usize,
}

impl Chunks {
    fn new(len: usize, world: usize) -> Self {
        Chunks {
            len,
            size: len.div_ceil(world),
        }
    }
    fn range(&self, i: usize) -> std::ops::Range<usize> {
        (i * self.size).min(self.len)..((i + 1) * self.size).min(self.len)
    }
}

/// Ring reduce-scatter of `acc` (already scaled), in place: on return this rank's chunk
/// holds the f16-rounded sum over the ranks. Each hop sends the f16 rounding of the
/// running sum (`pack` rounds).
fn ring_reduce_scatter(
    comm: &dyn Communicator,
    acc: &mut [f32],
    chunks: &Chunks,
) -> DistResult<()> {
    let (r, n) = (comm.rank(), comm.world_size());
    let slots = |i: usize| chunks.range(i).len().div_ceil(2);
    let mut out = vec![0.0f32; chunks.size.div_ceil(2)];
    let mut incoming = out.clone();
    for s in 0..n - 1 {
        let (send, recv) = ((r + 2 * n - s - 1) % n, (r + 2 * n - s - 2) % n);
        pack(&acc[chunks.range(send)], &mut out[..slots(send)]);
        exchange(comm, &out[..slots(send)], &mut incoming[..slots(recv)])?;
        unpack_into(&incoming[..slots(recv)], &mut acc[chunks.range(recv)], true);
    }
    let mine = &mut acc[chunks.range(r)];
    pack(mine, &mut out[..slots(r)]);
    unpack_into(&out[..slots(r)], mine, false);
    Ok(())
}

/// Ring all-gather of the chunks of `acc` (rank `r` holding chunk `r`, f16 values).
fn ring_all_gather(comm: &dyn Communicator, acc: &mut [f32], chunks: &Chunks) -> DistResult<()> {
    let (r, n) = (comm.rank(), comm.world_size());
    let slots = |i: usize| chunks.range(i).len().div_ceil(2);
    let mut out = vec![0.0f32; chunks.size.div_ceil(2)];
    let mut incoming = out.clone();
    for s in 0..n - 1 {
        let (send, recv) = ((r + n - s) % n, (r + 2 * n - s - 1) % n);
        pack(&acc[chunks.range(send)], &mut out[..slots(send)]);
        exchange(comm, &out[..slots(send)], &mut incoming[..slots(recv)])?;
        unpack_into(
            &incoming[..slots(recv)],
            &mut acc[chunks.range(recv)],
            false,
        );
    }
    Ok(())
}

/// Undo the scale, and divide by the world size for a mean, in one exact step (`scale`
/// is a power of two, so `x / (scale * world)` rounds as `(x / scale) / world`).
fn unscale(values: &mut [f32], scale: f32, op: ReduceOp, world: usize) {
    let d = match op {
        ReduceOp::Sum => scale,
        ReduceOp::Mean => scale * world as f32,
    };
    values.iter_mut().for_each(|v| *v /= d);
}

/// All-reduce `buf` over `comm` with f16 on the wire (see the module documentation).
pub fn all_reduce(comm: &dyn Communicator, buf: &mut [f32], op: ReduceOp) -> DistResult<()> {
    let n = comm.world_size();
    if n == 1 || buf.is_empty() {
        return comm.all_reduce(buf, op);
    }
    let Some(scale) = shared_scale(comm, buf)? else {
        return comm.all_reduce(buf, op);
    };
    buf.iter_mut().for_each(|x| *x *= scale);
    let chunks = Chunks::new(buf.len(), n);
    ring_reduce_scatter(comm, buf, &chunks)?;
    ring_all_gather(comm, buf, &chunks)?;
    unscale(buf, scale, op, n);
    Ok(())
}

/// Reduce-scatter `send` over `comm` into this rank's chunk `recv`, f16 on the wire.
pub fn reduce_scatter(
    comm: &dyn Communicator,
    send: &[f32],
    recv: &mut [f32],
    op: ReduceOp,
) -> DistResult<()> {
    let (r, n) = (comm.rank(), comm.world_size());
    check_reduce_scatter(r, n, send.len(), recv.len())?;
    if n == 1 || recv.is_empty() {
        return comm.reduce_scatter(send, recv, op);
    }
    let Some(scale) = shared_scale(comm, send)? else {
        return comm.reduce_scatter(send, recv, op);
    };
    let mut acc: Vec<f32> = send.iter().map(|x| x * scale).collect();
    let chunks = Chunks::new(acc.len(), n);
    ring_reduce_scatter(comm, &mut acc, &chunks)?;
    recv.copy_from_slice(&acc[chunks.range(r)]);
    unscale(recv, scale, op, n);
    Ok(())
}

/// `group` with its reduce-scatter carried in f16 (the gradient reduction of ZeRO-3, which
/// the backward pass runs through the group); every other collective is the group's own.
pub struct Fp16ReduceScatter(pub Arc<dyn Communicator>);

impl Forwarding for Fp16ReduceScatter {
    fn inner(&self) -> &dyn Communicator {
        self.0.as_ref()
    }

    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], op: ReduceOp) -> DistResult<()> {
        reduce_scatter(self.0.as_ref(), send, recv, op)
    }
}
