//! Train GPT-2 on real English text on the CPU.
//!
//! ```text
//! cargo run --release --example gpt2                      # defaults: a 2-layer GPT-2 built
//!                                                         # here, KJV Genesis+Exodus text
//! cargo run --release --example gpt2 -- --model my.onnx   # your own exported GPT-2
//! cargo run --release --example gpt2 -- --bench           # throughput table only
//! cargo run --release --example gpt2 -- --config run.toml --steps 50   # file, then flags
//! ```
//! Flags override the config file only when given; the file overrides this example's
//! defaults only in the fields it sets. `--steps` counts optimizer updates, as in
//! `onnx-train train`.
//! The text is tokenized with the GPT-2 BPE (tiktoken `r50k_base`), split 90/10 into
//! training and evaluation token shards (`<output>/data/{train,test}/tokens.npy`), and fed
//! to the [`TrainingRunner`]: AdamW with warm-up and cosine decay, global-norm clipping,
//! periodic evaluation, rotating checkpoints, TensorBoard logs, and at the end
//! `<output>/<model>_trained.onnx` and `<output>/perf.json`.

#[path = "../common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};

use burn_onnx_train::frontend::builders::gpt2::{Gpt2Config, write_gpt2};
use burn_onnx_train::frontend::flags::TrainFlags;
use burn_onnx_train::model::loss::LossKind;
use burn_onnx_train::train::TrainingConfig;
use burn_onnx_train::train::config::{LrConfig, ScheduleKind};
use burn_onnx_train::train::data::documents::token_dataset;
use burn_onnx_train::train::data::npy::write_npy;
use burn_onnx_train::train::process::launch::launch_elastic;
use burn_onnx_train::{OnnxError, Value};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Train GPT-2 from an ONNX file on English text, on the CPU")]
struct Args {
    #[command(flatten)]
    run: TrainFlags,
    /// Training text (UTF-8); default: the bundled KJV Genesis+Exodus.
    #[arg(long)]
    text: Option<PathBuf>,
    /// Tokens per sequence (`seq_len`; default 64).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Built model (when no --model): layers.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Built model: attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Built model: width.
    #[arg(long, default_value_t = 128)]
    width: usize,
    /// Measure throughput over a short run and print a table instead of training fully.
    #[arg(long)]
    bench: bool,
}

/// This example's defaults: 400 updates of 8 x 64 tokens, AdamW at 1e-3 with 5% warm-up
/// and cosine decay, evaluation and checkpoints every 100 updates.
fn defaults() -> TrainingConfig {
    let mut c = TrainingConfig::default();
    c.checkpoint.output_dir = "runs/gpt2".into();
    c.model.input_name = "input_ids".into();
    c.model.output_name = "logits".into();
    c.model.loss = LossKind::LmCrossEntropy;
    c.data.batch_size = 8;
    c.eval.eval_batch_size = 8;
    c.data.seq_len = 64;
    c.train.num_train_steps = 400;
    c.logging.display_loss_steps = 10;
    c.eval.evaluation_period = 100;
    c.checkpoint.checkpoint_period = 100;
    c.lr = LrConfig {
        initial_lr: 1e-3,
        warmup_ratio: 0.05,
        mode: ScheduleKind::Cosine,
        ..Default::default()
    };
    c.logging.histogram_weights = vec!["transformer.h.0.attn.c_attn.weight".into()];
    c
}

fn default_text() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/text/kjv_genesis_exodus.txt")
}

fn tokenize(path: &Path) -> Result<Vec<i64>, OnnxError> {
    let text = std::fs::read_to_string(path).map_err(|e| OnnxError::io(path, e))?;
    let bpe = tiktoken_rs::r50k_base().map_err(|e| OnnxError::field("tokenizer", e.to_string()))?;
    Ok(bpe
        .encode_ordinary(&text)
        .into_iter()
        .map(i64::from)
        .collect())
}

fn write_shard(dir: &Path, tokens: &[i64]) -> Result<(), OnnxError> {
    std::fs::create_dir_all(dir).map_err(|e| OnnxError::io(dir, e))?;
    let a = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&[tokens.len()]), tokens.to_vec())
        .map_err(|e| OnnxError::field("tokens", e.to_string()))?;
    write_npy(dir.join("tokens.npy"), &Value::Int(a))
}

fn config(args: &Args) -> Result<TrainingConfig, OnnxError> {
    let mut c = args.run.apply(defaults())?;
    c.data.seq_len = args.seq_len.unwrap_or(c.data.seq_len);
    c.checkpoint.output_dir = common::output_dir(&c.checkpoint.output_dir, args.bench)?;
    c.data.train_data_dir = c.checkpoint.output_dir.join("data/train");
    c.data.test_data_dir = c.checkpoint.output_dir.join("data/test");
    if args.bench {
        (
            c.eval.evaluation_period,
            c.checkpoint.checkpoint_period,
            c.logging.display_loss_steps,
            c.logging.progress,
        ) = (0, 0, c.train.num_updates(), false);
        c.logging.histogram_weights.clear();
    }
    Ok(c)
}

fn main() -> std::process::ExitCode {
    common::main_with(run)
}

fn run(args: Args) -> Result<(), OnnxError> {
    let mut config = config(&args)?;
    if args.run.printed(&config)? {
        return Ok(());
    }
    let tokens = tokenize(args.text.as_deref().unwrap_or(&default_text()))?;
    let split = tokens.len() * 9 / 10;
    write_shard(&config.data.train_data_dir, &tokens[..split])?;
    write_shard(&config.data.test_data_dir, &tokens[split..])?;
    if config.model.model_path.as_os_str().is_empty() {
        let c = Gpt2Config {
            n_layer: args.layers,
            n_head: args.heads,
            n_embd: args.width,
            n_positions: config.data.seq_len.max(64),
            ..Default::default()
        };
        config.model.model_path = config.checkpoint.output_dir.join("gpt2.onnx");
        write_gpt2(&c, &config.model.model_path)?;
        tracing::info!(layers = c.n_layer, heads = c.n_head, width = c.n_embd, vocab = c.vocab_size, path = %config.model.model_path.display(), "built GPT-2");
    }
    let train = token_dataset(&config, &config.data.train_data_dir)?;
    let test = token_dataset(&config, &config.data.test_data_dir)?;
    tracing::info!(
        train_tokens = split,
        test_tokens = tokens.len() - split,
        "tokenized with the GPT-2 BPE"
    );
    let model_path = config.model.model_path.clone();
    let summary = launch_elastic(config, train, Some(test), args.run.max_restarts)?;
    let Some(perf) = &summary.perf else {
        return Ok(());
    }; // not rank 0
    println!("{summary}");
    if summary.losses.is_empty() {
        return Ok(());
    }
    println!(
        "| model | ranks | batch x seq per replica | updates measured | ms/update | tokens/s |"
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {} x {} | {} | {:.1} | {:.0} |",
        model_path.display(),
        perf.world_size,
        perf.batch_size,
        perf.seq_len,
        perf.updates_measured,
        perf.avg_update_ms,
        perf.throughput_per_sec
    );
    Ok(())
}
