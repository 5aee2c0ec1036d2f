//! ZeRO optimizer state in a checkpoint directory, resharded on load.
//!
//! Rank `r` writes `zero-<r>.safetensors`: its shard of every state vector as the f32
//! tensor `state.<k>` (Adam's `state.0` the first moments, `state.1` the second), with the
//! ZeRO stage, world size, rank and step in the file's metadata, so any safetensors reader
//! opens it (checkpoints of earlier versions hold `zero-<r>.bin`, the same vectors as raw
//! little-endian f32, one after another; both read). Rank 0 writes `zero.json`: the stage,
//! world size, step, the number of
//! state vectors, and the layout (element count and id of every parameter, in order, and
//! its partitioning), so that a run with another world size or stage can join the old
//! shards into whole tensors, pick its parameters' state by id and cut its own shard. A checkpoint of a
//! pipeline holds one such directory per stage; a run with another stage count reads them
//! all and takes the parameters it holds from each.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{DistError, DistResult};
use crate::record::REPLICATED_STATE_FILE;
use crate::zero::flat_optim::ShardState;
use burn::module::ParamId;

use crate::zero::layout::{FlatLayout, Partitioning, Slot};

/// The manifest's file name.
pub const MANIFEST: &str = "zero.json";

fn shard_file(rank: usize) -> String {
    format!("zero-{rank}.safetensors")
}

/// The shard file of checkpoints written before shards were safetensors.
fn legacy_shard_file(rank: usize) -> String {
    format!("zero-{rank}.bin")
}

/// Rank `rank`'s shard as a safetensors file: `state.<k>` per state vector.
fn shard_bytes(rank: usize, stage: usize, world: usize, state: &ShardState) -> DistResult<Vec<u8>> {
    let bytes: Vec<Vec<u8>> = state
        .slots
        .get()
        .iter()
        .map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views = bytes
        .iter()
        .enumerate()
        .map(|(k, b)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![b.len() / 4], b)
                    .map_err(|e| bad(rank, format!("state vector {k}: {e}")))?;
            Ok((format!("state.{k}"), view))
        })
        .collect::<DistResult<Vec<_>>>()?;
    let metadata = HashMap::from([
        (
            "format".to_string(),
            "burn-ort ZeRO optimizer-state shard".to_string(),
        ),
        ("zero_stage".to_string(), stage.to_string()),
        ("world_size".to_string(), world.to_string()),
        ("rank".to_string(), rank.to_string()),
        ("step".to_string(), state.step.to_string()),
    ]);
    safetensors::serialize(views, Some(metadata))
        .map_err(|e| bad(rank, format!("cannot encode {}: {e}", shard_file(rank))))
}

/// The `vectors` state vectors of length `len` in shard file `r` of `dir` (safetensors, or
/// the raw f32 of earlier checkpoints).
fn read_shard(
    dir: &Path,
    r: usize,
    rank: usize,
    vectors: usize,
    len: usize,
) -> DistResult<Vec<Vec<f32>>> {
    let floats = crate::record_safetensors::le_f32s;
    let p = dir.join(shard_file(r));
    if !p.exists() {
        let legacy = dir.join(legacy_shard_file(r));
        let bytes =
            std::fs::read(&legacy).map_err(|e| bad(rank, format!("{}: {e}", p.display())))?;
        if bytes.len() != len * vectors * 4 {
            return Err(bad(
                rank,
                format!(
                    "{}: {} bytes, expected {} ({vectors} x {len} f32)",
                    legacy.display(),
                    bytes.len(),
                    len * vectors * 4
                ),
            ));
        }
        return Ok(bytes.chunks_exact(len * 4).map(floats).collect());
    }
    let bytes = std::fs::read(&p).map_err(|e| bad(rank, format!("{}: {e}", p.display())))?;
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        bad(
            rank,
            format!("{}: not a safetensors file: {e}", p.display()),
        )
    })?;
    (0..vectors)
        .map(|k| {
            let t = file
                .tensor(&format!("state.{k}"))
                .map_err(|e| bad(rank, format!("{}: state.{k}: {e}", p.display())))?;
            if t.dtype() != safetensors::Dtype::F32 || t.data().len() != len * 4 {
                return Err(bad(
                    rank,
                    format!(
                        "{}: state.{k} is {:?} {:?}, expected F32 [{len}]",
                        p.display(),
                        t.dtype(),
                        t.shape()
                    ),
                ));
            }
            Ok(floats(t.data()))
        })
        .collect()
}

