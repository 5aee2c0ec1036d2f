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

use crate::communicator::{Communicator, ReduceOp, check_reduce_scatter};
use crate::error::DistResult;

/// Largest partial sum the ring may form: below f16's maximum (65504) with margin.
const SUM_LIMIT: f64 = 32768.0;

/// Two f16 values per f32 slot (the last slot's upper half 0 for an odd count).
fn pack(values: &[f32]) -> Vec<f32> {
    values
        .chunks(2)
        .map(|p| {
            let lo = u32::from(f16::from_f32(p[0]).to_bits());
            let hi = p
                .get(1)
                .map_or(0, |v| u32::from(f16::from_f32(*v).to_bits()));
            f32::from_bits(lo | (hi << 16))
        })
        .collect()
}

/// The first `n` f16 values of `packed`, as f32.
fn unpack(packed: &[f32], n: usize) -> Vec<f32> {
    packed
        .iter()
        .flat_map(|w| {
            let bits = w.to_bits();
            [bits as u16, (bits >> 16) as u16].map(|h| f16::from_bits(h).to_f32())
        })
        .take(n)
        .collect()
}

/// The value as the f16 wire holds it.
fn round(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
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
    let max = local
        .iter()
        .try_fold(0.0f32, |m, x| x.is_finite().then(|| m.max(x.abs())))
        .unwrap_or(f32::NAN);
    let mut all = vec![0.0f32; comm.world_size()];
    comm.all_gather(&[max], &mut all)?;
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

/// Ring reduce-scatter of `acc` (already scaled; `world` chunks of `c` values): on return
/// this rank's chunk holds the f16-rounded sum over the ranks.
fn ring_reduce_scatter(comm: &dyn Communicator, acc: &mut [f32], c: usize) -> DistResult<()> {
    let (r, n) = (comm.rank(), comm.world_size());
    let mut incoming = vec![0.0f32; c.div_ceil(2)];
    for s in 0..n - 1 {
        let (send, recv) = ((r + 2 * n - s - 1) % n, (r + 2 * n - s - 2) % n);
        let out = pack(&acc[send * c..(send + 1) * c]);
        exchange(comm, &out, &mut incoming)?;
        for (a, p) in acc[recv * c..(recv + 1) * c]
            .iter_mut()
            .zip(unpack(&incoming, c))
        {
            *a = round(p + *a);
        }
    }
    if n == 1 {
        acc.iter_mut().for_each(|a| *a = round(*a));
    }
    Ok(())
}

/// Ring all-gather of the chunks of `acc` (rank `r` holding chunk `r`, f16 values).
fn ring_all_gather(comm: &dyn Communicator, acc: &mut [f32], c: usize) -> DistResult<()> {
    let (r, n) = (comm.rank(), comm.world_size());
    let mut incoming = vec![0.0f32; c.div_ceil(2)];
    for s in 0..n - 1 {
        let (send, recv) = ((r + n - s) % n, (r + 2 * n - s - 1) % n);
        let out = pack(&acc[send * c..(send + 1) * c]);
        exchange(comm, &out, &mut incoming)?;
        acc[recv * c..(recv + 1) * c].copy_from_slice(&unpack(&incoming, c));
    }
    Ok(())
}

/// Undo the scale (and divide by the world size for a mean) in place.
fn unscale(values: &mut [f32], scale: f32, op: ReduceOp, world: usize) {
    let inv = 1.0 / scale;
    for v in values.iter_mut() {
        *v *= inv;
    }
    crate::communicator::scale_mean(values, op, world);
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
    let c = buf.len().div_ceil(n);
    let mut acc: Vec<f32> = buf.iter().map(|x| x * scale).collect();
    acc.resize(c * n, 0.0);
    ring_reduce_scatter(comm, &mut acc, c)?;
    ring_all_gather(comm, &mut acc, c)?;
    buf.copy_from_slice(&acc[..buf.len()]);
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
    let c = recv.len();
    let mut acc: Vec<f32> = send.iter().map(|x| x * scale).collect();
    ring_reduce_scatter(comm, &mut acc, c)?;
    recv.copy_from_slice(&acc[r * c..(r + 1) * c]);
    unscale(recv, scale, op, n);
    Ok(())
}

/// `group` with its reduce-scatter carried in f16 (the gradient reduction of ZeRO-3, which
/// the backward pass runs through the group); every other collective is the group's own.
pub struct Fp16ReduceScatter(pub Arc<dyn Communicator>);

impl Communicator for Fp16ReduceScatter {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> DistResult<()> {
        self.0.all_reduce(buf, op)
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> DistResult<()> {
        self.0.broadcast(buf, root)
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> DistResult<()> {
        self.0.all_gather(send, recv)
    }
    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], op: ReduceOp) -> DistResult<()> {
        reduce_scatter(self.0.as_ref(), send, recv, op)
    }
    fn barrier(&self) -> DistResult<()> {
        self.0.barrier()
    }
    fn send(&self, buf: &[f32], dest: usize) -> DistResult<()> {
        self.0.send(buf, dest)
    }
    fn recv(&self, buf: &mut [f32], src: usize) -> DistResult<()> {
        self.0.recv(buf, src)
    }
    fn split(&self, color: usize, key: usize) -> DistResult<Box<dyn Communicator>> {
        self.0.split(color, key)
    }
    fn abort(&self, code: i32) {
        self.0.abort(code)
    }
}
