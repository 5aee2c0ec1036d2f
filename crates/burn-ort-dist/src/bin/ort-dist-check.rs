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
//! With `--bandwidth`, the ranks then time every collective at sizes doubling from
//! `--min-bytes` (default 8) to `--max-bytes` (default 64M; K, M and G suffixes), `--iters`
//! times each (default 20), and rank 0 prints nccl-tests' table: time, algorithm and bus
//! bandwidth. With `--device cuda` (a build with the `cuda` feature) the group is NCCL's
//! over the MPI world, each rank on its node-local GPU, and the table adds the all-reduce
//! of GPU buffers (the gradient path); the other rows are NCCL's with host copies.
//!
//! ```text
//! mpirun -np 8 target/release/ort-dist-check --bandwidth --device cuda
//! ```
//!
//! With `--stall-rank R`, rank R then hangs instead of joining the last all-reduce (or
//! waits to receive from rank 0 instead, with `--stall-in receive`): with `--timeout S` (seconds per
//! operation, as the trainer's `collective_timeout`) the other ranks must end the job with
//! an error naming the operation, the group and rank R, which shows that a hang on this
//! set-up becomes an error.

use std::process::ExitCode;
use std::time::Duration;

use burn_ort_dist::comm::bandwidth;
use burn_ort_dist::{Communicator, DistError, MpiCommunicator, ReduceOp, check_collectives};

struct Args {
    timeout: Option<Duration>,
    stall_rank: Option<usize>,
    stall_in_receive: bool,
    /// Byte range and repetitions of the bandwidth table, when asked for.
    bandwidth: Option<(usize, usize, usize)>,
    /// `--device cuda`: NCCL on the node-local GPUs.
    cuda: bool,
}

/// `N`, `NK`, `NM` or `NG` bytes.
fn bytes(text: &str) -> Result<usize, String> {
    let (digits, unit) = match text.char_indices().last() {
        Some((i, 'K' | 'k')) => (&text[..i], 1 << 10),
        Some((i, 'M' | 'm')) => (&text[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&text[..i], 1 << 30),
        _ => (text, 1),
    };
    let n: usize = digits
        .parse()
        .map_err(|e| format!("{text}: {e} (a byte count, with K, M or G)"))?;
    Ok(n * unit)
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        timeout: None,
        stall_rank: None,
        stall_in_receive: false,
        bandwidth: None,
        cuda: false,
    };
    let (mut min, mut max, mut iters, mut bandwidth) = (8, 64 << 20, 20, false);
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
            "--bandwidth" => bandwidth = true,
            "--min-bytes" => min = bytes(&value()?).map_err(|e| format!("--min-bytes: {e}"))?,
            "--max-bytes" => max = bytes(&value()?).map_err(|e| format!("--max-bytes: {e}"))?,
            "--iters" => iters = value()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--device" => match value()?.as_str() {
                "cpu" => args.cuda = false,
                "cuda" => args.cuda = true,
                other => return Err(format!("--device: {other} (cpu or cuda)")),
            },
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if min > max {
        return Err(format!("--min-bytes {min} is above --max-bytes {max}"));
    }
    args.bandwidth = bandwidth.then_some((min, max, iters));
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
    let Some(range) = args.bandwidth else {
        return ExitCode::SUCCESS;
    };
    let rank = comm.rank();
    match bandwidth_table(comm, args.cuda, range) {
        Ok(table) if rank == 0 => print!("{table}"),
        Ok(_) => {}
        Err(_) => return ExitCode::FAILURE,
    }
    ExitCode::SUCCESS
}

/// The bandwidth table of `mpi`'s group over `(min bytes, max bytes, repetitions)`, or of
/// NCCL's group over it (each rank on its node-local GPU) with `cuda`.
fn bandwidth_table(
    mpi: MpiCommunicator,
    cuda: bool,
    (min, max, iters): (usize, usize, usize),
) -> Result<String, DistError> {
    let sizes = bandwidth::sizes(min, max, mpi.world_size());
    // A rank that fails ends the job, so no other waits in a collective for it.
    let ended = |comm: &dyn Communicator, e: DistError| {
        eprintln!("{e}");
        comm.abort(4);
        e
    };
    if !cuda {
        let rows = bandwidth::measure(&mpi, &sizes, iters).map_err(|e| ended(&mpi, e))?;
        return Ok(bandwidth::table(&rows));
    }
    #[cfg(feature = "cuda")]
    {
        let gpu = burn_ort_dist::local_rank(mpi.rank());
        let nccl = burn_ort_dist::NcclCommunicator::init(mpi, gpu)?;
        let device = burn::tensor::Device::cuda(gpu);
        let rows = bandwidth::measure(&nccl, &sizes, iters)
            .and_then(|mut rows| {
                rows.extend(bandwidth::measure_device(&nccl, &device, &sizes, iters)?);
                Ok(rows)
            })
            .map_err(|e| ended(&nccl, e))?;
        Ok(bandwidth::table(&rows))
    }
    #[cfg(not(feature = "cuda"))]
    Err(DistError::Invalid {
        rank: mpi.rank(),
        message: "--device cuda needs a build with the `cuda` feature".into(),
    })
}
