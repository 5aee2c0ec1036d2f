//! Burn optimizer records on disk (`optimizer.safetensors`, see `record_safetensors`;
//! checkpoints of earlier versions hold burn-pack `optimizer.bpk`, still read): the records of several
//! pipeline stages merged into one, and the records of a tensor-parallel group's ranks
//! regrouped for another tensor-parallel size; and the Adam-family moments of a record
//! encoded from and decoded into plain vectors (for optimizers that keep them elsewhere).

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use burn::tensor::{Bytes, DType};

use crate::error::{DistError, DistResult, state_error};
use crate::storage::record_safetensors::{safetensors_to_record, write_record};

/// The optimizer record file of a replicated run.
pub const REPLICATED_STATE_FILE: &str = "optimizer.safetensors";

/// The record file of checkpoints written before records were safetensors (burn-pack).
const LEGACY_STATE_FILE: &str = "optimizer.bpk";

/// One tensor of a record: its shape and values.
pub type RecordTensor = (Vec<usize>, Vec<f32>);

/// Burn keys a record's tensors by parameter id and its scalars and paths by keys that start
/// with the id (`"<id>.<field>"`): whether `key` belongs to a parameter in `ids` (or to none).
fn kept(key: &str, ids: &HashSet<u64>) -> bool {
    key.split('.')
        .next()
        .and_then(|id| id.parse::<u64>().ok())
        .is_none_or(|id| ids.contains(&id))
}

/// The record in `dir` (`optimizer.safetensors`, or an earlier checkpoint's burn-pack
/// `optimizer.bpk`).
fn read(dir: &Path) -> DistResult<(PathBuf, burn_pack::Reader)> {
    let path = dir.join(REPLICATED_STATE_FILE);
    let legacy = dir.join(LEGACY_STATE_FILE);
    let (path, bytes) = if !path.exists() && legacy.exists() {
        let bytes = std::fs::read(&legacy)
            .map_err(|e| state_error(format!("{}: {e}", legacy.display())))?;
        (legacy, Bytes::from_bytes_vec(bytes))
    } else {
        let file = std::fs::read(&path).map_err(|e| {
            state_error(format!(
                "{}: {e} (a checkpoint of a sharded run needs zero_stage >= 1)",
                path.display()
            ))
        })?;
        let record = safetensors_to_record(&file)
            .map_err(|e| state_error(format!("{}: {e}", path.display())))?;
        (path, record)
    };
    let reader = burn_pack::Reader::from_bytes(bytes).map_err(|e| {
        state_error(format!(
            "{}: not a valid optimizer record: {e:?}",
            path.display()
        ))
    })?;
    Ok((path, reader))
}

fn write(
    tensors: Vec<burn_pack::Tensor>,
    scalars: &BTreeMap<String, burn_pack::Scalar>,
    paths: &BTreeMap<String, String>,
) -> DistResult<Bytes> {
    let mut writer = burn_pack::Writer::new(tensors);
    for (k, v) in scalars {
        writer = writer.with_scalar(k, *v);
    }
    for (k, v) in paths {
        writer = writer.with_metadata(k, v);
    }
    writer
        .into_bytes()
        .map_err(|e| state_error(format!("cannot write an optimizer record: {e:?}")))
}

