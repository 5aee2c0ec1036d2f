//! What `train` and `plan` share: the defaults under the config file, the config checked,
//! the data sets it names read, and `--memory-per-rank`'s sizes.

use std::sync::Arc;

use crate::error::OnnxError;
use crate::model::loss::LossKind;
use crate::train::TrainingConfig;
use crate::train::data::documents::token_dataset;
use crate::train::data::{Dataset, ImageDataset};

/// Updates between checkpoints when the config file does not say (Hugging Face Trainer's
/// `save_steps`); the library's own default is 0 (never).
const CLI_CHECKPOINT_PERIOD: usize = 500;

/// `onnx-train train`'s defaults under the config file: the library's, checkpointing every
/// [`CLI_CHECKPOINT_PERIOD`] updates (and after the last).
pub(super) fn cli_defaults() -> TrainingConfig {
    let mut c = TrainingConfig::default();
    c.checkpoint.checkpoint_period = CLI_CHECKPOINT_PERIOD;
    c
}

/// The training and (if any) test shards the config names, read as its loss needs them.
pub(super) fn datasets(
    c: &TrainingConfig,
) -> Result<(Arc<dyn Dataset>, Option<Arc<dyn Dataset>>), OnnxError> {
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

/// `c` checked, with the files it names present: any error here is the user's input
/// (exit 78, never restarted).
pub(super) fn checked_config(c: TrainingConfig) -> Result<TrainingConfig, OnnxError> {
    c.check()?;
    c.check_files_named()?;
    Ok(c)
}

/// A size such as `80GiB`, `512MiB`, `2.5GB`, `100k` or plain bytes.
pub(super) fn parse_size(text: &str) -> Result<u64, OnnxError> {
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

/// The test shards' directory, when the config names one.
fn test_dir(c: &TrainingConfig) -> Option<&std::path::Path> {
    (!c.data.test_data_dir.as_os_str().is_empty()).then_some(c.data.test_data_dir.as_path())
}
