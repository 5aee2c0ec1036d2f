//! `onnx-train plan`: the memory each rank of a layout needs and whether it fits, or with
//! `--auto` every layout of the world planned, timed and ranked.

use crate::error::OnnxError;
use crate::frontend::flags::{ConfigFlags, DataFlags};

use super::run_setup::{checked_config, cli_defaults, datasets, parse_size};

/// `onnx-train plan`'s arguments.
#[derive(clap::Args)]
#[command(after_help = "Examples:
  onnx-train plan --config run.toml --dp 2 --zero 3 --memory-per-rank 24GiB
  onnx-train plan --model model.onnx --train-data shards/ --auto --np 4 --memory-per-rank 80GiB")]
pub struct PlanArgs {
    #[command(flatten)]
    run: ConfigFlags,
    #[command(flatten)]
    data: DataFlags,
    /// Memory of one rank (one MPI process), e.g. 80GiB, 512MiB, 2.5GB or bytes: the
    /// plan says whether the layout fits and exits with status 3 when it does not.
    #[arg(long, value_name = "SIZE", help_heading = "Plan")]
    memory_per_rank: Option<String>,
    /// Print the plan as JSON.
    #[arg(long, help_heading = "Plan")]
    json: bool,
    /// Plan and time every layout of the world (`--np`, default the configured one's
    /// processes) and rank them: the fitting layouts fastest first (see `train --auto`).
    #[arg(long, help_heading = "Plan")]
    auto: bool,
    /// With --auto: the processes to lay out.
    #[arg(long, requires = "auto", help_heading = "Plan")]
    np: Option<usize>,
}

/// `onnx-train plan`: the plan on standard output; exits with status 3 when nothing fits.
pub fn run(args: PlanArgs) -> Result<(), OnnxError> {
    use crate::train::layout::memory_plan::{human_bytes, lighter_layouts, plan_memory};
    let c = args
        .run
        .apply(cli_defaults())
        .map(|c| args.data.apply(c))
        .and_then(checked_config)
        .map_err(OnnxError::before_first_update)?;
    let limit = args
        .memory_per_rank
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(OnnxError::before_first_update)?;
    let (train, _) = datasets(&c).map_err(OnnxError::before_first_update)?;
    let exe = std::env::current_exe().map_err(|e| OnnxError::io("onnx-train", e))?;
    if args.auto {
        use crate::train::layout::auto_layout::{chosen, measure, rank_layouts, table};
        let world = args.np.unwrap_or_else(|| c.parallel.world_size());
        let trials = rank_layouts(&c, world, limit, |t| measure(t, &train, &exe));
        if args.json {
            print_json(&trials)?;
        } else {
            print!("{}", table(&trials));
        }
        return match chosen(&trials) {
            Some(best) => {
                eprintln!("chosen: {}", best.flags());
                Ok(())
            }
            None => {
                eprintln!("no layout of {world} process(es) fits");
                std::process::exit(3)
            }
        };
    }
    let plan = plan_memory(&c, &train, &exe)?;
    if args.json {
        print_json(&plan)?;
    } else {
        print!("{plan}");
    }
    match limit {
        Some(limit) if plan.per_process_bytes() > limit => {
            eprintln!(
                "does not fit: a rank needs {}, --memory-per-rank is {}; lighter layouts:",
                human_bytes(plan.per_process_bytes()),
                human_bytes(limit)
            );
            for change in lighter_layouts(&c) {
                eprintln!("  {change}");
            }
            std::process::exit(3)
        }
        Some(limit) => println!(
            "fits: a rank needs {} of {}",
            human_bytes(plan.per_process_bytes()),
            human_bytes(limit)
        ),
        None => {}
    }
    Ok(())
}

/// `value` as pretty JSON on standard output.
fn print_json(value: &impl serde::Serialize) -> Result<(), OnnxError> {
    let text =
        serde_json::to_string_pretty(value).map_err(|e| OnnxError::field("plan", e.to_string()))?;
    println!("{text}");
    Ok(())
}
