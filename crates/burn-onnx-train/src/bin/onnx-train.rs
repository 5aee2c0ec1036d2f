//! `onnx-train`: inspect an ONNX model, run it on `.npy` inputs, or train it. The
//! subcommands live in the library, `burn_onnx_train::frontend::cli`.
//!
//! ```text
//! onnx-train inspect MODEL.onnx [--stages N] [--tp N]
//! onnx-train run MODEL.onnx --input NAME=FILE.npy ... --output-dir DIR
//! onnx-train init MODEL.onnx [--output run.toml]     # a commented config from the graph
//! onnx-train train --config run.toml [--dp N]        # or: mpirun -np N onnx-train train ...
//! onnx-train train --model M.onnx --train-data DIR [--seq-len N] [--loss KIND]
//! onnx-train export --checkpoint DIR --output trained.onnx [--model MODEL.onnx]
//! onnx-train launch --np 4 --max-restarts 3 -- train --config run.toml --dp 4
//! onnx-train gpt2 --output gpt2_124m.onnx [--layers 12 --heads 12 --width 768]
//! ```

use std::process::ExitCode;

use burn_onnx_train::frontend::cli::{Cli, init_logging};
use clap::Parser;

/// Training allocates and frees tensors of tens of megabytes every step; glibc's malloc
/// returns each to the kernel and page-faults it back in (measured: half the step time of
/// the GPT-2 example). mimalloc keeps freed segments for reuse (see
/// `burn_onnx_train::util::allocator`).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    burn_onnx_train::util::allocator::keep_freed_memory();
    init_logging();
    Cli::parse().run()
}
