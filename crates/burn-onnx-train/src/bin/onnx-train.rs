//! `onnx-train`: inspect an ONNX model, run it on `.npy` inputs, or train it.
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

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use burn::tensor::Device;
use burn_onnx_train::frontend::builders::gpt2::{Gpt2Config, write_gpt2};
use burn_onnx_train::frontend::flags::{ConfigFlags, DataFlags, TrainFlags};
use burn_onnx_train::frontend::starter_config::starter_config;
use burn_onnx_train::frontend::tokenize::{TokenizeOptions, tokenize};
use burn_onnx_train::graph::{Dim, dims_text};
use burn_onnx_train::model::loss::LossKind;
use burn_onnx_train::onnx::export::{ExportOptions, ExternalDataPolicy, export_onnx_with};
use burn_onnx_train::parallel::pipeline::Partition;
use burn_onnx_train::train::TrainingConfig;
use burn_onnx_train::train::checkpoint::manifest::check_files;
use burn_onnx_train::train::checkpoint::params::{from_other_model, read_params};
use burn_onnx_train::train::checkpoint::{find_checkpoint, read_state, weights_file_bytes};
use burn_onnx_train::train::data::documents::token_dataset;
use burn_onnx_train::train::data::npy::{read_npy_value, write_npy_as};
use burn_onnx_train::train::data::{Dataset, ImageDataset};
use burn_onnx_train::train::layout::auto_layout::Layout;
use burn_onnx_train::train::preflight::check_run;
use burn_onnx_train::train::process::elastic::ElasticJob;
use burn_onnx_train::train::process::launch::{launch_auto, launch_elastic};
use burn_onnx_train::util::atomic_file::write_atomic;
use burn_onnx_train::value::host_tensor::dtype;
use burn_onnx_train::{Graph, Mode, OnnxError, OnnxModel, ParamRole, Value};
use clap::{Parser, Subcommand};
use std::sync::Arc;

