//! Train SqueezeNet 1.1 from an ONNX file on a generated image classification task.
//!
//! ```text
//! cargo run --release --example squeezenet
//! cargo run --release --example squeezenet -- --model my_squeezenet.onnx --steps 200
//! ```
//! The training flags are the same as the GPT-2 example's and `onnx-train train`'s.
//! The default model is the torchvision SqueezeNet 1.1 export with a dynamic batch shipped
//! in the test data (seeded random weights). The data set is generated deterministically:
//! ten classes of oriented colour stripes under noise, 224x224 RGB, produced per sample
//! index so nothing is stored. Labels use the first ten of the model's 1000 outputs.

#[path = "../common/mod.rs"]
mod common;

use std::f32::consts::PI;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn_onnx_train::frontend::flags::TrainFlags;
use burn_onnx_train::model::loss::LossKind;
use burn_onnx_train::train::TrainingConfig;
use burn_onnx_train::train::config::{LrConfig, OptimizerConfig, OptimizerKind, ScheduleKind};
use burn_onnx_train::train::data::{Batch, Dataset, Target, TargetKind};
use burn_onnx_train::train::process::launch::launch_elastic;
use burn_onnx_train::value::host_tensor::HostTensor;
use burn_onnx_train::{OnnxError, Result};
use clap::Parser;
use ndarray::{ArrayD, IxDyn};

#[derive(Parser, Debug)]
#[command(about = "Train SqueezeNet 1.1 from an ONNX file on generated images, on the CPU")]
struct Args {
    #[command(flatten)]
    run: TrainFlags,
    /// Training images generated.
    #[arg(long, default_value_t = 512)]
    train_images: usize,
    /// Measure throughput only (no evaluation or checkpoints).
    #[arg(long)]
    bench: bool,
}

const CLASSES: usize = 10;
const SIDE: usize = 224;

/// Oriented stripes: class `c` has angle `c * 18` degrees and a class colour; each sample
/// gets its own phase and noise.
struct StripeImages {
    len: usize,
    seed: u64,
}

impl StripeImages {
    fn image(&self, index: usize, out: &mut [f32]) -> i64 {
        let mut x = (index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ self.seed;
        let mut rand = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32
        };
        let class = index % CLASSES;
        let angle = class as f32 * PI / CLASSES as f32;
        let (dx, dy) = (angle.cos(), angle.sin());
        let phase = rand() * 2.0 * PI;
        let colour = [
            (class % 3) as f32 * 0.5 - 0.5,
            ((class / 3) % 3) as f32 * 0.5 - 0.5,
            (class % 2) as f32 - 0.5,
        ];
        for c in 0..3 {
            for i in 0..SIDE {
                for j in 0..SIDE {
                    let s = ((i as f32 * dy + j as f32 * dx) * 0.25 + phase).sin();
                    out[(c * SIDE + i) * SIDE + j] = s + colour[c] + (rand() - 0.5);
                }
            }
        }
        class as i64
    }
}

impl Dataset for StripeImages {
    fn len(&self) -> usize {
        self.len
    }

    fn batch(&self, indices: &[usize]) -> Result<Batch> {
        let per = 3 * SIDE * SIDE;
        let mut pixels = vec![0f32; indices.len() * per];
        let labels: Vec<i64> = indices
            .iter()
            .enumerate()
            .map(|(k, &i)| self.image(i, &mut pixels[k * per..(k + 1) * per]))
            .collect();
        let err = |e: ndarray::ShapeError| OnnxError::field("images", e.to_string());
        Ok(Batch {
            input: HostTensor::Float(
                ArrayD::from_shape_vec(IxDyn(&[indices.len(), 3, SIDE, SIDE]), pixels)
                    .map_err(err)?,
            ),
            target: Target::Classes(
                ArrayD::from_shape_vec(IxDyn(&[indices.len()]), labels).map_err(err)?,
            ),
            items: indices.len(),
        })
    }

    fn unit(&self) -> &'static str {
        "images"
    }

    fn target_kind(&self) -> TargetKind {
        TargetKind::Classes
    }
}

fn default_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("crates/burn-onnx-train/tests/data/refkit/models/squeezenet1_1_dynbatch.onnx")
}

fn main() -> std::process::ExitCode {
    common::main_with(run)
}

/// This example's defaults: the refkit SqueezeNet, 120 updates of 8 images, AdamW at 1e-3
/// with 10% warm-up and cosine decay, evaluation and checkpoints every 20 updates.
fn defaults() -> TrainingConfig {
    let mut c = TrainingConfig::default();
    c.model.model_path = default_model();
    c.checkpoint.output_dir = "runs/squeezenet".into();
    c.model.input_name = "input".into();
    c.model.output_name = "logits".into();
    c.model.loss = LossKind::CrossEntropy;
    c.data.batch_size = 8;
    c.eval.eval_batch_size = 8;
    c.train.num_train_steps = 120;
    c.logging.display_loss_steps = 5;
    c.eval.evaluation_period = 20;
    c.eval.eval_batches = 4;
    c.checkpoint.checkpoint_period = 20;
    c.optimizer = OptimizerConfig {
        kind: OptimizerKind::Adamw,
        weight_decay: 1e-4,
        ..Default::default()
    };
    c.lr = LrConfig {
        initial_lr: 1e-3,
        warmup_ratio: 0.1,
        mode: ScheduleKind::Cosine,
        ..Default::default()
    };
    c.logging.histogram_weights = vec!["features.0.weight".into()];
    c
}

fn run(args: Args) -> Result<()> {
    let mut config = args.run.apply(defaults())?;
    config.checkpoint.output_dir = common::output_dir(&config.checkpoint.output_dir, args.bench)?;
    if args.bench {
        (
            config.eval.evaluation_period,
            config.checkpoint.checkpoint_period,
            config.logging.display_loss_steps,
            config.logging.progress,
        ) = (0, 0, config.train.num_updates(), false);
        config.logging.histogram_weights.clear();
    }
    if args.run.printed(&config)? {
        return Ok(());
    }
    let model_path = config.model.model_path.clone();
    let train: Arc<dyn Dataset> = Arc::new(StripeImages {
        len: args.train_images,
        seed: 1,
    });
    let test: Arc<dyn Dataset> = Arc::new(StripeImages { len: 64, seed: 2 });
    let summary = launch_elastic(
        config,
        train,
        (!args.bench).then_some(test),
        args.run.max_restarts,
    )?;
    let Some(perf) = &summary.perf else {
        return Ok(());
    }; // not rank 0
    println!("{summary}");
    println!("| model | ranks | batch per replica | updates measured | ms/update | images/s |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {} | {} | {:.1} | {:.1} |",
        model_path.display(),
        perf.world_size,
        perf.batch_size,
        perf.updates_measured,
        perf.avg_update_ms,
        perf.throughput_per_sec
    );
    Ok(())
}
