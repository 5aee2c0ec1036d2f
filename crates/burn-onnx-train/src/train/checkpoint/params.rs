//! Reading a checkpoint's parameters into a model one parameter at a time: every model
//! file of the checkpoint (`model[-stage-<k>][-tp-<r>][-zero-<rank>].safetensors`, see
//! `checkpoint.rs`) is memory-mapped and indexed from its header, then each parameter of
//! the model is assembled from where it lies (a whole tensor, tensor-parallel parts, or
//! ZeRO-3 chunks of every data-parallel rank), set, and its pages released before the next.
//! A checkpoint of a model bigger than memory thus resumes into a ZeRO-3 model (sharded
//! first, so each value is cut to this rank's chunk as it is set) holding one whole
//! parameter at a time.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use ndarray::{ArrayD, IxDyn};
use safetensors::{Dtype, SafeTensors};

use super::index::{file_tp_rank, model_files};
use super::zero3_shards::{FORMAT as SHARD_FORMAT, shard_of};
use super::{MODEL_FILE, read_state};
use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::parallel::tensor_parallel::TensorParallel;
use crate::value::FloatValue;
use crate::value::host_tensor::release_pages;

/// A tensor's place in one of the mapped files.
struct Stored {
    file: usize,
    shape: Vec<usize>,
    bytes: Range<usize>,
}

/// Where one tensor-parallel part (or the whole weight) of a parameter lies.
enum Part {
    /// One tensor.
    Tensor(Stored),
    /// ZeRO-3 chunks: by data-parallel rank, of `world`, joined into `shape`.
    Chunks {
        world: usize,
        shape: Vec<usize>,
        by_rank: BTreeMap<usize, Stored>,
    },
}

/// The checkpoint's model files, mapped, and where each parameter lies in them.
struct Index {
    files: Vec<(PathBuf, Mmap)>,
    /// Parameter name -> its parts by tensor-parallel rank (`None`: whole weights).
    params: HashMap<String, BTreeMap<Option<usize>, Part>>,
}

fn bad(path: &Path, what: &'static str, message: String) -> OnnxError {
    OnnxError::Decode {
        path: path.to_path_buf(),
        what,
        message,
    }
}