fn bad(rank: usize, message: String) -> DistError {
    DistError::State {
        message: format!("rank {rank}: {message}"),
    }
}

/// What `zero.json` holds.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Manifest {
    stage: usize,
    world_size: usize,
    step: usize,
    state_vectors: usize,
    elements: usize,
    parameter_elements: Vec<usize>,
    /// Parameter ids in layout order (absent in checkpoints from before pipelines: those
    /// reload only onto the same layout).
    #[serde(default)]
    parameter_ids: Vec<u64>,
    /// How the shards cut the parameters (absent before ZeRO-3: contiguous).
    #[serde(default)]
    partitioning: Partitioning,
}

/// The files rank `rank` contributes to a checkpoint.
pub fn write(
    rank: usize,
    stage: usize,
    layout: &FlatLayout,
    state: &ShardState,
) -> DistResult<Vec<(String, Vec<u8>)>> {
    let mut files = vec![(
        shard_file(rank),
        shard_bytes(rank, stage, layout.world, state)?,
    )];
    if rank == 0 {
        let manifest = Manifest {
            stage,
            world_size: layout.world,
            step: state.step,
            state_vectors: state.slots.count(),
            elements: layout.len,
            parameter_elements: layout.slots.iter().map(|s| s.len).collect(),
            parameter_ids: layout.slots.iter().map(|s| s.id.val()).collect(),
            partitioning: layout.partitioning,
        };
        let json = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| bad(rank, format!("cannot encode {MANIFEST}: {e}")))?;
        files.push((MANIFEST.into(), json));
    }
    Ok(files)
}

/// Rank `rank`'s state for `layout`, from the shards of whatever world size and
/// partitioning wrote `dirs` (one directory, or one per pipeline stage of the run that
/// wrote them).
pub fn read(
    dirs: &[PathBuf],
    rank: usize,
    layout: &FlatLayout,
    vectors: usize,
) -> DistResult<ShardState> {
    let want: Vec<usize> = layout.slots.iter().map(|s| s.len).collect();
    let mut step = None;
    // Per parameter (by id, or by position in a single legacy directory): its state vectors.
    let mut by_id: HashMap<u64, Vec<Vec<f32>>> = HashMap::new();
    let mut by_position: Option<Vec<Vec<Vec<f32>>>> = None;
    for dir in dirs {
        let (m, params) = read_dir(dir, rank, Some(vectors))?;
        let path = dir.join(MANIFEST);
        if *step.get_or_insert(m.step) != m.step {
            return Err(bad(
                rank,
                format!(
                    "{}: step {} differs from the other stages' {}",
                    path.display(),
                    m.step,
                    step.unwrap_or(0)
                ),
            ));
        }
        if m.parameter_ids.len() == params.len() {
            by_id.extend(m.parameter_ids.iter().copied().zip(params));
        } else if dirs.len() == 1 && m.parameter_elements == want {
            by_position = Some(params);
        } else {
            return Err(bad(
                rank,
                format!(
                    "{}: the checkpoint's parameters ({} tensors) do not match the model's ({} tensors)",
                    path.display(),
                    m.parameter_elements.len(),
                    want.len()
                ),
            ));
        }
    }
    let mut per_slot = Vec::with_capacity(layout.slots.len());
    for (k, slot) in layout.slots.iter().enumerate() {
        let state = match &by_position {
            Some(p) => &p[k],
            None => by_id.get(&slot.id.val()).ok_or_else(|| bad(rank, format!("the checkpoint holds no optimizer state for parameter {} of the model ({} elements)", slot.id, slot.len)))?,
        };
        if state.iter().any(|v| v.len() != slot.len) {
            return Err(bad(
                rank,
                format!(
                    "parameter {}: {} elements of optimizer state, the model's has {}",
                    slot.id,
                    state[0].len(),
                    slot.len
                ),
            ));
        }
        per_slot.push(state);
    }
    let slots = (0..vectors)
        .map(|v| {
            layout.cut(
                rank,
                &per_slot.iter().map(|s| s[v].as_slice()).collect::<Vec<_>>(),
            )
        })
        .collect::<Vec<_>>()
        .into();
    Ok(ShardState {
        step: step.unwrap_or(0),
        slots,
    })
}

