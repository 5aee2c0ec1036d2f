//! Rotating, crash-safe checkpoints.
//!
//! A checkpoint is a directory `ckpt-<update step, 9 digits>/` holding
//! * `model.safetensors`: every parameter (trained weights and state such as batch-norm
//!   running statistics) under its ONNX initializer name, f32, ONNX shape; a pipeline run
//!   writes one `model-stage-<k>.safetensors` per stage instead (each parameter once, in
//!   the file of the first stage holding it), and a load reads them all, so a checkpoint
//!   reloads onto any stage count; with tensor parallelism every tp rank writes its part
//!   of the split weights into `model[-stage-<k>]-tp-<r>.safetensors` and `state.json`
//!   records how each is split, so a load reassembles them and cuts them again for any tp
//!   size (or none: `onnx-train export`; the optimizer records regroup the same way,
//!   `tp_resume`); a ZeRO-3 run writes no whole parameters: every data-parallel rank
//!   writes its chunks into `<that file>-zero-<rank>.safetensors` (`zero3_shards`), joined
//!   again when the checkpoint is read;
//! * the update strategy's optimizer state: `optimizer.safetensors` (Burn's optimizer
//!   record as safetensors, keyed by parameter ids derived from the ONNX names, step counts
//!   in the metadata; earlier checkpoints' burn-pack `optimizer.bpk` still loads) for
//!   replicated runs, or one
//!   `zero-<rank>.safetensors` shard per rank plus `zero.json` for ZeRO runs; in a pipeline run,
//!   each stage's under `stage-<k>/`, and each tp rank's under `tp-<r>/` (below the stage);
//! * `model.safetensors.index.json` with stage part files, `model-tp-<r>.safetensors.index.json`
//!   per tensor-parallel rank (`checkpoint_index`): Hugging Face's index of sharded weights;
//! * `state.json`: update and micro-step counters, seed (data order and dropout are pure
//!   functions of seed and step, so this is the whole RNG state), loss-scaler state, the
//!   world size, the ZeRO stage, and the run's config;
//! * `manifest.json`, written last: the size and SHA-256 of every other file
//!   (`checkpoint_manifest`), checked before a resume or an export reads them.
//!
//! Every rank takes part: rank 0 makes `.ckpt-<step>.tmp/`, each rank writes its files
//! (its part of the model, its optimizer state) into it (fsynced), then rank 0 writes the state, renames the directory into
//! place and fsyncs the parent: a run killed at any point leaves the previous checkpoints
//! intact, and a leftover temporary directory is ignored and removed.

pub mod index;
pub mod manifest;
pub mod params;
pub(crate) mod resume;
pub mod tp_resume;
pub mod zero3_shards;

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use burn_ort_dist::storage::record_safetensors::{Head, write_le_f32s, write_safetensors_with};
use burn_ort_dist::{Communicator, DistError, StateFile};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};

use self::index::model_indices;
use self::manifest::{FileSum, HashingWriter, MANIFEST_FILE, merged_manifest, write_rank_sums};
use super::precision::ScalerState;
use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::parallel::tensor_parallel::AxisSplit;

/// Counters and metadata saved with a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    /// Optimizer updates done.
    pub update_step: usize,
    /// Micro-steps (forward+backward) done.
    pub micro_step: usize,
    /// The run's seed.
    pub seed: u64,
    /// Dynamic loss scale and its growth counter (`None` when the scale is fixed).
    pub loss_scale: Option<ScalerState>,
    /// World size of the run that wrote it.
    pub world_size: usize,
    /// The rank that wrote the model and this state (rank 0; the replicas are identical).
    pub written_by_rank: usize,
    /// ZeRO stage of the run (0: replicated optimizer record).
    #[serde(default)]
    pub zero_stage: usize,
    /// Pipeline stages of the run (optimizer state is kept per stage).
    #[serde(default = "one")]
    pub pipeline_stages: usize,
    /// Tensor-parallel ranks of the run (optimizer state is kept per tp rank).
    #[serde(default = "one")]
    pub tensor_parallel: usize,
    /// How the tensor-parallel parts of split weights fit together, by ONNX name.
    #[serde(default)]
    pub tensor_parallel_splits: BTreeMap<String, AxisSplit>,
    /// The config of that run, as TOML.
    pub config_toml: String,
}

fn one() -> usize {
    1
}

pub(super) const MODEL_FILE: &str = "model.safetensors";

