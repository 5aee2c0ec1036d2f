//! Shard-only checkpoints of ZeRO-3 runs: every data-parallel rank writes the chunks of
//! the parameters it holds (`<model part>-zero-<rank>.safetensors`), so a checkpoint never
//! gathers the whole model on one rank. Each file holds, per parameter, the rank's chunk
//! of the flattened parameter (zero-padded at the end of the last chunk) as a 1-D F32
//! tensor under the ONNX name, and in its metadata `format = zero3-shard`, the rank, the
//! chunk count and each parameter's logical shape (`shape.<name>`, JSON). A load (resume,
//! `onnx-train export`) joins the chunks of all ranks in rank order, drops the padding and
//! restores the shape, one parameter at a time (`checkpoint_params.rs`).

use std::collections::BTreeMap;

use burn_ort_dist::DistError;
use burn_ort_dist::storage::record_safetensors::{Head, write_le_f32s, write_safetensors_with};
use burn_ort_dist::update::strategy::StateFile;
use safetensors::Dtype;

use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;

/// The `format` metadata value of a shard file.
pub(crate) const FORMAT: &str = "zero3-shard";

/// The shard file of data-parallel rank `rank` for the model part file `part`
/// (`model-stage-1.safetensors` -> `model-stage-1-zero-<rank>.safetensors`).
pub fn shard_file(part: &str, rank: usize) -> String {
    let stem = part.strip_suffix(".safetensors").unwrap_or(part);
    format!("{stem}-zero-{rank}.safetensors")
}

/// The model part file and data-parallel rank of a shard file name (`None`: no shard).
pub fn shard_of(name: &str) -> Option<(String, usize)> {
    let (stem, rank) = name.strip_suffix(".safetensors")?.rsplit_once("-zero-")?;
    Some((format!("{stem}.safetensors"), rank.parse().ok()?))
}

/// The chunks `model` (sharded: ZeRO-3) holds of the parameters `keep` selects, as this
/// rank's shard file `name`, written streaming: one chunk read and converted at a time.
pub fn shard_writer<'a>(
    name: String,
    model: &'a OnnxModel,
    keep: impl Fn(&str) -> bool,
) -> Result<StateFile<'a>> {
    let s = model
        .sharding()
        .ok_or_else(|| OnnxError::field("checkpoint", "a shard file of a model not sharded"))?;
    let mut metadata = BTreeMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("zero_rank".to_string(), s.rank.to_string()),
        ("zero_world".to_string(), s.world.to_string()),
    ]);
    let params = model.params();
    let kept: Vec<usize> = (0..params.len())
        .filter(|&i| keep(&model.param_infos()[i].name))
        .collect();
    let mut heads = Vec::with_capacity(kept.len());
    for &i in &kept {
        let info = &model.param_infos()[i];
        metadata.insert(
            format!("shape.{}", info.name),
            serde_json::to_string(&info.shape).unwrap_or_default(),
        );
        let len: usize = params[i].val().dims().iter().product();
        heads.push(Head {
            name: info.name.clone(),
            dtype: Dtype::F32,
            shape: vec![len],
            bytes: len * 4,
        });
    }
    Ok(StateFile::stream(name, move |w| {
        write_safetensors_with(w, &heads, &metadata, |k, w| {
            let (i, name) = (kept[k], &heads[k].name);
            let chunk = burn_ort_dist::host_values(params[i].val())
                .map_err(|e| state_error(format!("{name}: {e}")))?;
            model.release_chunk(i);
            write_le_f32s(w, &chunk).map_err(|e| state_error(format!("{name}: {e}")))
        })
    }))
}

fn state_error(message: String) -> DistError {
    DistError::State { message }
}