#[derive(Parser)]
#[command(name = "onnx-train", version, about = "Train ONNX models with Burn")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print inputs, outputs, op counts and trainable parameters.
    Inspect {
        /// The ONNX file.
        model: PathBuf,
        /// Also print the automatic cut into N pipeline stages (nodes, parameters,
        /// estimated work, the values crossing each cut).
        #[arg(long, value_name = "N")]
        stages: Option<usize>,
        /// Also print the tensor-parallel split over N ranks (the blocks found, each split
        /// weight's axis and period), planned from a probe on zero inputs (symbolic
        /// dimensions: 2 for the first, 8 for the others).
        #[arg(long, value_name = "N")]
        tp: Option<usize>,
    },
    /// Run the model on .npy inputs; writes DIR/<output>.npy for every graph output, in the
    /// element type the graph declares for it (computed in f32 / i64, then cast). A
    /// sequence goes in as a directory of .npy files (in name order) and comes out as the
    /// directory DIR/<output>/ of 00000.npy, ...; an optional input left out is empty.
    Run {
        /// The ONNX file.
        model: PathBuf,
        /// An input as NAME=FILE.npy (repeat for each graph input).
        #[arg(long = "input", value_name = "NAME=FILE.npy")]
        inputs: Vec<String>,
        /// Where to write the outputs.
        #[arg(long, value_name = "DIR")]
        output_dir: PathBuf,
        /// Where to run it: cpu, wgpu[:N] (--features wgpu), cuda[:N] (--features cuda).
        #[arg(long, value_name = "D", default_value = "cpu")]
        device: burn_onnx_train::train::DeviceSpec,
    },
    /// Write a commented training config for an ONNX model, filled from its graph: the
    /// input the batch feeds and the output the loss reads, a loss guessed from the
    /// output's shape, `seq_len` up to the position table, the vocabulary token ids must fit.
    Init {
        /// The ONNX file.
        model: PathBuf,
        /// The config file to write.
        #[arg(long, default_value = "run.toml")]
        output: PathBuf,
        /// Replace the config file if it exists.
        #[arg(long)]
        force: bool,
    },
    /// Train as a TOML/JSON TrainingConfig says (token shards for `lm_cross_entropy`, image
    /// shards for `cross_entropy` and `mse`); flags override the file only when given.
    Train(TrainArgs),
    /// Print the memory each rank of the configured layout needs (parameters, gradients,
    /// optimizer state, and the forward/backward working set measured by a probe of one
    /// and two samples on this machine's CPU), and whether it fits `--memory-per-rank`.
    Plan(PlanArgs),
    /// Run `onnx-train COMMAND...` under mpirun with N ranks, and start the job again from
    /// its newest checkpoint when a rank fails (elastic restart, like torchrun).
    Launch {
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
    },
    /// Export the trained model held in a checkpoint directory as an ONNX file.
    Export {
        /// The checkpoint: its directory (`ckpt-NNNNNNNNN`), a directory of checkpoints, or a
        /// run's output directory (the newest checkpoint in either); without it, `--model`
        /// is written as it is (e.g. to move its weights into external data).
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// The ONNX file to write.
        #[arg(long)]
        output: PathBuf,
        /// The model the checkpoint was trained from (default: the `model_path` of the run
        /// that wrote it).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Put the weights in ONNX external data (`<output>.data`) even below the 1.8 GB at
        /// which it happens anyway (protobuf's 2 GB limit).
        #[arg(long)]
        external_data: bool,
        /// Write the weights alone as one safetensors file (ONNX initializer names, logical
        /// shapes, f32, `format: pt` metadata as Hugging Face's loaders expect) instead of
        /// an ONNX file; a pipelined or tensor-parallel checkpoint's parts are merged.
        #[arg(long, conflicts_with = "external_data")]
        safetensors: bool,
    },
    /// Tokenize UTF-8 text files into token shards for `train` (DIR/tokens_NNNNN.npy,
    /// uint16 ids, uint32 when the vocabulary needs it) with a Hugging Face tokenizer.json.
    Tokenize {
        /// The tokenizer (Hugging Face's `tokenizer.json`).
        #[arg(long)]
        tokenizer: PathBuf,
        /// Where the shards go (the directory `train_data_dir` then names).
        #[arg(long, value_name = "DIR")]
        output: PathBuf,
        /// Tokens per shard (the last one may hold fewer).
        #[arg(long, default_value_t = 100_000_000)]
        shard_tokens: usize,
        /// Each non-empty line is a document (default: each file is one).
        #[arg(long)]
        per_line: bool,
        /// A token appended after every document, e.g. "<|endoftext|>" for GPT-2.
        #[arg(long, value_name = "TOKEN")]
        eos: Option<String>,
        /// The text files, in stream order.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Build a GPT-2 (random N(0, 0.02) weights, HF initializer names) as an ONNX file: the
    /// example's model, or big ones for load/export tests (weights past 1.8 GB go to
    /// external data).
    Gpt2 {
        /// The ONNX file to write.
        #[arg(long)]
        output: PathBuf,
        /// Layers.
        #[arg(long, default_value_t = 12)]
        layers: usize,
        /// Attention heads.
        #[arg(long, default_value_t = 12)]
        heads: usize,
        /// Width.
        #[arg(long, default_value_t = 768)]
        width: usize,
        /// Vocabulary.
        #[arg(long, default_value_t = 50257)]
        vocab: usize,
        /// Positions.
        #[arg(long, default_value_t = 1024)]
        positions: usize,
        /// Seed of the weights.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Separate q_proj/k_proj/v_proj projections instead of the fused c_attn (the
        /// layout of LLaMA- and BERT-style exports).
        #[arg(long)]
        separate_qkv: bool,
    },
}

#[derive(clap::Args)]
#[command(after_help = "Examples:
  onnx-train train --model model.onnx --train-data shards/ --seq-len 256 --steps 100
  onnx-train train --config run.toml --dp 2 --zero 1
  onnx-train train --config run.toml --check          # check config, model and data; no training
  mpirun -np 4 onnx-train train --config run.toml --dp 4")]