/// The file holding the model parameters a rank writes: `model.safetensors`, or
/// `model-stage-<k>.safetensors` for pipeline stage `k`, with `-tp-<r>` for tensor-parallel
/// rank `r`.
pub fn model_file(stage: Option<usize>, tp_rank: Option<usize>) -> String {
    match (stage, tp_rank) {
        (None, None) => MODEL_FILE.into(),
        (Some(k), None) => format!("model-stage-{k}.safetensors"),
        (None, Some(r)) => format!("model-tp-{r}.safetensors"),
        (Some(k), Some(r)) => format!("model-stage-{k}-tp-{r}.safetensors"),
    }
}

/// Where a rank keeps its optimizer state inside a checkpoint: `stage-<k>/` in a pipeline,
/// `tp-<r>` below that for tensor-parallel rank `r` (`None`: the checkpoint itself).
pub fn state_dir(stage: Option<usize>, tp_rank: Option<usize>) -> Option<String> {
    match (stage, tp_rank) {
        (None, None) => None,
        (Some(k), None) => Some(format!("stage-{k}")),
        (None, Some(r)) => Some(format!("tp-{r}")),
        (Some(k), Some(r)) => Some(format!("stage-{k}/tp-{r}")),
    }
}

/// The optimizer-state directories of the checkpoint at `path` for tensor-parallel rank
/// `tp_rank`, written by a run of `stages` pipeline stages: one per stage.
pub fn state_dirs(path: &Path, stages: usize, tp_rank: Option<usize>) -> Vec<PathBuf> {
    match stages {
        0 | 1 => {
            vec![state_dir(None, tp_rank).map_or_else(|| path.to_path_buf(), |d| path.join(d))]
        }
        n => (0..n)
            .filter_map(|k| state_dir(Some(k), tp_rank))
            .map(|d| path.join(d))
            .collect(),
    }
}

const STATE_FILE: &str = "state.json";

fn io(path: &Path) -> impl Fn(std::io::Error) -> OnnxError + '_ {
    move |e| OnnxError::io(path, e)
}

/// Write `file` to `path` through a buffer, hashing it on the way (its manifest entry),
/// and fsync it.
fn write_streamed(path: &Path, file: StateFile<'_>) -> Result<FileSum> {
    let mut w = HashingWriter::new(std::io::BufWriter::new(
        File::create(path).map_err(io(path))?,
    ));
    file.write_to(&mut w)
        .map_err(|e| OnnxError::field(path.display().to_string(), e.to_string()))?;
    let (inner, sum) = w.finish();
    let f = inner.into_inner().map_err(|e| io(path)(e.into_error()))?;
    f.sync_all().map_err(io(path))?;
    Ok(sum)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

/// The directory name of the checkpoint after `step` updates.
pub fn checkpoint_name(step: usize) -> String {
    format!("ckpt-{step:09}")
}

/// Complete checkpoints in `dir`, oldest first.
pub fn list_checkpoints(dir: &Path) -> Vec<(usize, PathBuf)> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| {
            let path = e.ok()?.path();
            let step = path
                .file_name()?
                .to_str()?
                .strip_prefix("ckpt-")?
                .parse()
                .ok()?;
            path.join(STATE_FILE).is_file().then_some((step, path))
        })
        .collect();
    out.sort();
    out
}

/// The checkpoint `path` names, as a user names one: a checkpoint directory itself, a
/// directory of checkpoints (its newest), or a run's output directory (the newest in its
/// `checkpoints/`), as Hugging Face's `resume_from_checkpoint` takes a run directory.
pub fn find_checkpoint(path: &Path) -> crate::error::Result<PathBuf> {
    if path.join(STATE_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    let newest = |dir: &Path| list_checkpoints(dir).pop().map(|(_, p)| p);
    newest(path)
        .or_else(|| newest(&path.join("checkpoints")))
        .ok_or_else(|| {
            crate::error::OnnxError::field(
                "--checkpoint",
                format!(
                    "{}: neither a checkpoint (no {STATE_FILE}) nor a directory holding one (ckpt-NNNNNNNNN/, directly or under checkpoints/)",
                    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()).display()
                ),
            )
        })
}

fn state_err(message: String) -> DistError {
    DistError::State { message }
}

/// The model file of the parameters `keep` selects by ONNX name, written streaming: one
/// parameter's bytes at a time.
pub fn model_file_writer<'a>(
    name: String,
    model: &'a OnnxModel,
    keep: impl Fn(&str) -> bool + 'a,
) -> StateFile<'a> {
    StateFile::stream(name, move |w| {
        write_params(model, keep, BTreeMap::new(), w).map_err(|e| state_err(e.to_string()))
    })
}

/// Every parameter as one safetensors file a Hugging Face loader takes (`format: pt` in
/// its metadata): ONNX initializer names, logical shapes, f32.
pub fn weights_file_bytes(model: &OnnxModel) -> Result<Vec<u8>> {
    let metadata = [("format".to_string(), "pt".to_string())].into();
    let mut out = Vec::new();
    write_params(model, |_| true, metadata, &mut out)?;
    Ok(out)
}

