//! The `onnx-train` command line: the top-level [`Cli`] (clap), its subcommands (one module
//! each, holding its arguments and its body), the log subscriber, and how an error becomes
//! the process's exit status.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::error::OnnxError;
use crate::train::process::preemption::{PREEMPTED_EXIT_CODE, is_preemption};

mod export;
mod gpt2;
mod init;
mod inspect;
mod launch;
mod plan;
mod run;
mod run_setup;
mod tokenize;
mod train;

/// `onnx-train`'s command line.
#[derive(Parser)]
#[command(name = "onnx-train", version, about = "Train ONNX models with Burn")]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print inputs, outputs, op counts and trainable parameters.
    Inspect(inspect::InspectArgs),
    /// Run the model on .npy inputs; writes DIR/<output>.npy for every graph output, in the
    /// element type the graph declares for it (computed in f32 / i64, then cast). A
    /// sequence goes in as a directory of .npy files (in name order) and comes out as the
    /// directory DIR/<output>/ of 00000.npy, ...; an optional input left out is empty.
    Run(run::RunArgs),
    /// Write a commented training config for an ONNX model, filled from its graph: the
    /// input the batch feeds and the output the loss reads, a loss guessed from the
    /// output's shape, `seq_len` up to the position table, the vocabulary token ids must fit.
    Init(init::InitArgs),
    /// Train as a TOML/JSON TrainingConfig says (token shards for `lm_cross_entropy`, image
    /// shards for `cross_entropy` and `mse`); flags override the file only when given.
    Train(train::TrainArgs),
    /// Print the memory each rank of the configured layout needs (parameters, gradients,
    /// optimizer state, and the forward/backward working set measured by a probe of one
    /// and two samples on this machine's CPU), and whether it fits `--memory-per-rank`.
    Plan(plan::PlanArgs),
    /// Run `onnx-train COMMAND...` under mpirun with N ranks, and start the job again from
    /// its newest checkpoint when a rank fails (elastic restart, like torchrun).
    Launch(launch::LaunchArgs),
    /// Export the trained model held in a checkpoint directory as an ONNX file.
    Export(export::ExportArgs),
    /// Tokenize UTF-8 text files into token shards for `train` (DIR/tokens_NNNNN.npy,
    /// uint16 ids, uint32 when the vocabulary needs it) with a Hugging Face tokenizer.json.
    Tokenize(tokenize::TokenizeArgs),
    /// Build a GPT-2 (random N(0, 0.02) weights, HF initializer names) as an ONNX file: the
    /// example's model, or big ones for load/export tests (weights past 1.8 GB go to
    /// external data).
    Gpt2(gpt2::Gpt2Args),
}

impl Cli {
    /// Runs the subcommand; its error, if any, printed and turned into the exit status.
    pub fn run(self) -> ExitCode {
        exit_code(self.command.run())
    }
}

impl Command {
    fn run(self) -> Result<(), OnnxError> {
        match self {
            Command::Inspect(args) => inspect::run(args),
            Command::Run(args) => run::run(args),
            Command::Init(args) => init::run(args),
            Command::Train(args) => train::run(args),
            Command::Plan(args) => plan::run(args),
            Command::Launch(args) => launch::run(args),
            Command::Export(args) => export::run(args),
            Command::Tokenize(args) => tokenize::run(args),
            Command::Gpt2(args) => gpt2::run(args),
        }
    }
}

/// Logs (`RUST_LOG`, default `info`) to standard error, coloured on a terminal.
pub fn init_logging() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// The exit status of a subcommand's `result`, its error printed on standard error.
fn exit_code(result: Result<(), OnnxError>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_preemption(&e) => {
            // One write, so the lines of MPI ranks sharing the terminal do not interleave.
            let line = format!("{e}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            ExitCode::from(PREEMPTED_EXIT_CODE)
        }
        Err(e) => {
            eprintln!("error: {e}");
            // 78 (EX_CONFIG) when the input is at fault (a run that failed before its first
            // update: not worth restarting), 1 otherwise.
            ExitCode::from(e.training_exit_code())
        }
    }
}
