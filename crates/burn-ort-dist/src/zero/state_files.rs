//! ZeRO optimizer state in a checkpoint directory, resharded on load.
//!
//! Rank `r` writes `zero-<r>.bin`: its shard of every state vector, little-endian f32, one
//! after another. Rank 0 writes `zero.json`: the stage, world size, step, the number of
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
    format!("zero-{rank}.bin")
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
    let mut bytes = Vec::with_capacity(state.slots.iter().map(Vec::len).sum::<usize>() * 4);
    for v in &state.slots {
        bytes.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    }
    let mut files = vec![(shard_file(rank), bytes)];
    if rank == 0 {
        let manifest = Manifest {
            stage,
            world_size: layout.world,
            step: state.step,
            state_vectors: state.slots.len(),
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
        .collect();
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
        let p = dir.join(shard_file(r));
        let bytes = std::fs::read(&p).map_err(|e| bad(rank, format!("{}: {e}", p.display())))?;
        if bytes.len() != old_shard * vectors * 4 {
            return Err(bad(
                rank,
                format!(
                    "{}: {} bytes, expected {} ({vectors} x {old_shard} f32)",
                    p.display(),
                    bytes.len(),
                    old_shard * vectors * 4
                ),
            ));
        }
        for (k, v) in shards.iter_mut().enumerate() {
            let part = &bytes[k * old_shard * 4..(k + 1) * old_shard * 4];
            v.push(
                part.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect::<Vec<f32>>(),
            );
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
            .collect(),
    };
    std::fs::create_dir_all(dir).map_err(|e| bad(0, format!("{}: {e}", dir.display())))?;
    for (name, bytes) in write(0, stage, &layout, &state)? {
        let path = dir.join(name);
        std::fs::write(&path, bytes).map_err(|e| bad(0, format!("{}: {e}", path.display())))?;
    }
    Ok(())
}