impl Index {
    /// Map and index the model files of checkpoint `path`.
    fn open(path: &Path) -> Result<Self> {
        let names: Vec<PathBuf> = model_files(path)?
            .into_iter()
            .map(|n| path.join(n))
            .collect();
        if names.is_empty() {
            return Err(OnnxError::io(
                &path.join(MODEL_FILE),
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model parameters in the checkpoint",
                ),
            ));
        }
        let mut index = Index {
            files: Vec::with_capacity(names.len()),
            params: HashMap::new(),
        };
        for name in names {
            let file = File::open(&name).map_err(|e| OnnxError::io(&name, e))?;
            // SAFETY: a read-only map of a checkpoint file, whose manifest was checked; a file
            // changed under a running load is outside what a loader can defend against.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| OnnxError::io(&name, e))?;
            index.add(index.files.len(), &name, &map)?;
            index.files.push((name, map));
        }
        Ok(index)
    }

    /// Index the tensors of file number `k`.
    fn add(&mut self, k: usize, path: &Path, map: &Mmap) -> Result<()> {
        let file_name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let shard = shard_of(file_name);
        let what = if shard.is_some() {
            "ZeRO-3 shard (safetensors)"
        } else {
            "checkpoint model (safetensors)"
        };
        let (_, header) =
            SafeTensors::read_metadata(map).map_err(|e| bad(path, what, e.to_string()))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let st = SafeTensors::deserialize(map).map_err(|e| bad(path, what, e.to_string()))?;
        let tp_rank = file_tp_rank(shard.as_ref().map_or(file_name, |(part, _)| part));
        let chunks = match &shard {
            Some(_) if meta.get("format").map(String::as_str) != Some(SHARD_FORMAT) => {
                return Err(bad(
                    path,
                    what,
                    format!("no metadata format = {SHARD_FORMAT}"),
                ));
            }
            Some(_) => {
                let number = |k: &str| -> Result<usize> {
                    meta.get(k)
                        .and_then(|v| v.parse().ok())
                        .ok_or_else(|| bad(path, what, format!("no metadata {k}")))
                };
                Some((number("zero_rank")?, number("zero_world")?))
            }
            None => None,
        };
        let base = map.as_ptr() as usize;
        for (name, view) in st.tensors() {
            if view.dtype() != Dtype::F32 {
                return Err(bad(
                    path,
                    what,
                    format!("parameter '{name}' is {:?}, not f32", view.dtype()),
                ));
            }
            let start = view.data().as_ptr() as usize - base;
            let stored = Stored {
                file: k,
                shape: view.shape().to_vec(),
                bytes: start..start + view.data().len(),
            };
            let parts = self.params.entry(name.clone()).or_default();
            match chunks {
                None => {
                    parts.insert(tp_rank, Part::Tensor(stored));
                }
                Some((rank, world)) => {
                    if view.shape().len() != 1 {
                        return Err(bad(path, what, format!("'{name}' is not a 1-D F32 chunk")));
                    }
                    let shape: Vec<usize> = meta
                        .get(&format!("shape.{name}"))
                        .and_then(|s| serde_json::from_str(s).ok())
                        .ok_or_else(|| bad(path, what, format!("no metadata shape.{name}")))?;
                    let part = parts.entry(tp_rank).or_insert_with(|| Part::Chunks {
                        world,
                        shape,
                        by_rank: BTreeMap::new(),
                    });
                    match part {
                        Part::Chunks {
                            world: w, by_rank, ..
                        } if *w == world => {
                            by_rank.insert(rank, stored);
                        }
                        _ => {
                            return Err(bad(
                                path,
                                what,
                                format!("'{name}': shards of different chunk counts"),
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The values at `s`, their pages released after the read.
    fn values(&self, s: &Stored) -> Vec<f32> {
        let map = &self.files[s.file].1;
        let data = &map[s.bytes.clone()];
        let values = burn_ort_dist::storage::record_safetensors::le_f32s(data);
        release_pages(map, data);
        values
    }

    /// The whole value of one part.
    fn part(&self, name: &str, part: &Part) -> Result<ArrayD<f32>> {
        let (shape, values, path) = match part {
            Part::Tensor(s) => (s.shape.clone(), self.values(s), &self.files[s.file].0),
            Part::Chunks {
                world,
                shape,
                by_rank,
            } => {
                let first = by_rank.values().next().expect("a chunk indexed it");
                let path = &self.files[first.file].0;
                let ranks: Vec<usize> = by_rank.keys().copied().collect();
                if ranks != (0..*world).collect::<Vec<_>>() {
                    return Err(bad(
                        path,
                        "ZeRO-3 shard (safetensors)",
                        format!(
                            "'{name}': shards of ranks {ranks:?} for {world} chunks: some are missing"
                        ),
                    ));
                }
                let mut whole = Vec::new();
                for s in by_rank.values() {
                    whole.extend(self.values(s));
                }
                whole.truncate(shape.iter().product());
                (shape.clone(), whole, path)
            }
        };
        ArrayD::from_shape_vec(IxDyn(&shape), values).map_err(|e| {
            bad(
                path,
                "checkpoint model (safetensors)",
                format!("'{name}': {e}"),
            )
        })
    }
}

/// `error` (the checkpoint at `checkpoint` did not fit the model) said as what it most
/// likely is when the checkpoint was trained from another model file than `model_path`:
/// the two files named, the parameter error after them.
pub fn from_other_model(
    error: OnnxError,
    checkpoint: &Path,
    trained_from: &Path,
    model_path: &Path,
) -> OnnxError {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    if same(trained_from, model_path) {
        return error;
    }
    OnnxError::field(
        "config.model.model_path",
        format!(
            "{} was trained from {}, this run uses {}, and they differ: {error} (train from the model it was trained from, or start anew in another output_dir, or with --resume never --overwrite)",
            checkpoint.display(),
            trained_from.display(),
            model_path.display()
        ),
    )
}

/// Set `model`'s parameters to the checkpoint's (every parameter must be there, in f32 and
/// with the model's shape), from `model.safetensors`, the stages' part files or ZeRO-3's
/// shards, one parameter at a time (see the module doc). Parts of tensor-parallel ranks are
/// reassembled, then cut for `tp` (this rank's split of the model; `None` for a whole
/// model); on a ZeRO-3 model each value is cut to this rank's chunk.
pub fn read_params(
    path: &Path,
    mut model: OnnxModel,
    tp: Option<&TensorParallel>,
) -> Result<OnnxModel> {
    let index = Index::open(path)?;
    let device = model.device();
    let mut splits = None;
    for info in model.param_infos().to_vec() {
        let missing = || {
            bad(
                &index.files[0].0,
                "checkpoint model (safetensors)",
                format!(
                    "parameter '{}': not in {}",
                    info.name,
                    index
                        .files
                        .iter()
                        .map(|(f, _)| f.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        };
        let parts = index.params.get(&info.name).ok_or_else(missing)?;
        let full = match parts.get(&None) {
            Some(whole) => index.part(&info.name, whole)?,
            None => {
                let state = match &splits {
                    Some(s) => s,
                    None => splits.insert(read_state(path)?),
                };
                let arrays = parts
                    .iter()
                    .map(|(_, p)| index.part(&info.name, p))
                    .collect::<Result<Vec<_>>>()?;
                match state.tensor_parallel_splits.get(&info.name) {
                    Some(split) if arrays.len() == state.tensor_parallel => split.assemble(&arrays),
                    Some(_) => {
                        return Err(bad(
                            path,
                            "checkpoint model (safetensors)",
                            format!(
                                "parameter '{}': {} of {} tensor-parallel parts",
                                info.name,
                                arrays.len(),
                                state.tensor_parallel
                            ),
                        ));
                    }
                    None => arrays.into_iter().next().ok_or_else(missing)?,
                }
            }
        };
        let array = match tp.and_then(|t| t.params.get(&info.name).map(|s| (t, s))) {
            Some((t, split)) => split.slice(&full, t.rank, t.size),
            None => full,
        };
        if array.shape() != info.shape.as_slice() {
            return Err(bad(
                path,
                "checkpoint model (safetensors)",
                format!(
                    "parameter '{}' is {:?}, the model has {:?}",
                    info.name,
                    array.shape(),
                    info.shape
                ),
            ));
        }
        let v = FloatValue::from_owned_array(array, &device)
            .map_err(|e| OnnxError::field(&info.name, e.0))?;
        model = model.set_params(&HashMap::from([(info.name.clone(), v)]))?;
    }
    Ok(model)
}
