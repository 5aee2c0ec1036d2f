//! All-reduce of N f32 (default 10M; the first argument sets it, e.g. 124439808 for GPT-2
//! 124M's gradients) through our `MpiCommunicator` against a plain rsmpi `all_reduce_into`
//! of the same buffer, and our f16 ring (`allreduce_in_fp16`: half the bytes, over
//! point-to-point messages), in the same run:
//!
//! ```text
//! cargo build --release --features mpi --example allreduce_bench
//! mpirun -np 2 target/release/examples/allreduce_bench [N]
//! ```

use std::time::Instant;

use burn_ort::burn_ort_dist::mpi::collective::SystemOperation;
use burn_ort::burn_ort_dist::mpi::traits::CommunicatorCollectives;
use burn_ort::burn_ort_dist::{Communicator, MpiCommunicator, ReduceOp, fp16_wire};

const DEFAULT_VALUES: usize = 10_000_000;
const REPEATS: usize = 10;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = match std::env::args().nth(1) {
        Some(arg) => arg
            .parse()
            .map_err(|e| format!("the value count `{arg}` is not a whole number: {e}"))?,
        None => DEFAULT_VALUES,
    };
    let comm = MpiCommunicator::init()?;
    let rank = comm.rank();
    let mut ours = Vec::new();
    let mut raw = Vec::new();
    let mut half = Vec::new();
    let mut buf = vec![rank as f32 + 1.0; n];
    let mut recv = vec![0f32; n];
    for _ in 0..REPEATS {
        comm.barrier()?;
        let t = Instant::now();
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        ours.push(t.elapsed().as_secs_f64() * 1e3);
        comm.barrier()?;
        let t = Instant::now();
        comm.with_world(|w| w.all_reduce_into(&buf[..], &mut recv[..], SystemOperation::sum()))?;
        raw.push(t.elapsed().as_secs_f64() * 1e3);
        buf.fill(rank as f32 + 1.0);
        comm.barrier()?;
        let t = Instant::now();
        fp16_wire::all_reduce(&comm, &mut buf, ReduceOp::Sum)?;
        half.push(t.elapsed().as_secs_f64() * 1e3);
        buf.fill(rank as f32 + 1.0);
    }
    if rank == 0 {
        let (o, r, h) = (median(ours), median(raw), median(half));
        println!(
            "| ranks | elements | burn-ort-dist all_reduce (ms, median of {REPEATS}) | rsmpi all_reduce_into (ms) | ratio | f16 ring (ms) |"
        );
        println!("|---|---|---|---|---|---|");
        println!(
            "| {} | {n} | {o:.1} | {r:.1} | {:.2} | {h:.1} |",
            comm.world_size(),
            o / r
        );
    }
    Ok(())
}