/// The optimizer records in `dirs` as one, keeping the state of the parameters `ids` only.
/// A parameter several records hold (one that several pipeline stages read: its copies
/// take the same updates) is taken from the first.
pub(crate) fn merged_record(dirs: &[PathBuf], ids: &HashSet<u64>) -> DistResult<Bytes> {
    let (mut tensors, mut scalars, mut paths) = (Vec::new(), BTreeMap::new(), BTreeMap::new());
    let mut taken = HashSet::new();
    for dir in dirs {
        let (path, reader) = read(dir)?;
        let bad = |e: burn_pack::Error| {
            state_error(format!(
                "{}: not a valid optimizer record: {e:?}",
                path.display()
            ))
        };
        scalars.extend(
            reader
                .scalars()
                .iter()
                .filter(|(k, _)| kept(k, ids))
                .map(|(k, v)| (k.clone(), *v)),
        );
        paths.extend(
            reader
                .metadata()
                .iter()
                .filter(|(k, _)| kept(k, ids))
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        for t in reader.into_tensors().map_err(bad)? {
            let (name, dtype, shape, id, data) = t.into_parts().map_err(bad)?;
            if id.is_none_or(|id| ids.contains(&id))
                && kept(&name, ids)
                && taken.insert(name.clone())
            {
                tensors.push(burn_pack::Tensor::new(name, dtype, shape, id, data));
            }
        }
    }
    write(tensors, &scalars, &paths)
}

/// One record from the records of the ranks of a tensor-parallel group (`dirs[r]` holds
/// rank `r`'s), written to `out/optimizer.safetensors`: each tensor of a parameter is `join`ed
/// from every rank's copy (`None`: the first rank's is kept, as for a weight every rank
/// holds whole); scalars and metadata (step counts, identical on every rank) come from the
/// first rank.
pub fn regroup_records(
    dirs: &[PathBuf],
    join: impl Fn(u64, Vec<RecordTensor>) -> DistResult<Option<RecordTensor>>,
    out: &Path,
) -> DistResult<()> {
    let mut ranks = Vec::new();
    let (mut scalars, mut paths) = (BTreeMap::new(), BTreeMap::new());
    for (r, dir) in dirs.iter().enumerate() {
        let (path, reader) = read(dir)?;
        if r == 0 {
            scalars = reader.scalars().clone();
            paths = reader.metadata().clone();
        }
        let bad = |e: burn_pack::Error| {
            state_error(format!(
                "{}: not a valid optimizer record: {e:?}",
                path.display()
            ))
        };
        let mut tensors = BTreeMap::new();
        for t in reader.into_tensors().map_err(bad)? {
            let (name, dtype, shape, id, data) = t.into_parts().map_err(bad)?;
            tensors.insert(name.clone(), (dtype, shape, id, data, path.clone()));
        }
        ranks.push(tensors);
    }
    let first = ranks.remove(0);
    let mut tensors = Vec::new();
    for (name, (dtype, shape, id, data, path)) in first {
        let Some(id) = id else {
            tensors.push(burn_pack::Tensor::new(name, dtype, shape, None, data));
            continue;
        };
        let mut copies = vec![(shape.to_vec(), f32_values(dtype, &data, &name, &path)?)];
        for rank in &ranks {
            let (dtype, shape, _, data, path) = rank.get(&name).ok_or_else(|| {
                state_error(format!("{}: no optimizer state '{name}'", path.display()))
            })?;
            copies.push((shape.to_vec(), f32_values(*dtype, data, &name, path)?));
        }
        match join(id, copies)? {
            Some((shape, values)) => {
                let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                tensors.push(burn_pack::Tensor::new(
                    name,
                    DType::F32,
                    shape,
                    Some(id),
                    Bytes::from_bytes_vec(bytes),
                ));
            }
            None => tensors.push(burn_pack::Tensor::new(name, dtype, shape, Some(id), data)),
        }
    }
    let record = write(tensors, &scalars, &paths)?;
    std::fs::create_dir_all(out).map_err(|e| state_error(format!("{}: {e}", out.display())))?;
    let file = out.join(REPLICATED_STATE_FILE);
    let mut w = std::io::BufWriter::new(
        std::fs::File::create(&file)
            .map_err(|e| state_error(format!("{}: {e}", file.display())))?,
    );
    write_record(record, &mut w)?;
    w.flush()
        .map_err(|e| state_error(format!("{}: {e}", file.display())))
}

fn f32_values(dtype: DType, data: &Bytes, name: &str, path: &Path) -> DistResult<Vec<f32>> {
    if dtype != DType::F32 {
        return Err(state_error(format!(
            "{}: optimizer state '{name}' is {dtype:?}; only f32 state regroups across tensor-parallel sizes",
            path.display()
        )));
    }
    Ok(crate::storage::record_safetensors::le_f32s(&data[..]))
}

/// One parameter's Adam-family state (Adam, AdamW, LAMB) as Burn records it.
#[derive(Debug, Clone, PartialEq)]
pub struct MomentState {
    /// Updates applied to the parameter.
    pub time: usize,
    /// The parameter's shape.
    pub shape: Vec<usize>,
    /// First moment, row-major.
    pub moment_1: Vec<f32>,
    /// Second moment, row-major.
    pub moment_2: Vec<f32>,
}

/// Where Burn's record keeps a parameter's moments: Adam and AdamW nest them in a
/// `momentum` field (`"<id>.momentum.moment_1"`), LAMB does not (`"<id>.moment_1"`).
fn moment_prefix(id: u64, nested: bool) -> String {
    if nested {
        format!("{id}.momentum")
    } else {
        id.to_string()
    }
}

/// Burn's optimizer record (burn-pack bytes, what `ModuleOptimizer::into_bytes` writes)
/// holding `states`, keyed by parameter id; `nested` as for Adam/AdamW, else LAMB.
pub fn encode_moments(states: &[(u64, MomentState)], nested: bool) -> DistResult<Bytes> {
    let mut tensors = Vec::new();
    let mut scalars = BTreeMap::new();
    for (id, s) in states {
        let prefix = moment_prefix(*id, nested);
        scalars.insert(
            format!("{id}.__rank"),
            burn_pack::Scalar::from(s.shape.len()),
        );
        scalars.insert(format!("{prefix}.time"), burn_pack::Scalar::from(s.time));
        for (leaf, values) in [("moment_1", &s.moment_1), ("moment_2", &s.moment_2)] {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.push(burn_pack::Tensor::new(
                format!("{prefix}.{leaf}"),
                DType::F32,
                s.shape.clone(),
                Some(*id),
                Bytes::from_bytes_vec(bytes),
            ));
        }
    }
    write(tensors, &scalars, &BTreeMap::new())
}

/// One parameter's Adam-family state where it lies (host memory, a mapped file).
pub struct MomentSlices<'a> {
    /// The parameter's id.
    pub id: u64,
    /// Updates applied to it.
    pub time: usize,
    /// Its shape.
    pub shape: &'a [usize],
    /// First moment.
    pub moment_1: &'a [f32],
    /// Second moment.
    pub moment_2: &'a [f32],
}