/// Write the parameters `keep` selects as a safetensors file to `w`, each read from the
/// device only when its turn comes and converted to bytes a chunk at a time.
fn write_params(
    model: &OnnxModel,
    keep: impl Fn(&str) -> bool,
    metadata: BTreeMap<String, String>,
    w: &mut dyn Write,
) -> Result<()> {
    let kept: Vec<(usize, &crate::model::ParamInfo)> = model
        .param_infos()
        .iter()
        .enumerate()
        .filter(|(_, info)| keep(&info.name))
        .collect();
    let heads: Vec<Head> = kept
        .iter()
        .map(|(_, info)| Head {
            name: info.name.clone(),
            dtype: Dtype::F32,
            shape: info.shape.clone(),
            bytes: 4 * info.shape.iter().product::<usize>(),
        })
        .collect();
    write_safetensors_with(w, &heads, &metadata, |k, w| {
        let (i, info) = kept[k];
        let a = model
            .param_value(i)
            .ok_or_else(|| state_err(format!("{}: missing parameter", info.name)))?
            .to_array()
            .map_err(|e| state_err(format!("{}: {}", info.name, e.0)))?;
        if a.len() * 4 != heads[k].bytes {
            return Err(state_err(format!(
                "{}: {} bytes, its shape says {}",
                info.name,
                a.len() * 4,
                heads[k].bytes
            )));
        }
        let a = a.as_standard_layout();
        write_le_f32s(w, a.as_slice().expect("a standard-layout array"))
            .map_err(|e| state_err(format!("{}: {e}", info.name)))
    })
    .map_err(|e| OnnxError::field("checkpoint", e.to_string()))
}

/// Write a checkpoint atomically into `dir`, then delete all but the newest `keep`. A
/// collective: every rank calls it with the `files` it owns (model parameters, optimizer
/// state; names may hold one directory level).
pub fn save_checkpoint(
    dir: &Path,
    files: Vec<StateFile<'_>>,
    state: &CheckpointState,
    keep: usize,
    comm: &dyn Communicator,
) -> Result<PathBuf> {
    let name = checkpoint_name(state.update_step);
    let tmp = dir.join(format!(".{name}.tmp"));
    let root = comm.rank() == 0;
    if root {
        fs::create_dir_all(dir).map_err(io(dir))?;
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir(&tmp).map_err(io(&tmp))?;
    }
    comm.barrier()?;
    let mut sums = BTreeMap::new();
    for file in files {
        let path = tmp.join(&file.name);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(io(parent))?;
        }
        let name = file.name.clone();
        sums.insert(name, write_streamed(&path, file)?);
    }
    write_rank_sums(&tmp, comm.rank(), sums)?;
    comm.barrier()?;
    let target = dir.join(&name);
    if root {
        let json = serde_json::to_vec_pretty(state)
            .map_err(|e| OnnxError::field("checkpoint state", e.to_string()))?;
        write_synced(&tmp.join(STATE_FILE), &json)?;
        let mut own = BTreeMap::from([(STATE_FILE.to_string(), FileSum::of(&json))]);
        for (file, index) in model_indices(&tmp, &state.tensor_parallel_splits)? {
            write_synced(&tmp.join(&file), &index)?;
            own.insert(file, FileSum::of(&index));
        }
        write_synced(&tmp.join(MANIFEST_FILE), &merged_manifest(&tmp, own)?)?;
        File::open(&tmp)
            .and_then(|d| d.sync_all())
            .map_err(io(&tmp))?;
        if target.exists() {
            fs::remove_dir_all(&target).map_err(io(&target))?;
        }
        fs::rename(&tmp, &target).map_err(io(&target))?;
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        let all = list_checkpoints(dir);
        for (_, old) in all.iter().take(all.len().saturating_sub(keep)) {
            fs::remove_dir_all(old).map_err(io(old))?;
        }
    }
    comm.barrier()?;
    Ok(target)
}

/// Remove temporary directories left by writes that were killed.
pub fn remove_stale_temporaries(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            let n = e.file_name();
            if n.to_str()
                .is_some_and(|n| n.starts_with(".ckpt-") && n.contains(".tmp"))
            {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Read a checkpoint's counters and metadata.
pub fn read_state(path: &Path) -> Result<CheckpointState> {
    let state_path = path.join(STATE_FILE);
    let text = fs::read(&state_path).map_err(io(&state_path))?;
    serde_json::from_slice(&text).map_err(|e| OnnxError::Decode {
        path: state_path.clone(),
        what: "checkpoint state (JSON)",
        message: e.to_string(),
    })
}
