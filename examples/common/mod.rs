//! What the training examples share: the allocator, logging set-up, error reporting, and
//! the `--bench` output directory.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use burn_onnx_train::OnnxError;

/// Training allocates and frees tensors of tens of megabytes every step; glibc's malloc
/// returns each to the kernel and page-faults it back in (measured: half the step time of
/// the GPT-2 example). mimalloc keeps freed segments for reuse (see
/// `burn_onnx_train::util::allocator`).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Parse the arguments, set up `tracing` (level from `RUST_LOG`, default `info`), run, and
/// turn an error into a message and a failing exit status.
pub fn main_with<A: clap::Parser>(run: fn(A) -> Result<(), OnnxError>) -> ExitCode {
    burn_onnx_train::util::allocator::keep_freed_memory();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    match run(A::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The run's output directory; `--bench` measures in a fresh `<output>/bench` so that it
/// never resumes from an earlier run's checkpoints. Under `mpirun` only world rank 0
/// clears it (two ranks removing one tree race each other); the others start from what
/// it leaves.
pub fn output_dir(base: &Path, bench: bool) -> Result<PathBuf, OnnxError> {
    if !bench {
        return Ok(base.to_path_buf());
    }
    let dir = base.join("bench");
    let rank = ["OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok());
    if dir.exists() && rank.as_deref().is_none_or(|r| r == "0") {
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(OnnxError::io(&dir, e));
            }
            _ => {}
        }
    }
    Ok(dir)
}
