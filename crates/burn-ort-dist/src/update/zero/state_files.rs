//! ZeRO optimizer state in a checkpoint directory, resharded on load.
//!
//! Rank `r` writes `zero-<r>.safetensors`: its shard of every state vector as the f32
//! tensor `state.<k>` (Adam's `state.0` the first moments, `state.1` the second), with the
//! ZeRO stage, world size, rank and step in the file's metadata, so any safetensors reader
//! opens it (checkpoints of earlier versions hold `zero-<r>.bin`, the same vectors as raw
//! little-endian f32, one after another; both read). Rank 0 writes `zero.json`: the stage,
//! world size, step, the number of
//! state vectors, and the layout (element count and id of every parameter, in order, and
//! its partitioning), so that a run with another world size or stage can pick its
//! parameters' state by id and read the part its own shard holds. A checkpoint of a
//! pipeline holds one such directory per stage; a run with another stage count reads them
//! all and takes the parameters it holds from each.
//!
//! Neither direction copies the state whole: a shard is streamed into its file a chunk at
//! a time from where it lies (memory, or its mapped file with `offload_optimizer =
//! "disk"`), and a resuming rank maps the old shard files and reads only its new shard's
//! ranges from them.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::error::{DistError, DistResult};
use crate::storage::record::REPLICATED_STATE_FILE;
use crate::storage::record_safetensors::{Head, write_le_f32s, write_safetensors_with};
use crate::update::strategy::StateFile;
use crate::update::zero::flat_optim::ShardState;
use crate::update::zero::state_vectors::StateVectors;
use burn::module::ParamId;

use crate::update::zero::layout::{FlatLayout, Partitioning, Slot};

/// The manifest's file name.
pub const MANIFEST: &str = "zero.json";

fn shard_file(rank: usize) -> String {
    format!("zero-{rank}.safetensors")
}

/// The shard file of checkpoints written before shards were safetensors.
fn legacy_shard_file(rank: usize) -> String {
    format!("zero-{rank}.bin")
}

/// Values of a shard's vector written (and their file pages released) at a time.
const WRITE_CHUNK: usize = 1 << 16;

/// Write rank `rank`'s shard as a safetensors file to `w`: `state.<k>` per state vector,
/// streamed from where the vectors lie (memory or their mapped file, whose pages are
/// released as they are written) a chunk at a time, so the shard is never copied whole.
fn write_shard(
    w: &mut dyn std::io::Write,
    rank: usize,
    stage: usize,
    world: usize,
    state: &ShardState,
) -> DistResult<()> {
    let vectors = state.slots.get();
    let heads: Vec<Head> = vectors
        .iter()
        .enumerate()
        .map(|(k, v)| Head {
            name: format!("state.{k}"),
            dtype: safetensors::Dtype::F32,
            shape: vec![v.len()],
            bytes: v.len() * 4,
        })
        .collect();
    let metadata = BTreeMap::from([
        (
            "format".to_string(),
            "burn-ort ZeRO optimizer-state shard".to_string(),
        ),
        ("zero_stage".to_string(), stage.to_string()),
        ("world_size".to_string(), world.to_string()),
        ("rank".to_string(), rank.to_string()),
        ("step".to_string(), state.step.to_string()),
    ]);
    let releaser = state.slots.releaser();
    write_safetensors_with(w, &heads, &metadata, |k, w| {
        for (i, chunk) in vectors[k].chunks(WRITE_CHUNK).enumerate() {
            write_le_f32s(w, chunk)
                .map_err(|e| bad(rank, format!("cannot write {}: {e}", shard_file(rank))))?;
            if let Some(r) = &releaser {
                r.release(i * WRITE_CHUNK..i * WRITE_CHUNK + chunk.len());
            }
        }
        Ok(())
    })
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

/// The files rank `rank` contributes to a checkpoint: its shard, streamed when written,
/// and on rank 0 the manifest.
pub fn write<'a>(
    rank: usize,
    stage: usize,
    layout: &FlatLayout,
    state: impl std::borrow::Borrow<ShardState> + 'a,
) -> DistResult<Vec<StateFile<'a>>> {
    let world = layout.world;
    let (step, count) = (state.borrow().step, state.borrow().slots.count());
    let mut files = vec![StateFile::stream(shard_file(rank), move |w| {
        write_shard(w, rank, stage, world, state.borrow())
    })];
    if rank == 0 {
        let manifest = Manifest {
            stage,
            world_size: layout.world,
            step,
            state_vectors: count,
            elements: layout.len,
            parameter_elements: layout.slots.iter().map(|s| s.len).collect(),
            parameter_ids: layout.slots.iter().map(|s| s.id.val()).collect(),
            partitioning: layout.partitioning,
        };
        let json = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| bad(rank, format!("cannot encode {MANIFEST}: {e}")))?;
        files.push(StateFile::bytes(MANIFEST, json));
    }
    Ok(files)
}

