//! ZeRO optimizer state in a checkpoint directory, resharded on load.
//!
//! Rank `r` writes `zero-<r>.bin`: its shard of every state vector, little-endian f32, one
//! after another. Rank 0 writes `zero.json`: the stage, world size, step, the number of
//! state vectors, and the layout (element count of every parameter, in order), so that a
//! run with another world size or stage can check the layout, concatenate the old shards,
//! drop the old padding and cut its own shard.

use std::path::Path;

use crate::error::{DistError, DistResult};
use crate::zero::flat_optim::ShardState;
use crate::zero::layout::FlatLayout;

/// The manifest's file name.
pub const MANIFEST: &str = "zero.json";

fn shard_file(rank: usize) -> String {
    format!("zero-{rank}.bin")
}

fn bad(rank: usize, message: String) -> DistError {
    DistError::Invalid { rank, message }
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
}

/// The files rank `rank` contributes to a checkpoint.
pub fn write(rank: usize, stage: usize, layout: &FlatLayout, state: &ShardState) -> DistResult<Vec<(String, Vec<u8>)>> {
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
        };
        let json = serde_json::to_vec_pretty(&manifest).map_err(|e| bad(rank, format!("cannot encode {MANIFEST}: {e}")))?;
        files.push((MANIFEST.into(), json));
    }
    Ok(files)
}

/// Rank `rank`'s state for `layout`, from the shards of whatever world size wrote `dir`.
pub fn read(dir: &Path, rank: usize, layout: &FlatLayout, vectors: usize) -> DistResult<ShardState> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read(&path).map_err(|e| {
        bad(rank, format!("{}: {e} (the checkpoint has no ZeRO state: it comes from a run with zero_stage 0, whose optimizer record cannot be resharded)", path.display()))
    })?;
    let m: Manifest = serde_json::from_slice(&text).map_err(|e| bad(rank, format!("{}: not a valid ZeRO manifest: {e}", path.display())))?;
    let (world, step, saved_vectors, sizes) = (m.world_size, m.step, m.state_vectors, m.parameter_elements);
    let want: Vec<usize> = layout.slots.iter().map(|s| s.len).collect();
    if sizes != want {
        return Err(bad(rank, format!("{}: the checkpoint's parameters ({} tensors) do not match the model's ({} tensors)", path.display(), sizes.len(), want.len())));
    }
    if saved_vectors != vectors {
        return Err(bad(rank, format!("{}: {saved_vectors} state vectors per element, this optimizer keeps {vectors} (another optimizer?)", path.display())));
    }
    let old_padded = layout.len.div_ceil(world.max(1)) * world.max(1);
    let old_shard = old_padded / world.max(1);
    let mut full = vec![Vec::with_capacity(old_padded); vectors];
    for r in 0..world {
        let p = dir.join(shard_file(r));
        let bytes = std::fs::read(&p).map_err(|e| bad(rank, format!("{}: {e}", p.display())))?;
        if bytes.len() != old_shard * vectors * 4 {
            return Err(bad(rank, format!("{}: {} bytes, expected {} ({vectors} x {old_shard} f32)", p.display(), bytes.len(), old_shard * vectors * 4)));
        }
        for (k, v) in full.iter_mut().enumerate() {
            let part = &bytes[k * old_shard * 4..(k + 1) * old_shard * 4];
            v.extend(part.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        }
    }
    let mine = layout.shard(rank);
    let slots = full
        .into_iter()
        .map(|mut v| {
            v.truncate(layout.len);
            v.resize(layout.padded, 0.0);
            v[mine.clone()].to_vec()
        })
        .collect();
    Ok(ShardState { step, slots })
}