/// Write what [`encode_moments`] would record of `states` straight to `w` as the
/// optimizer's safetensors file (`record_safetensors`): the moments are written from where
/// they lie, never copied whole; `written(k)` is called once state `k` is in the file (to
/// drop a mapped file's pages, say).
pub fn write_moments(
    states: &[MomentSlices<'_>],
    nested: bool,
    w: &mut dyn Write,
    mut written: impl FnMut(usize),
) -> DistResult<()> {
    let mut metadata = BTreeMap::from([(
        "format".to_string(),
        crate::storage::record_safetensors::FORMAT.to_string(),
    )]);
    let mut heads = Vec::new();
    for s in states {
        let prefix = moment_prefix(s.id, nested);
        metadata.insert(
            format!("scalar.{}.__rank", s.id),
            format!("u64:{}", s.shape.len()),
        );
        metadata.insert(format!("scalar.{prefix}.time"), format!("u64:{}", s.time));
        for (leaf, values) in [("moment_1", s.moment_1), ("moment_2", s.moment_2)] {
            let name = format!("{prefix}.{leaf}");
            metadata.insert(format!("param_id.{name}"), s.id.to_string());
            heads.push(crate::storage::record_safetensors::Head {
                name,
                dtype: safetensors::Dtype::F32,
                shape: s.shape.to_vec(),
                bytes: 4 * values.len(),
            });
        }
    }
    crate::storage::record_safetensors::write_safetensors_with(w, &heads, &metadata, |i, w| {
        let s = &states[i / 2];
        let values = if i % 2 == 0 { s.moment_1 } else { s.moment_2 };
        w.write_all(bytemuck::cast_slice(values))
            .map_err(|e| state_error(format!("cannot write the optimizer state: {e}")))?;
        if i % 2 == 1 {
            written(i / 2);
        }
        Ok(())
    })
}

/// The per-parameter moments in a record `bytes` (see [`encode_moments`]); parameters
/// without state are absent.
pub fn decode_moments(bytes: Bytes, nested: bool) -> DistResult<BTreeMap<u64, MomentState>> {
    let bad = |e: burn_pack::Error| state_error(format!("not a valid optimizer record: {e:?}"));
    let reader = burn_pack::Reader::from_bytes(bytes).map_err(bad)?;
    let scalars = reader.scalars().clone();
    let mut tensors = BTreeMap::new();
    for t in reader.into_tensors().map_err(bad)? {
        let (name, dtype, shape, _, data) = t.into_parts().map_err(bad)?;
        tensors.insert(name, (dtype, shape.to_vec(), data));
    }
    let mut out = BTreeMap::new();
    for key in scalars.keys() {
        let Some(id) = key
            .strip_suffix(".__rank")
            .and_then(|id| id.parse::<u64>().ok())
        else {
            continue;
        };
        let prefix = moment_prefix(id, nested);
        let time = scalars
            .get(&format!("{prefix}.time"))
            .and_then(|s| usize::try_from(*s).ok())
            .ok_or_else(|| state_error(format!("optimizer record: no step count '{prefix}.time' (a record of another optimizer kind?)")))?;
        let mut moment = |leaf: &str| {
            let name = format!("{prefix}.{leaf}");
            let (dtype, shape, data) = tensors
                .remove(&name)
                .ok_or_else(|| state_error(format!("optimizer record: no state '{name}'")))?;
            let values = f32_values(dtype, &data, &name, Path::new("optimizer record"))?;
            Ok::<_, DistError>((shape, values))
        };
        let (shape, moment_1) = moment("moment_1")?;
        let (_, moment_2) = moment("moment_2")?;
        out.insert(
            id,
            MomentState {
                time,
                shape,
                moment_1,
                moment_2,
            },
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(time: usize) -> MomentState {
        MomentState {
            time,
            shape: vec![2, 2],
            moment_1: vec![0.5, -1.0, 2.0, 0.25],
            moment_2: vec![0.1, 0.2, 0.3, 0.4],
        }
    }

    /// A record written as `optimizer.safetensors`, and one an earlier version wrote as
    /// burn-pack `optimizer.bpk`, read back to the same moments.
    #[test]
    fn safetensors_records_and_earlier_burn_pack_records_both_load() {
        let states = vec![(3u64, state(7)), (9u64, state(2))];
        let record = encode_moments(&states, true).unwrap();
        let root = std::env::temp_dir().join(format!("record-files-{}", std::process::id()));
        for (file, bytes) in [
            (
                REPLICATED_STATE_FILE,
                crate::storage::record_safetensors::record_to_safetensors(record.clone()).unwrap(),
            ),
            (LEGACY_STATE_FILE, record.to_vec()),
        ] {
            let dir = root.join(file);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(file), bytes).unwrap();
            let merged = merged_record(&[dir], &HashSet::from([3, 9])).unwrap();
            let back = decode_moments(merged, true).unwrap();
            assert_eq!(
                back,
                states.iter().cloned().collect::<BTreeMap<_, _>>(),
                "{file}"
            );
        }
        std::fs::remove_dir_all(root).unwrap();
    }

    /// The moments streamed from where they lie make the file the record of the same
    /// states does: the same tensors, ids and step counts, and they load back.
    #[test]
    fn moments_written_in_place_are_the_record_of_the_same_state() {
        let states = vec![(3u64, state(7)), (9u64, state(2))];
        for nested in [true, false] {
            let slices: Vec<MomentSlices<'_>> = states
                .iter()
                .map(|(id, s)| MomentSlices {
                    id: *id,
                    time: s.time,
                    shape: &s.shape,
                    moment_1: &s.moment_1,
                    moment_2: &s.moment_2,
                })
                .collect();
            let mut streamed = Vec::new();
            write_moments(&slices, nested, &mut streamed, |_| {}).unwrap();
            let whole = crate::storage::record_safetensors::record_to_safetensors(
                encode_moments(&states, nested).unwrap(),
            )
            .unwrap();
            let read = |b: &[u8]| {
                let (_, h) = safetensors::SafeTensors::read_metadata(b).unwrap();
                let st = safetensors::SafeTensors::deserialize(b).unwrap();
                let mut t: Vec<_> = st
                    .tensors()
                    .into_iter()
                    .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
                    .collect();
                t.sort();
                (h.metadata().clone(), t)
            };
            assert_eq!(read(&streamed), read(&whole), "nested {nested}");
            let back = decode_moments(
                crate::storage::record_safetensors::safetensors_to_record(&streamed).unwrap(),
                nested,
            )
            .unwrap();
            assert_eq!(back, states.iter().cloned().collect::<BTreeMap<_, _>>());
        }
    }
}
