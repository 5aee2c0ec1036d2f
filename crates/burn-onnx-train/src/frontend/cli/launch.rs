//! `onnx-train launch`: an `onnx-train` subcommand run under mpirun, restarted from its
//! newest checkpoint when a rank fails.

use std::path::PathBuf;

use crate::error::OnnxError;
use crate::train::process::elastic::ElasticJob;

/// `onnx-train launch`'s arguments.
#[derive(clap::Args)]
pub struct LaunchArgs {
    /// Ranks (`mpirun -np`).
    #[arg(long)]
    np: usize,
    /// Restarts after a failure (0, as torchrun's default: restarts are asked for).
    #[arg(long, default_value_t = 0)]
    max_restarts: usize,
    /// The fewest ranks the job may shrink to when a rank is lost for good (a size that
    /// fails twice in a row), as torchrun's `--nnodes MIN:MAX`; the ranks keep the
    /// global batch by raising gradient accumulation (default: --np, no shrinking).
    #[arg(long)]
    min_np: Option<usize>,
    /// The mpirun program.
    #[arg(long, default_value = "mpirun")]
    mpirun: PathBuf,
    /// Extra mpirun arguments (repeat; e.g. --mpirun-arg=--oversubscribe).
    #[arg(long = "mpirun-arg", allow_hyphen_values = true)]
    mpirun_args: Vec<String>,
    /// What each rank runs: an onnx-train subcommand and its arguments, after `--`.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// `onnx-train launch`: the job run to success, or its last failure.
pub fn run(args: LaunchArgs) -> Result<(), OnnxError> {
    let LaunchArgs {
        np,
        max_restarts,
        min_np,
        mpirun,
        mpirun_args,
        command,
    } = args;
    let me = std::env::current_exe().map_err(|e| OnnxError::io("onnx-train", e))?;
    let command = std::iter::once(me.into_os_string())
        .chain(command.into_iter().map(Into::into))
        .collect();
    let mpirun_args = mpirun_args.into_iter().map(Into::into).collect();
    let restarts = ElasticJob {
        mpirun: mpirun.into_os_string(),
        ranks: np,
        mpirun_args,
        command,
        max_restarts,
        min_ranks: min_np.unwrap_or(np),
    }
    .run()?;
    println!("the job succeeded after {restarts} restart(s)");
    Ok(())
}
