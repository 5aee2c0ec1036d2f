//! The Hugging Face index of a checkpoint whose parameters are split over part files, so
//! `transformers`-style loaders and any script find a weight without opening every part:
//! each parameter name mapped to the file that holds it, with the total byte size.
//! Pipeline stage parts (`model-stage-<k>.safetensors`) get `model.safetensors.index.json`.
//! Tensor-parallel parts hold pieces of one weight in several files, which one index cannot
//! say: there each tp rank `r` gets `model-tp-<r>.safetensors.index.json` over its own
//! files (Megatron's one-directory-per-model-parallel-rank view), whose metadata names the
//! rank, the tp size and how each split weight is cut (`tensor_parallel_splits`: axis,
//! period and any vocabulary padding, as `state.json` records them).

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::Path;

use crate::error::{OnnxError, Result};
use crate::parallel::tensor_parallel::AxisSplit;

/// The index's file name.
const INDEX_FILE: &str = "model.safetensors.index.json";

/// The tensor names and data bytes of the safetensors file at `path`, from its header.
fn tensors_of(path: &Path) -> Result<Vec<(String, u64)>> {
    let bad = |m: String| OnnxError::Decode {
        path: path.to_path_buf(),
        what: "safetensors header",
        message: m,
    };
    let mut f = fs::File::open(path).map_err(|e| OnnxError::io(path, e))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|e| OnnxError::io(path, e))?;
    let mut header = vec![0u8; u64::from_le_bytes(len) as usize];
    f.read_exact(&mut header)
        .map_err(|e| OnnxError::io(path, e))?;
    let header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(e.to_string()))?;
    header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, t)| {
            let offsets = t["data_offsets"]
                .as_array()
                .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
                .ok_or_else(|| bad(format!("{name}: no data_offsets")))?;
            Ok((name, offsets.1 - offsets.0))
        })
        .collect()
}

/// The tensor-parallel rank of a model file name (`None`: whole weights).
pub fn file_tp_rank(name: &str) -> Option<usize> {
    name.strip_suffix(".safetensors")?
        .rsplit_once("-tp-")?
        .1
        .parse()
        .ok()
}

/// The names of the model files in checkpoint directory `dir` (`model*.safetensors`: whole,
/// stage, tensor-parallel and ZeRO-3 parts), sorted.
pub fn model_files(dir: &Path) -> Result<Vec<String>> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map_err(|e| OnnxError::io(dir, e))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("model") && n.ends_with(".safetensors"))
        .collect();
    names.sort();
    Ok(names)
}

/// The index files of the model part files in `dir` (see the module doc): none when the
/// parameters are in one file; `splits` says how tensor-parallel parts cut each weight.
pub fn model_indices(
    dir: &Path,
    splits: &BTreeMap<String, AxisSplit>,
) -> Result<Vec<(String, Vec<u8>)>> {
    let parts: Vec<String> = model_files(dir)?
        .into_iter()
        // ZeRO-3 chunks are no weights a loader can take.
        .filter(|n| !n.contains("-zero-"))
        .collect();
    let mut by_rank: BTreeMap<Option<usize>, Vec<String>> = BTreeMap::new();
    for part in parts {
        by_rank.entry(file_tp_rank(&part)).or_default().push(part);
    }
    let tp_size = by_rank.keys().filter(|r| r.is_some()).count();
    let mut out = Vec::new();
    for (rank, parts) in by_rank {
        let mut metadata = serde_json::Map::new();
        let name = match rank {
            None if parts.len() < 2 => continue,
            None => INDEX_FILE.to_string(),
            Some(r) => {
                metadata.insert("tensor_parallel_rank".into(), r.into());
                metadata.insert("tensor_parallel_size".into(), tp_size.into());
                let cuts: serde_json::Map<_, _> = splits
                    .iter()
                    .map(|(n, s)| (n.clone(), serde_json::json!(s)))
                    .collect();
                metadata.insert("tensor_parallel_splits".into(), cuts.into());
                format!("model-tp-{r}.safetensors.index.json")
            }
        };
        let (mut weight_map, mut total) = (BTreeMap::new(), 0u64);
        for part in &parts {
            for (tensor, bytes) in tensors_of(&dir.join(part))? {
                total += bytes;
                weight_map.insert(tensor, part.clone());
            }
        }
        metadata.insert("total_size".into(), total.into());
        let index = serde_json::json!({ "metadata": metadata, "weight_map": weight_map });
        let bytes = serde_json::to_vec_pretty(&index)
            .map_err(|e| OnnxError::field("checkpoint index", e.to_string()))?;
        out.push((name, bytes));
    }
    Ok(out)
}