struct TrainArgs {
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

#[derive(clap::Args)]
#[command(after_help = "Examples:
  onnx-train plan --config run.toml --dp 2 --zero 3 --memory-per-rank 24GiB
  onnx-train plan --model model.onnx --train-data shards/ --auto --np 4 --memory-per-rank 80GiB")]
struct PlanArgs {
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

fn inspect(path: PathBuf, stages: Option<usize>, tp: Option<usize>) -> Result<(), OnnxError> {
    let graph = Graph::load(&path)?;
    let model = OnnxModel::from_graph(graph, &Device::flex())?;
    let g = model.graph();
    println!(
        "model: {} (opset {}, {} nodes)",
        path.display(),
        g.opset,
        g.model.graph.as_ref().map_or(0, |g| g.node.len())
    );
    println!("inputs:");
    for i in &g.inputs {
        println!(
            "  {} {} {}",
            i.name,
            dtype::name(i.elem_type),
            dims_text(&i.dims)
        );
    }
    println!("outputs:");
    for o in &g.outputs {
        println!(
            "  {} {} {}",
            o.name,
            dtype::name(o.elem_type),
            dims_text(&o.dims)
        );
    }
    println!("ops:");
    for (op, n) in g.op_counts() {
        println!("  {op:<24} {n}");
    }
    let infos = model.param_infos();
    let count = |role| {
        infos
            .iter()
            .filter(|p| p.role == role)
            .map(|p| p.shape.iter().product::<usize>())
            .sum::<usize>()
    };
    println!(
        "initializers: {} parameters ({} trainable elements, {} state, {} constant), {} host constants",
        infos.len(),
        count(ParamRole::Trainable),
        count(ParamRole::State),
        count(ParamRole::Constant),
        model.constant_infos().len()
    );
    for p in infos {
        println!(
            "  {:<48} {:<16} {}: {}",
            p.name,
            format!("{:?}", p.shape),
            p.role.name(),
            p.reason
        );
    }
    for c in model.constant_infos() {
        println!(
            "  {:<48} {:<16} constant: {}",
            c.name,
            format!("{:?}", c.shape),
            c.reason
        );
    }
    if !model.graph().ties.is_empty() {
        println!("initializer ties (tie_duplicate_initializers / untie_shared_constants):");
        for t in &model.graph().ties {
            println!("  {t}");
        }
    }
    if let Some(n) = stages {
        print_partition(&model, n)?;
    }
    if let Some(n) = tp {
        print_tensor_parallel(model, n)?;
    }
    Ok(())
}

/// The tensor-parallel split of `model` over `n` ranks: blocks, split weights (the
/// vocabulary split taking the first graph output as the logits a cross-entropy reads),
/// and the parameter elements each rank holds.
fn print_tensor_parallel(model: OnnxModel, n: usize) -> Result<(), OnnxError> {
    let shapes: std::collections::HashMap<String, Vec<usize>> = model
        .param_infos()
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect();
    let sample = model
        .graph()
        .inputs
        .iter()
        .map(|i| {
            let dims: Vec<usize> = i
                .dims
                .iter()
                .enumerate()
                .map(|(k, d)| match d {
                    Dim::Fixed(f) => *f,
                    Dim::Symbolic(_) => {
                        if k == 0 {
                            2
                        } else {
                            8
                        }
                    }
                })
                .collect();
            let len = dims.iter().product();
            let value = if dtype::is_float(i.elem_type) {
                burn_onnx_train::model::float_input(vec![0.0; len], &dims, &Device::flex())?
            } else if i.elem_type == dtype::BOOL {
                Value::Bool(ndarray::ArrayD::from_elem(ndarray::IxDyn(&dims), false))
            } else {
                burn_onnx_train::model::int_input(vec![0; len], &dims)?
            };
            Ok((i.name.clone(), value))
        })
        .collect::<Result<Vec<_>, OnnxError>>()?;
    let options = burn_onnx_train::parallel::tensor_parallel::SplitOptions {
        allow_replicated: true,
        vocab_parallel: true,
        vocab_head: model.graph().outputs.first().map(|o| o.name.clone()),
        sequence_parallel: false,
    };
    let (part, t) = burn_onnx_train::parallel::tensor_parallel::TensorParallel::apply(
        model, sample, 0, n, &options,
    )?;
    println!(
        "tensor parallel: {n} ranks, {} column-parallel projection(s)",
        t.blocks.len()
    );
    for b in &t.blocks {
        println!("  block from {b}");
    }
    if let Some(v) = &t.vocab {
        println!("  head of {} split along its {} classes", v.output, v.vocab);
    }
    for (name, split) in &t.params {
        println!(
            "  split {name} {:?}: axis {}, period {}{}",
            shapes[name],
            split.axis,
            split.period,
            if split.pad > 0 {
                format!(", padded by {}", split.pad)
            } else {
                String::new()
            }
        );
    }
    let whole: usize = shapes.values().map(|s| s.iter().product::<usize>()).sum();
    let local: usize = part
        .param_infos()
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    println!(
        "  parameter elements per rank: {local} of {whole} ({:.1}%)",
        100.0 * local as f64 / whole.max(1) as f64
    );
    Ok(())
}

/// The automatic pipeline cut of `model` into `n` stages, one line per stage.
fn print_partition(model: &OnnxModel, n: usize) -> Result<(), OnnxError> {
    let part = Partition::auto(model, n)?;
    let (elements, flops) = part
        .stages
        .iter()
        .fold((0, 0.0), |(e, f), s| (e + s.param_elements, f + s.flops));
    println!("pipeline: {n} stages");
    for s in &part.stages {
        println!(
            "  stage {}: nodes {}..{} ({}), {} parameters ({:.1}% of elements), {:.1}% of weighted work, receives {} value(s): {}",
            s.index,
            s.nodes.start,
            s.nodes.end,
            s.nodes.len(),
            s.params.len(),
            100.0 * s.param_elements as f64 / elements.max(1) as f64,
            100.0 * s.flops / flops.max(1.0),
            s.receives.len(),
            s.receives.join(", ")
        );
    }
    for p in &part.shared {
        println!(
            "  shared {} ({} elements) held by stages {:?}",
            p.name, p.elements, p.stages
        );
    }
    Ok(())
}

fn run(
    path: PathBuf,
    inputs: Vec<String>,
    output_dir: PathBuf,
    device: burn_onnx_train::train::DeviceSpec,
) -> Result<(), OnnxError> {
    let device = device.device(0)?;
    let model = OnnxModel::load(&path, &device)?;
    let mut feeds = Vec::new();
    for spec in inputs {
        let (name, file) = spec.split_once('=').ok_or_else(|| {
            OnnxError::field("--input", format!("expected NAME=FILE.npy, got '{spec}'"))
        })?;
        feeds.push((
            name.to_string(),
            read_input(name, Path::new(file), &device)?,
        ));
    }
    let out = model.forward(feeds, Mode::Eval)?;
    std::fs::create_dir_all(&output_dir).map_err(|e| OnnxError::io(&output_dir, e))?;
    for ((name, value), info) in out.outputs.iter().zip(&model.graph().outputs) {
        write_output(&output_dir, name, value, info.elem_type)?;
    }
    Ok(())
}

/// A `--input` value: a `.npy` tensor, or a directory of them (a sequence, its tensors in
/// file-name order).
fn read_input(name: &str, path: &Path, device: &Device) -> Result<Value, OnnxError> {
    let tensor = |file: &Path| {
        read_npy_value(file, device)
            .map_err(|e| OnnxError::field(format!("--input {name}"), e.to_string()))
    };
    if !path.is_dir() {
        return tensor(path);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| OnnxError::io(path, e))?
        .map(|e| e.map(|e| e.path()).map_err(|e| OnnxError::io(path, e)))
        .collect::<Result<_, _>>()?;
    files.retain(|f| f.extension().is_some_and(|x| x == "npy"));
    files.sort();
    Ok(Value::Sequence(
        files.iter().map(|f| tensor(f)).collect::<Result<_, _>>()?,
    ))
}

/// Graph output `name` in `dir`: `<name>.npy` for a tensor, the directory `<name>` of
/// `00000.npy`, `00001.npy`, ... for a sequence.
fn write_output(dir: &Path, name: &str, value: &Value, elem_type: i32) -> Result<(), OnnxError> {
    let Value::Sequence(items) = value else {
        let file = dir.join(format!("{}.npy", sanitize(name)));
        write_npy_as(&file, value, elem_type)?;
        println!("{name}: {:?} -> {}", value.shape(), file.display());
        return Ok(());
    };
    let seq = dir.join(sanitize(name));
    std::fs::create_dir_all(&seq).map_err(|e| OnnxError::io(&seq, e))?;
    for (k, item) in items.iter().enumerate() {
        write_npy_as(seq.join(format!("{k:05}.npy")), item, elem_type)?;
    }
    println!(
        "{name}: a sequence of {} tensor(s) -> {}/",
        items.len(),
        seq.display()
    );
    Ok(())
}

/// Output names may contain `/` or `:`; keep file names flat.
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Updates between checkpoints when the config file does not say (Hugging Face Trainer's
/// `save_steps`); the library's own default is 0 (never).
const CLI_CHECKPOINT_PERIOD: usize = 500;

/// `onnx-train train`'s defaults under the config file: the library's, checkpointing every
/// [`CLI_CHECKPOINT_PERIOD`] updates (and after the last).
fn cli_defaults() -> TrainingConfig {
    let mut c = TrainingConfig::default();
    c.checkpoint.checkpoint_period = CLI_CHECKPOINT_PERIOD;
    c
}

/// The training and (if any) test shards the config names, read as its loss needs them.
fn datasets(c: &TrainingConfig) -> Result<(Arc<dyn Dataset>, Option<Arc<dyn Dataset>>), OnnxError> {
    let load = |dir: &std::path::Path| -> Result<Arc<dyn Dataset>, OnnxError> {
        Ok(match c.model.loss {
            LossKind::LmCrossEntropy => token_dataset(c, dir)?,
            LossKind::CrossEntropy | LossKind::Mse => Arc::new(ImageDataset::load(dir)?),
            // The graph's own loss takes image shards when there are any, else tokens.
            LossKind::Graph if dir.join("images_0.npy").exists() => {
                Arc::new(ImageDataset::load(dir)?)
            }
            LossKind::Graph => token_dataset(c, dir)?,
        })
    };
    let train = load(&c.data.train_data_dir)?;
    let test = test_dir(c).map(load).transpose()?;
    Ok((train, test))
}

/// `onnx-train init`: the starter config for `model` written to `output` (never over an
/// existing file unless `force`).
fn init(model: &Path, output: &Path, force: bool) -> Result<(), OnnxError> {
    if output.exists() && !force {
        return Err(OnnxError::field(
            "--output",
            format!("{} exists (--force replaces it)", output.display()),
        ));
    }
    let loaded = OnnxModel::load(model, &Device::flex())?;
    write_atomic(output, starter_config(&loaded, model).as_bytes())?;
    println!(
        "wrote {} for {}: check its [model] and [data] sections, then\n  onnx-train train --config {} --check",
        output.display(),
        model.display(),
        output.display()
    );
    Ok(())
}

/// `c` checked, with the files it names present: any error here is the user's input
/// (exit 78, never restarted).
fn checked_config(c: TrainingConfig) -> Result<TrainingConfig, OnnxError> {
    c.check()?;
    c.check_files_named()?;
    Ok(c)
}

fn train(args: TrainArgs) -> Result<(), OnnxError> {
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

/// A size such as `80GiB`, `512MiB`, `2.5GB`, `100k` or plain bytes.
fn parse_size(text: &str) -> Result<u64, OnnxError> {
    let t = text.trim();
    let split = t
        .find(|ch: char| !(ch.is_ascii_digit() || ch == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        _ => f64::NAN,
    };
    match number.parse::<f64>() {
        Ok(n) if scale.is_finite() && n >= 0.0 => Ok((n * scale) as u64),
        _ => Err(OnnxError::field(
            "--memory-per-rank",
            format!("'{text}' is not a size (e.g. 80GiB, 512MiB, 2.5GB, or bytes)"),
        )),
    }
}

/// The layout `train --auto` runs for `c` on `world` processes: the fastest that fits
/// `limit` (the memory of a rank).
fn auto_layout(
    c: &TrainingConfig,
    world: usize,
    train: &Arc<dyn Dataset>,
    limit: Option<u64>,
) -> Result<Layout, OnnxError> {
    use burn_onnx_train::train::layout::auto_layout::{chosen, measure, rank_layouts, table};
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

fn plan(args: PlanArgs) -> Result<(), OnnxError> {
    use burn_onnx_train::train::layout::memory_plan::{human_bytes, lighter_layouts, plan_memory};
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
        use burn_onnx_train::train::layout::auto_layout::{chosen, measure, rank_layouts, table};
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

fn export(
    checkpoint: Option<PathBuf>,
    output: PathBuf,
    model: Option<PathBuf>,
    external_data: bool,
    safetensors: bool,
) -> Result<(), OnnxError> {
    let checkpoint = checkpoint.as_deref().map(find_checkpoint).transpose()?;
    // A damaged checkpoint is refused before anything is read from it.
    if let Some(c) = &checkpoint {
        check_files(c)?;
    }
    // The run that wrote the checkpoint says which model file and which initializer ties
    // its parameters follow.
    let run = checkpoint
        .as_ref()
        .map(|c| TrainingConfig::from_toml(&read_state(c)?.config_toml, c))
        .transpose()?;
    let model_path = match (model, &run) {
        (Some(m), _) => m,
        (None, Some(r)) => r.model.model_path.clone(),
        (None, None) => {
            return Err(OnnxError::field(
                "export",
                "needs --checkpoint, --model, or both",
            ));
        }
    };
    let ties = run
        .as_ref()
        .map(|c| c.model.tie_options())
        .unwrap_or_default();
    let mut model = OnnxModel::from_graph(Graph::load_with(&model_path, ties)?, &Device::flex())?;
    if let (Some(c), Some(run)) = (&checkpoint, &run) {
        model = read_params(c, model, None)
            .map_err(|e| from_other_model(e, c, &run.model.model_path, &model_path))?;
    }
    if safetensors {
        write_atomic(&output, &weights_file_bytes(&model)?)?;
    } else {
        let external_data = if external_data {
            ExternalDataPolicy::Always
        } else {
            ExternalDataPolicy::Auto
        };
        export_onnx_with(
            &model,
            &output,
            ExportOptions {
                external_data,
                ..Default::default()
            },
        )?;
    }
    let from = checkpoint.map_or_else(String::new, |c| format!(", checkpoint {}", c.display()));
    println!(
        "exported {} (model {}{from})",
        output.display(),
        model_path.display()
    );
    Ok(())
}

fn gpt2(output: PathBuf, config: Gpt2Config) -> Result<(), OnnxError> {
    write_gpt2(&config, &output)?;
    println!(
        "wrote {} ({} layers, width {}, vocab {})",
        output.display(),
        config.n_layer,
        config.n_embd,
        config.vocab_size
    );
    Ok(())
}

fn test_dir(c: &TrainingConfig) -> Option<&std::path::Path> {
    (!c.data.test_data_dir.as_os_str().is_empty()).then_some(c.data.test_data_dir.as_path())
}

/// Training allocates and frees tensors of tens of megabytes every step; glibc's malloc
/// returns each to the kernel and page-faults it back in (measured: half the step time of
/// the GPT-2 example). mimalloc keeps freed segments for reuse (see
/// `burn_onnx_train::util::allocator`).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    burn_onnx_train::util::allocator::keep_freed_memory();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect { model, stages, tp } => inspect(model, stages, tp),
        Command::Run {
            model,
            inputs,
            output_dir,
            device,
        } => run(model, inputs, output_dir, device),
        Command::Init {
            model,
            output,
            force,
        } => init(&model, &output, force),
        Command::Train(args) => train(args),
        Command::Plan(args) => plan(args),
        Command::Export {
            checkpoint,
            output,
            model,
            external_data,
            safetensors,
        } => export(checkpoint, output, model, external_data, safetensors),
        Command::Tokenize {
            tokenizer,
            output,
            shard_tokens,
            per_line,
            eos,
            files,
        } => tokenize(&TokenizeOptions {
            tokenizer,
            files,
            output,
            shard_tokens,
            per_line,
            eos,
        })
        .map(|s| {
            println!(
                "{} documents, {} tokens ({}) in {} shard(s) under {}",
                s.documents,
                s.tokens,
                s.dtype,
                s.shards.len(),
                s.shards
                    .first()
                    .and_then(|p| p.parent())
                    .map(|d| d.display().to_string())
                    .unwrap_or_default()
            )
        }),
        Command::Gpt2 {
            output,
            layers,
            heads,
            width,
            vocab,
            positions,
            seed,
            separate_qkv,
        } => gpt2(
            output,
            Gpt2Config {
                n_layer: layers,
                n_head: heads,
                n_embd: width,
                vocab_size: vocab,
                n_positions: positions,
                seed,
                separate_qkv,
                ..Default::default()
            },
        ),
        Command::Launch {
            np,
            max_restarts,
            min_np,
            mpirun,
            mpirun_args,
            command,
        } => std::env::current_exe()
            .map_err(|e| OnnxError::io("onnx-train", e))
            .and_then(|me| {
                let command = std::iter::once(me.into_os_string())
                    .chain(command.into_iter().map(Into::into))
                    .collect();
                let mpirun_args = mpirun_args.into_iter().map(Into::into).collect();
                ElasticJob {
                    mpirun: mpirun.into_os_string(),
                    ranks: np,
                    mpirun_args,
                    command,
                    max_restarts,
                    min_ranks: min_np.unwrap_or(np),
                }
                .run()
            })
            .map(|restarts| println!("the job succeeded after {restarts} restart(s)")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if burn_onnx_train::train::process::preemption::is_preemption(&e) => {
            // One write, so the lines of MPI ranks sharing the terminal do not interleave.
            let line = format!("{e}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            ExitCode::from(burn_onnx_train::train::process::preemption::PREEMPTED_EXIT_CODE)
        }
        Err(e) => {
            eprintln!("error: {e}");
            // 78 (EX_CONFIG) when the input is at fault (a run that failed before its first
            // update: not worth restarting), 1 otherwise.
            ExitCode::from(e.training_exit_code())
        }
    }
}