/// One directory's manifest and, per parameter in its order, its whole state vectors
/// (the shards joined, the padding dropped).
fn read_dir(
    dir: &Path,
    rank: usize,
    vectors: Option<usize>,
) -> DistResult<(Manifest, Vec<Vec<Vec<f32>>>)> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read(&path).map_err(|e| {
        let why = if dir.join(REPLICATED_STATE_FILE).exists() {
            format!(
                "the checkpoint holds a replicated optimizer record ({REPLICATED_STATE_FILE}) instead: it comes from a run with zero_stage 0, whose record cannot be resharded"
            )
        } else {
            "the checkpoint holds no optimizer state: it is incomplete or was damaged".into()
        };
        bad(rank, format!("{}: {e} ({why})", path.display()))
    })?;
    let m: Manifest = serde_json::from_slice(&text).map_err(|e| {
        bad(
            rank,
            format!("{}: not a valid ZeRO manifest: {e}", path.display()),
        )
    })?;
    let vectors = vectors.unwrap_or(m.state_vectors);
    if m.state_vectors != vectors {
        return Err(bad(
            rank,
            format!(
                "{}: {} state vectors per element, this optimizer keeps {vectors} (another optimizer?)",
                path.display(),
                m.state_vectors
            ),
        ));
    }
    if m.parameter_elements.iter().sum::<usize>() != m.elements {
        return Err(bad(
            rank,
            format!(
                "{}: parameter sizes add up to {}, not {}",
                path.display(),
                m.parameter_elements.iter().sum::<usize>(),
                m.elements
            ),
        ));
    }
    let slots = m
        .parameter_elements
        .iter()
        .map(|&len| Slot {
            id: ParamId::from(0),
            shape: vec![len],
            offset: 0,
            len,
            trainable: true,
        })
        .collect();
    let old = FlatLayout::from_slots(slots, m.world_size, m.partitioning);
    let old_shard = old.shard_len();
    let mut shards = vec![Vec::with_capacity(old.world); vectors];
    for r in 0..old.world {
        for (v, part) in shards
            .iter_mut()
            .zip(read_shard(dir, r, rank, vectors, old_shard)?)
        {
            v.push(part);
        }
    }
    let whole: Vec<Vec<Vec<f32>>> = shards.iter().map(|s| old.join(s)).collect();
    let params = (0..old.slots.len())
        .map(|i| whole.iter().map(|v| v[i].clone()).collect())
        .collect();
    Ok((m, params))
}

/// The optimizer state of one checkpoint directory, whole: its step and, per parameter id,
/// its state vectors (the shards joined, the padding dropped).
pub fn read_whole(dir: &Path) -> DistResult<(usize, Vec<(u64, Vec<Vec<f32>>)>)> {
    let (m, params) = read_dir(dir, 0, None)?;
    if m.parameter_ids.len() != params.len() {
        return Err(bad(
            0,
            format!(
                "{}: a manifest without parameter ids cannot be regrouped",
                dir.join(MANIFEST).display()
            ),
        ));
    }
    Ok((
        m.step,
        m.parameter_ids.iter().copied().zip(params).collect(),
    ))
}

