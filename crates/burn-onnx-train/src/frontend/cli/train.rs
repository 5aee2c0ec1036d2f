//! `onnx-train train`: a run from a config file and flags, checked (`--check`), laid out for
//! the world (`--auto`) and started with elastic restarts.

use std::sync::Arc;

use crate::error::OnnxError;
use crate::frontend::flags::{DataFlags, TrainFlags};
use crate::train::TrainingConfig;
use crate::train::data::Dataset;
use crate::train::layout::auto_layout::Layout;
use crate::train::preflight::check_run;
use crate::train::process::launch::{launch_auto, launch_elastic};

use super::run_setup::{checked_config, cli_defaults, datasets, parse_size};

/// `onnx-train train`'s arguments.
#[derive(clap::Args)]
#[command(after_help = "Examples:
  onnx-train train --model model.onnx --train-data shards/ --seq-len 256 --steps 100
  onnx-train train --config run.toml --dp 2 --zero 1
  onnx-train train --config run.toml --check          # check config, model and data; no training
  mpirun -np 4 onnx-train train --config run.toml --dp 4")]
pub struct TrainArgs {
    #[command(flatten)]
    run: TrainFlags,
    #[command(flatten)]
    data: DataFlags,
    /// Check the config, the model and the data as a run would (every field, the files,
    /// the feeds' names, the token ids against the vocabulary), print what the run would
    /// do, and exit without training.
    #[arg(long, help_heading = "Config")]
    check: bool,
    /// Choose the layout of the world for you: every layout is planned and timed by probe
    /// steps (`onnx-train plan --auto`), and the fastest that fits `--memory-per-rank`
    /// runs, the global batch kept. The world is the configured dp x tp x pp thread ranks,
    /// or under mpirun the job's processes (rank 0 chooses and tells the others).
    #[arg(long, help_heading = "Parallelism")]
    auto: bool,
    /// With --auto: memory of one rank, e.g. 80GiB, 512MiB or bytes.
    #[arg(
        long,
        value_name = "SIZE",
        requires = "auto",
        help_heading = "Parallelism"
    )]
    memory_per_rank: Option<String>,
}

/// `onnx-train train`: the run, or with `--check` what it would do.
pub fn run(args: TrainArgs) -> Result<(), OnnxError> {
    let c = args
        .run
        .apply(cli_defaults())
        .map(|c| args.data.apply(c))
        .map_err(OnnxError::before_first_update)?;
    if args
        .run
        .printed(&c)
        .map_err(OnnxError::before_first_update)?
    {
        return c.check().map_err(OnnxError::before_first_update);
    }
    let c = checked_config(c).map_err(OnnxError::before_first_update)?;
    let (train, test) = datasets(&c).map_err(OnnxError::before_first_update)?;
    if args.check {
        let overview =
            check_run(c, &train, test.as_deref()).map_err(OnnxError::before_first_update)?;
        println!("checked: config, model and data; the run would train\n{overview}");
        return Ok(());
    }
    let summary = if args.auto {
        let limit = args
            .memory_per_rank
            .as_deref()
            .map(parse_size)
            .transpose()
            .map_err(OnnxError::before_first_update)?;
        let choose = |c: &TrainingConfig, world: usize| auto_layout(c, world, &train, limit);
        launch_auto(c, train.clone(), test, args.run.max_restarts, &choose)?
    } else {
        launch_elastic(c, train, test, args.run.max_restarts)?
    };
    // Rank 0 (the one with the throughput report) tells how the run ended.
    if summary.perf.is_some() {
        println!("{summary}");
    }
    Ok(())
}

/// The layout `train --auto` runs for `c` on `world` processes: the fastest that fits
/// `limit` (the memory of a rank).
fn auto_layout(
    c: &TrainingConfig,
    world: usize,
    train: &Arc<dyn Dataset>,
    limit: Option<u64>,
) -> Result<Layout, OnnxError> {
    use crate::train::layout::auto_layout::{chosen, measure, rank_layouts, table};
    let exe = std::env::current_exe().map_err(|e| OnnxError::io("onnx-train", e))?;
    let trials = rank_layouts(c, world, limit, |t| measure(t, train, &exe));
    eprint!("{}", table(&trials));
    let best = chosen(&trials).ok_or_else(|| {
        OnnxError::field(
            "--auto",
            format!("no layout of {world} process(es) fits (see the table above)"),
        )
    })?;
    eprintln!("--auto: {}", best.flags());
    Ok(best.layout())
}
