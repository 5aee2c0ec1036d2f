//! `model.safetensors.index.json` for a checkpoint whose parameters are split over part
//! files (one per pipeline stage): Hugging Face's index of sharded weights, each parameter
//! name mapped to the file that holds it, with the total byte size, so `transformers`-style
//! loaders and any script find a weight without opening every part. Checkpoints with
//! tensor-parallel parts hold pieces of one weight in several files, which that index
//! cannot say: there `state.json` records how each is split, and no index is written.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::Path;

use crate::error::{OnnxError, Result};

/// The index's file name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

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

/// The index of the model part files in `dir` (`model-stage-<k>.safetensors`), or `None`
/// when the parameters are in one file or split by tensor parallelism.
pub fn model_index(dir: &Path) -> Result<Option<Vec<u8>>> {
    let mut parts: Vec<String> = fs::read_dir(dir)
        .map_err(|e| OnnxError::io(dir, e))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("model") && n.ends_with(".safetensors"))
        .collect();
    if parts.len() < 2 || parts.iter().any(|n| n.contains("-tp-")) {
        return Ok(None);
    }
    parts.sort();
    let (mut weight_map, mut total) = (BTreeMap::new(), 0u64);
    for part in &parts {
        for (name, bytes) in tensors_of(&dir.join(part))? {
            total += bytes;
            weight_map.insert(name, part.clone());
        }
    }
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    serde_json::to_vec_pretty(&index)
        .map(Some)
        .map_err(|e| OnnxError::field("checkpoint index", e.to_string()))
}
