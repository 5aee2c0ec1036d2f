//! Shard-only checkpoints of ZeRO-3 runs: every data-parallel rank writes the chunks of
//! the parameters it holds (`<model part>-zero-<rank>.safetensors`), so a checkpoint never
//! gathers the whole model on one rank. Each file holds, per parameter, the rank's chunk
//! of the flattened parameter (zero-padded at the end of the last chunk) as a 1-D F32
//! tensor under the ONNX name, and in its metadata `format = zero3-shard`, the rank, the
//! chunk count and each parameter's logical shape (`shape.<name>`, JSON). A load (resume,
//! `onnx-train export`) joins the chunks of all ranks in rank order, drops the padding and
//! restores the shape: [`consolidate`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn_ort_dist::DistError;
use burn_ort_dist::record_safetensors::{Head, write_le_f32s, write_safetensors_with};
use burn_ort_dist::strategy::StateFile;
use safetensors::{Dtype, SafeTensors};

use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;

/// The `format` metadata value of a shard file.
const FORMAT: &str = "zero3-shard";

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
            let chunk: Vec<f32> = params[i]
                .val()
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .map_err(|e| state_error(format!("{name}: {e:?}")))?;
            write_le_f32s(w, &chunk).map_err(|e| state_error(format!("{name}: {e}")))
        })
    }))
}

/// One shard file read: its rank, chunk count, tensors and shapes.
struct Shard {
    rank: usize,
    world: usize,
    chunks: BTreeMap<String, Vec<f32>>,
    shapes: HashMap<String, Vec<usize>>,
}

fn read_shard(path: &Path) -> Result<Shard> {
    let bad = |m: String| OnnxError::Decode {
        path: path.to_path_buf(),
        what: "ZeRO-3 shard (safetensors)",
        message: m,
    };
    let bytes = std::fs::read(path).map_err(|e| OnnxError::io(path, e))?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
    let meta = header.metadata().clone().unwrap_or_default();
    if meta.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(bad(format!("no metadata format = {FORMAT}")));
    }
    let number = |k: &str| -> Result<usize> {
        meta.get(k)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(format!("no metadata {k}")))
    };
    let (rank, world) = (number("zero_rank")?, number("zero_world")?);
    let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let mut chunks = BTreeMap::new();
    let mut shapes = HashMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 || view.shape().len() != 1 {
            return Err(bad(format!("'{name}' is not a 1-D F32 chunk")));
        }
        let shape: Vec<usize> = meta
            .get(&format!("shape.{name}"))
            .and_then(|s| serde_json::from_str(s).ok())
            .ok_or_else(|| bad(format!("no metadata shape.{name}")))?;
        let values = burn_ort_dist::record_safetensors::le_f32s(view.data());
        shapes.insert(name.clone(), shape);
        chunks.insert(name, values);
    }
    Ok(Shard {
        rank,
        world,
        chunks,
        shapes,
    })
}

/// The whole parameters held by the shard files `files` of one model part (every rank's,
/// any order): each joined from its chunks in rank order, padding dropped, shaped.
pub fn consolidate(files: &[PathBuf]) -> Result<Vec<(String, ndarray::ArrayD<f32>)>> {
    let mut shards = files
        .iter()
        .map(|f| read_shard(f).map(|s| (f, s)))
        .collect::<Result<Vec<_>>>()?;
    shards.sort_by_key(|(_, s)| s.rank);
    let world = shards.first().map_or(0, |(_, s)| s.world);
    let ranks: Vec<usize> = shards.iter().map(|(_, s)| s.rank).collect();
    if ranks != (0..world).collect::<Vec<_>>() || shards.iter().any(|(_, s)| s.world != world) {
        return Err(OnnxError::Decode {
            path: files[0].clone(),
            what: "ZeRO-3 shard (safetensors)",
            message: format!("shards of ranks {ranks:?} for {world} chunks: some are missing"),
        });
    }
    let (first, rest) = shards.split_first_mut().expect("at least one shard");
    let mut out = Vec::new();
    for (name, chunk) in std::mem::take(&mut first.1.chunks) {
        let shape = first.1.shapes[&name].clone();
        let mut whole = chunk;
        for (path, s) in rest.iter_mut() {
            let more = s.chunks.remove(&name).ok_or_else(|| OnnxError::Decode {
                path: (*path).clone(),
                what: "ZeRO-3 shard (safetensors)",
                message: format!("no chunk of '{name}'"),
            })?;
            whole.extend(more);
        }
        whole.truncate(shape.iter().product());
        let array =
            ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&shape), whole).map_err(|e| {
                OnnxError::Decode {
                    path: files[0].clone(),
                    what: "ZeRO-3 shard (safetensors)",
                    message: format!("'{name}': {e}"),
                }
            })?;
        out.push((name, array));
    }
    Ok(out)
}

fn state_error(message: String) -> DistError {
    DistError::State { message }
}
