//! `ort-dist-check`: test a distributed set-up before training on it.
//!
//! ```text
//! mpirun -np 4 target/release/ort-dist-check
//! mpirun -np 4 target/release/ort-dist-check --timeout 5 --stall-rank 3 [--stall-in receive]
//! ```
//! Every rank runs every collective and point-to-point operation on known values through
//! the MPI communicator; rank 0 prints one line per rank, and any mismatch or failure exits
//! non-zero on every rank.
//!
//! With `--stall-rank R`, rank R then hangs instead of joining the last all-reduce (or
//! waits to receive from rank 0 instead, with `--stall-in receive`): with `--timeout S` (seconds per
//! operation, as the trainer's `collective_timeout`) the other ranks must end the job with
//! an error naming the operation, the group and rank R, which shows that a hang on this
//! set-up becomes an error.

use std::process::ExitCode;
use std::time::Duration;

use burn_ort_dist::{Communicator, MpiCommunicator, ReduceOp, check_collectives};

struct Args {
    timeout: Option<Duration>,
    stall_rank: Option<usize>,
    stall_in_receive: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        timeout: None,
        stall_rank: None,
        stall_in_receive: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--timeout" => {
                let s: f64 = value()?.parse().map_err(|e| format!("--timeout: {e}"))?;
                args.timeout = Some(Duration::from_secs_f64(s));
            }
            "--stall-rank" => {
                args.stall_rank = Some(value()?.parse().map_err(|e| format!("--stall-rank: {e}"))?);
            }
            "--stall-in" => match value()?.as_str() {
                "receive" => args.stall_in_receive = true,
                "nothing" => args.stall_in_receive = false,
                other => return Err(format!("--stall-in: {other} (receive or nothing)")),
            },
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let comm = match MpiCommunicator::init() {
        // The stalling rank waits without limit: it answers its peers until they give up.
        Ok(c) if args.stall_rank == Some(c.rank()) => c,
        Ok(c) => c.with_timeout(args.timeout),
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
    if args.stall_rank == Some(comm.rank()) {
        if args.stall_in_receive {
            // A message rank 0 never sends (a receive cannot match the others' collective).
            let _ = comm.recv(&mut [0.0; 4], 0);
        }
        std::thread::sleep(Duration::from_secs(3600));
    }
    let mut ok = vec![1.0f32];
    if let Err(e) = comm.all_reduce(&mut ok, ReduceOp::Sum) {
        // The error names its rank.
        eprintln!("{e}");
        comm.abort(3);
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