/// Write whole per-parameter state (`params`: id and state vectors, `vectors` of them) as
/// the directory of a one-rank run at `stage` and `step`, for [`read`] to reshard.
pub fn write_whole(
    dir: &Path,
    stage: usize,
    step: usize,
    vectors: usize,
    params: &[(u64, Vec<Vec<f32>>)],
) -> DistResult<()> {
    let slots = params
        .iter()
        .map(|(id, v)| {
            let len = v.first().map_or(0, Vec::len);
            Slot {
                id: ParamId::from(*id),
                shape: vec![len],
                offset: 0,
                len,
                trainable: true,
            }
        })
        .collect();
    let layout = FlatLayout::from_slots(slots, 1, Partitioning::Contiguous);
    let state = ShardState {
        step,
        slots: (0..vectors)
            .map(|k| {
                params
                    .iter()
                    .flat_map(|(_, v)| v[k].iter().copied())
                    .collect()
            })
            .collect::<Vec<_>>()
            .into(),
    };
    std::fs::create_dir_all(dir).map_err(|e| bad(0, format!("{}: {e}", dir.display())))?;
    for (name, bytes) in write(0, stage, &layout, &state)? {
        let path = dir.join(name);
        std::fs::write(&path, bytes).map_err(|e| bad(0, format!("{}: {e}", path.display())))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two parameters (3 and 2 elements) over two ranks, two state vectors each.
    fn layout() -> FlatLayout {
        let slot = |id: u64, len: usize| Slot {
            id: ParamId::from(id),
            shape: vec![len],
            offset: 0,
            len,
            trainable: true,
        };
        FlatLayout::from_slots(vec![slot(7, 3), slot(9, 2)], 2, Partitioning::Contiguous)
    }

    /// Rank `rank`'s shard of two state vectors; the padding past the 5 elements is 0.
    fn state(rank: usize, len: usize) -> ShardState {
        let value = |k: usize, i: usize| match rank * len + i {
            5.. => 0.0,
            _ => (100 * rank + 10 * k + i) as f32 + 0.5,
        };
        ShardState {
            step: 4,
            slots: (0..2)
                .map(|k| (0..len).map(|i| value(k, i)).collect())
                .collect::<Vec<_>>()
                .into(),
        }
    }

    fn write_all(dir: &Path, legacy: bool) {
        let layout = layout();
        for rank in 0..2 {
            let s = state(rank, layout.shard_len());
            for (name, bytes) in write(rank, 1, &layout, &s).unwrap() {
                if legacy && name.ends_with(".safetensors") {
                    // The raw format of earlier checkpoints: every vector's f32, in turn.
                    let raw: Vec<u8> = s
                        .slots
                        .get()
                        .concat()
                        .iter()
                        .flat_map(|x| x.to_le_bytes())
                        .collect();
                    std::fs::write(dir.join(legacy_shard_file(rank)), raw).unwrap();
                } else {
                    std::fs::write(dir.join(name), bytes).unwrap();
                }
            }
        }
    }

    #[test]
    fn shards_are_safetensors_and_earlier_raw_shards_still_read() {
        let layout = layout();
        for legacy in [false, true] {
            let dir = std::env::temp_dir()
                .join(format!("zero-state-files-{legacy}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            write_all(&dir, legacy);
            if !legacy {
                let bytes = std::fs::read(dir.join("zero-1.safetensors")).unwrap();
                let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
                let info = meta.metadata().as_ref().unwrap();
                assert_eq!(info["rank"], "1");
                assert_eq!(info["world_size"], "2");
                assert_eq!(info["step"], "4");
            }
            for rank in 0..2 {
                let read = read(&[dir.clone()], rank, &layout, 2).unwrap();
                assert_eq!(read.step, 4);
                assert_eq!(
                    read.slots,
                    state(rank, layout.shard_len()).slots,
                    "legacy {legacy}"
                );
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}
