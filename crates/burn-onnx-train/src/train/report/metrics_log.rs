//! `<output_dir>/metrics.jsonl`: one JSON object per logged update and per evaluation, for
//! scripts and for the importers of W&B or MLflow (TensorBoard's event files need
//! TensorFlow's protobufs to read). A resumed run keeps the lines up to its checkpoint and
//! appends after them, so a step is never listed twice.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde_json::{Value as Json, json};

use crate::error::{OnnxError, Result};
use crate::train::evaluate::EvalMetrics;
use crate::util::atomic_file::write_atomic;

/// The file's name in the output directory.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// An open metrics file.
pub struct MetricsLog {
    path: PathBuf,
    file: File,
}

impl MetricsLog {
    /// Open `<dir>/metrics.jsonl` for a run starting after update `start_step`: lines of
    /// later steps (a run that went on past its last checkpoint) are dropped.
    pub fn open(dir: &Path, start_step: usize) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| OnnxError::io(dir, e))?;
        let path = dir.join(METRICS_FILE);
        if let Ok(old) = File::open(&path) {
            let kept: String = BufReader::new(old)
                .lines()
                .map_while(std::result::Result::ok)
                .filter(|l| {
                    serde_json::from_str::<Json>(l)
                        .ok()
                        .and_then(|j| j["step"].as_u64())
                        .is_some_and(|s| s as usize <= start_step)
                })
                .map(|l| l + "\n")
                .collect();
            write_atomic(&path, kept.as_bytes())?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| OnnxError::io(&path, e))?;
        Ok(MetricsLog { path, file })
    }

    fn write(&mut self, line: Json) -> Result<()> {
        writeln!(self.file, "{line}").map_err(|e| OnnxError::io(&self.path, e))
    }

    /// A logged update.
    pub fn update(
        &mut self,
        step: usize,
        loss: f64,
        lr: f64,
        grad_norm: f32,
        loss_scale: Option<f64>,
        (rate, unit): (f64, &str),
    ) -> Result<()> {
        self.write(json!({
            "kind": "train",
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "loss_scale": loss_scale,
            "rate": rate,
            "unit": unit,
            "time": unix_seconds(),
        }))
    }

    /// An evaluation.
    pub fn eval(&mut self, m: &EvalMetrics) -> Result<()> {
        self.write(json!({
            "kind": "eval",
            "step": m.step,
            "loss": m.loss,
            "perplexity": m.perplexity,
            "accuracy": m.accuracy,
            "time": unix_seconds(),
        }))
    }
}

fn unix_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
