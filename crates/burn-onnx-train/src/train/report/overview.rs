//! What a run will do, said before it does it: the banner rank 0 logs as training starts
//! and what `onnx-train train --check` prints after checking the config, the model and
//! the data (the model and its parameters, the data, the global batch, the updates in
//! total, the layout, where the outputs go).

use std::fmt;
use std::path::PathBuf;

use crate::model::OnnxModel;
use crate::train::config::{ParallelConfig, TrainingConfig};
use crate::train::data::Dataset;
use crate::train::layout::memory_counts::elements;
use crate::train::precision::Precision;

/// A run's plan in the terms a user sets it by.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOverview {
    /// The ONNX file.
    pub model_path: PathBuf,
    /// Trainable tensors and their elements.
    pub trainable: (usize, usize),
    /// Samples in the training set and what they are made of (`tokens`, `images`).
    pub samples: (usize, &'static str),
    /// Samples per update over all data-parallel ranks (micro-batch x replicas x
    /// accumulation).
    pub global_batch: usize,
    /// Tokens per update for token data (an upper bound for padded documents).
    pub tokens_per_update: Option<usize>,
    /// Optimizer updates in total (epochs resolved against the data).
    pub updates: usize,
    /// Micro-batches accumulated per update.
    pub accumulation: usize,
    /// Device, precision and the parallel layout, in words.
    pub layout: String,
    /// Where checkpoints, logs and the export go.
    pub output_dir: PathBuf,
}

impl RunOverview {
    /// The overview of `c` (epochs already resolved) training `model` (the whole model,
    /// before any parallel cut) on `train`.
    pub fn new(c: &TrainingConfig, model: &OnnxModel, train: &dyn Dataset) -> Self {
        let (_, trainable) = elements(model, None);
        let global_batch = c.data.batch_size
            * c.parallel.data_parallel_size
            * c.train.gradient_accumulation_steps.max(1);
        RunOverview {
            model_path: c.model.model_path.clone(),
            trainable: (trainable.len(), trainable.iter().sum()),
            samples: (train.len(), train.unit()),
            global_batch,
            tokens_per_update: (train.unit() == "tokens").then(|| global_batch * c.data.seq_len),
            updates: c.train.num_updates(),
            accumulation: c.train.gradient_accumulation_steps.max(1),
            layout: layout(&c.parallel, c.precision.dtype),
            output_dir: c.checkpoint.output_dir.clone(),
        }
    }
}

/// `cpu, f32, 4 ranks: dp 2 x tp 2 x pp 1, ZeRO 1` (one rank: `1 rank`): `p`'s layout
/// computing in `dtype`.
fn layout(p: &ParallelConfig, dtype: Precision) -> String {
    let ranks = match p.world_size() {
        1 => "1 rank".to_string(),
        n => format!(
            "{n} ranks: dp {} x tp {} x pp {}",
            p.data_parallel_size, p.horizontal_parallel_size, p.pipeline_parallel_size
        ),
    };
    let zero = match p.zero_stage {
        0 => String::new(),
        s => format!(", ZeRO {s}"),
    };
    let precision = format!("{dtype:?}").to_lowercase();
    format!("{}, {precision}, {ranks}{zero}", p.device)
}

/// `1.2M` style counts.
fn count(n: usize) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 10_000 => format!("{:.1}k", n as f64 / 1e3),
        n => n.to_string(),
    }
}

impl fmt::Display for RunOverview {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (tensors, elements) = self.trainable;
        writeln!(
            f,
            "model    {} ({} trainable parameters in {tensors} tensors)",
            self.model_path.display(),
            count(elements)
        )?;
        let (samples, unit) = self.samples;
        let what = if unit == "tokens" {
            "sequences of tokens"
        } else {
            unit
        };
        writeln!(f, "data     {} {what}", count(samples))?;
        let tokens = self
            .tokens_per_update
            .map_or_else(String::new, |t| format!(", {} tokens", count(t)));
        writeln!(
            f,
            "batch    {} samples per update{tokens}",
            self.global_batch
        )?;
        match self.accumulation {
            1 => writeln!(f, "updates  {}", self.updates)?,
            k => writeln!(
                f,
                "updates  {} ({} micro-steps, {k} accumulated per update)",
                self.updates,
                self.updates * k
            )?,
        }
        writeln!(f, "layout   {}", self.layout)?;
        write!(
            f,
            "output   {} (config.toml, checkpoints/, metrics.jsonl, tensorboard/)",
            self.output_dir.display()
        )
    }
}
