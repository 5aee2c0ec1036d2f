//! `ort-dist-check`: test a distributed set-up before training on it.
//!
//! ```text
//! mpirun -np 4 target/release/ort-dist-check
//! ```
//! Every rank runs every collective and point-to-point operation on known values through
//! the MPI communicator; rank 0 prints one line per rank, and any mismatch or failure exits
//! non-zero on every rank.

use std::process::ExitCode;

use burn_ort_dist::{Communicator, MpiCommunicator, ReduceOp, check_collectives};

fn main() -> ExitCode {
    let comm = match MpiCommunicator::init() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = check_collectives(&comm);
    if let Err(e) = &result {
        eprintln!("rank {}: {e}", comm.rank());
        comm.abort(2);
    }
    let mut ok = vec![1.0f32];
    if comm.all_reduce(&mut ok, ReduceOp::Sum).is_err() {
        return ExitCode::FAILURE;
    }
    if comm.rank() == 0 {
        println!(
            "{} of {} ranks OK: all_reduce, broadcast, all_gather, reduce_scatter, send/recv, split, barrier",
            ok[0],
            comm.world_size()
        );
    }
    ExitCode::SUCCESS
}