/// One checkpoint directory's shards, mapped: the layout that wrote them and each rank's
/// file, read where a parameter's state is asked for (no shard is copied whole).
struct Shards {
    manifest: Manifest,
    /// The writing run's layout (parameters by position).
    layout: FlatLayout,
    /// Per writing rank: its mapped file and where each state vector's data starts in it.
    files: Vec<(memmap2::Mmap, Vec<usize>)>,
    /// Per-tensor partitioning: where each parameter's chunk starts in a shard.
    starts: Vec<usize>,
}

impl Shards {
    /// The manifest and shard files of `dir`, for an optimizer keeping `vectors` state
    /// vectors per element (`None`: as many as the manifest says).
    fn open(dir: &Path, rank: usize, vectors: Option<usize>) -> DistResult<Shards> {
        let (manifest, layout) = read_manifest(dir, rank, vectors)?;
        let files = (0..layout.world)
            .map(|r| map_shard(dir, r, rank, manifest.state_vectors, layout.shard_len()))
            .collect::<DistResult<Vec<_>>>()?;
        let starts = (0..layout.slots.len())
            .scan(0, |at, i| {
                let start = *at;
                *at += layout.chunk(i);
                Some(start)
            })
            .collect();
        Ok(Shards {
            manifest,
            layout,
            files,
            starts,
        })
    }

    /// Elements `p..p + dst.len()` of state vector `v` of parameter `slot` (by position),
    /// the file pages they came from released again.
    fn copy(&self, slot: usize, v: usize, mut p: usize, dst: &mut [f32]) {
        let mut done = 0;
        while done < dst.len() {
            let (r, local, room) = match self.layout.partitioning {
                Partitioning::Contiguous => {
                    let (n, flat) = (self.layout.shard_len(), self.layout.slots[slot].offset + p);
                    (flat / n, flat % n, n - flat % n)
                }
                Partitioning::PerTensor => {
                    let c = self.layout.chunk(slot);
                    (p / c, self.starts[slot] + p % c, c - p % c)
                }
            };
            let take = room.min(dst.len() - done);
            let (file, offsets) = &self.files[r];
            let at = offsets[v] + local * 4;
            for (d, b) in dst[done..done + take]
                .iter_mut()
                .zip(file[at..at + take * 4].chunks_exact(4))
            {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            // SAFETY: MADV_DONTNEED on a read-only file mapping only drops the pages from
            // this process (the page cache keeps them; a later read maps them again).
            let _ = unsafe {
                file.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, at, take * 4)
            };
            done += take;
            p += take;
        }
    }

    /// The whole state vectors of parameter `slot`.
    fn whole(&self, slot: usize) -> Vec<Vec<f32>> {
        (0..self.manifest.state_vectors)
            .map(|v| {
                let mut out = vec![0.0; self.layout.slots[slot].len];
                self.copy(slot, v, 0, &mut out);
                out
            })
            .collect()
    }
}

/// Shard file `r` of `dir` mapped, with the byte offset of each of its `vectors` state
/// vectors of `len` values (safetensors, or the raw f32 of earlier checkpoints).
fn map_shard(
    dir: &Path,
    r: usize,
    rank: usize,
    vectors: usize,
    len: usize,
) -> DistResult<(memmap2::Mmap, Vec<usize>)> {
    let p = dir.join(shard_file(r));
    let legacy = !p.exists();
    let path = if legacy {
        dir.join(legacy_shard_file(r))
    } else {
        p.clone()
    };
    let file =
        std::fs::File::open(&path).map_err(|e| bad(rank, format!("{}: {e}", p.display())))?;
    // SAFETY: checkpoint files are written once, whole, and renamed into place; nothing
    // writes them while a run reads them.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| bad(rank, format!("{}: {e}", path.display())))?;
    if legacy {
        if map.len() != len * vectors * 4 {
            return Err(bad(
                rank,
                format!(
                    "{}: {} bytes, expected {} ({vectors} x {len} f32)",
                    path.display(),
                    map.len(),
                    len * vectors * 4
                ),
            ));
        }
        return Ok((map, (0..vectors).map(|k| k * len * 4).collect()));
    }
    let offsets = {
        let file = safetensors::SafeTensors::deserialize(&map).map_err(|e| {
            bad(
                rank,
                format!("{}: not a safetensors file: {e}", path.display()),
            )
        })?;
        (0..vectors)
            .map(|k| {
                let t = file
                    .tensor(&format!("state.{k}"))
                    .map_err(|e| bad(rank, format!("{}: state.{k}: {e}", path.display())))?;
                if t.dtype() != safetensors::Dtype::F32 || t.data().len() != len * 4 {
                    return Err(bad(
                        rank,
                        format!(
                            "{}: state.{k} is {:?} {:?}, expected F32 [{len}]",
                            path.display(),
                            t.dtype(),
                            t.shape()
                        ),
                    ));
                }
                Ok(t.data().as_ptr() as usize - map.as_ptr() as usize)
            })
            .collect::<DistResult<Vec<_>>>()?
    };
    Ok((map, offsets))
}

/// Rank `rank`'s state for `layout`, from the shards of whatever world size and
/// partitioning wrote `dirs` (one directory, or one per pipeline stage of the run that
/// wrote them), placed in a file under `place` when given (in memory otherwise). Only this
/// rank's part of each parameter's state is read, from the mapped shard files, straight
/// into where it will live: memory never holds the whole state, and with `place` not even
/// this rank's shard (each piece's pages are released once written).
pub fn read(
    dirs: &[PathBuf],
    rank: usize,
    layout: &FlatLayout,
    vectors: usize,
    place: Option<&Path>,
) -> DistResult<ShardState> {
    let want: Vec<usize> = layout.slots.iter().map(|s| s.len).collect();
    let shards = dirs
        .iter()
        .map(|d| Shards::open(d, rank, Some(vectors)))
        .collect::<DistResult<Vec<_>>>()?;
    let mut step = None;
    // Where each parameter's state is: by id, or by position in a single legacy directory.
    let mut by_id: HashMap<u64, (usize, usize)> = HashMap::new();
    let mut by_position = false;
    for (d, (dir, old)) in dirs.iter().zip(&shards).enumerate() {
        let (m, path) = (&old.manifest, dir.join(MANIFEST));
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
        if m.parameter_ids.len() == m.parameter_elements.len() {
            by_id.extend(
                m.parameter_ids
                    .iter()
                    .enumerate()
                    .map(|(i, &id)| (id, (d, i))),
            );
        } else if dirs.len() == 1 && m.parameter_elements == want {
            by_position = true;
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
    let mut sources = Vec::with_capacity(layout.slots.len());
    for (k, slot) in layout.slots.iter().enumerate() {
        let (d, i) = if by_position {
            (0, k)
        } else {
            *by_id.get(&slot.id.val()).ok_or_else(|| bad(rank, format!("the checkpoint holds no optimizer state for parameter {} of the model ({} elements)", slot.id, slot.len)))?
        };
        let len = shards[d].layout.slots[i].len;
        if len != slot.len {
            return Err(bad(
                rank,
                format!(
                    "parameter {}: {len} elements of optimizer state, the model's has {}",
                    slot.id, slot.len
                ),
            ));
        }
        sources.push((d, i));
    }
    let mut slots = StateVectors::zeros(vectors, layout.shard_len(), place)
        .map_err(|e| bad(rank, format!("optimizer state on disk: {e}")))?;
    let (mut out, releaser) = slots.get_mut();
    for piece in layout.pieces(rank) {
        let slot = &layout.slots[piece.slot];
        let first = match layout.partitioning {
            Partitioning::Contiguous => layout.shard(rank).start + piece.local.start - slot.offset,
            Partitioning::PerTensor => rank * layout.chunk(piece.slot),
        };
        let (d, i) = sources[piece.slot];
        for (v, out) in out.iter_mut().enumerate() {
            shards[d].copy(i, v, first, &mut out[piece.local.clone()]);
        }
        if let Some(r) = &releaser {
            r.release(piece.local.clone());
        }
    }
    drop(out);
    Ok(ShardState {
        step: step.unwrap_or(0),
        slots,
    })
}

/// `dir`'s manifest, checked against an optimizer keeping `vectors` state vectors per
/// element (`None`: any), and the layout of the run that wrote it.
fn read_manifest(
    dir: &Path,
    rank: usize,
    vectors: Option<usize>,
) -> DistResult<(Manifest, FlatLayout)> {
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
    let layout = FlatLayout::from_slots(slots, m.world_size, m.partitioning);
    Ok((m, layout))
}

/// The optimizer state of one checkpoint directory, whole: its step and, per parameter id,
/// its state vectors (the shards joined, the padding dropped).
pub fn read_whole(dir: &Path) -> DistResult<(usize, Vec<(u64, Vec<Vec<f32>>)>)> {
    let shards = Shards::open(dir, 0, None)?;
    let m = &shards.manifest;
    if m.parameter_ids.len() != m.parameter_elements.len() {
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
        m.parameter_ids
            .iter()
            .enumerate()
            .map(|(i, &id)| (id, shards.whole(i)))
            .collect(),
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
    for file in write(0, stage, &layout, &state)? {
        let path = dir.join(&file.name);
        let mut out = std::fs::File::create(&path)
            .map(std::io::BufWriter::new)
            .map_err(|e| bad(0, format!("{}: {e}", path.display())))?;
        file.write_to(&mut out)?;
        std::io::Write::flush(&mut out).map_err(|e| bad(0, format!("{}: {e}", path.display())))?;
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
            for file in write(rank, 1, &layout, &s).unwrap() {
                if legacy && file.name.ends_with(".safetensors") {
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
                    let mut bytes = Vec::new();
                    let name = file.name.clone();
                    file.write_to(&mut bytes).unwrap();
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
                let read = read(&[dir.clone()], rank, &layout, 2, None).unwrap();
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

    /// Shards written by every world size (1-4) and partitioning read back into every
    /// other: each rank gets its cut of the whole state (chunk boundaries that do not line
    /// up included: 4 ranks' chunks read by 3).
    #[test]
    fn any_layout_reshards_into_any_other() {
        let params = [(1u64, 5usize), (2, 7), (3, 1)];
        let slots = || {
            params
                .iter()
                .map(|&(id, len)| Slot {
                    id: ParamId::from(id),
                    shape: vec![len],
                    offset: 0,
                    len,
                    trainable: true,
                })
                .collect::<Vec<_>>()
        };
        let whole: Vec<Vec<Vec<f32>>> = (0..2)
            .map(|k| {
                params
                    .iter()
                    .map(|&(id, len)| {
                        (0..len)
                            .map(|i| (100 * k + 10 * id as usize + i) as f32)
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let cut = |layout: &FlatLayout, rank: usize, k: usize| {
            let parts: Vec<&[f32]> = whole[k].iter().map(Vec::as_slice).collect();
            layout.cut(rank, &parts)
        };
        let layouts = |world: usize| {
            [Partitioning::Contiguous, Partitioning::PerTensor]
                .map(|p| FlatLayout::from_slots(slots(), world, p))
        };
        for from in (1..=4).flat_map(layouts) {
            let dir = std::env::temp_dir().join(format!(
                "zero-reshard-{}-{:?}-{}",
                from.world,
                from.partitioning,
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            for rank in 0..from.world {
                let state = ShardState {
                    step: 7,
                    slots: (0..2)
                        .map(|k| cut(&from, rank, k))
                        .collect::<Vec<_>>()
                        .into(),
                };
                for file in write(rank, 1, &from, &state).unwrap() {
                    let mut bytes = Vec::new();
                    let name = file.name.clone();
                    file.write_to(&mut bytes).unwrap();
                    std::fs::write(dir.join(name), bytes).unwrap();
                }
            }
            for to in (1..=4).flat_map(layouts) {
                for rank in 0..to.world {
                    let got = read(&[dir.clone()], rank, &to, 2, None).unwrap();
                    assert_eq!(got.step, 7);
                    let want: Vec<Vec<f32>> = (0..2).map(|k| cut(&to, rank, k)).collect();
                    assert_eq!(
                        got.slots.get(),
                        want.iter().map(Vec::as_slice).collect::<Vec<_>>(),
                        "{} {:?} ranks -> rank {rank} of {} {:?}",
                        from.world,
                        from.partitioning,
                        to.world,
                        to.partitioning
                    );
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
