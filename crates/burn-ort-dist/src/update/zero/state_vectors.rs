//! Where a ZeRO shard's optimizer state vectors live: in memory, or in a memory-mapped
//! file under the offload directory (`offload_optimizer = "disk"`, ZeRO-Infinity's NVMe
//! offload of the optimizer state), whose pages the update releases parameter by
//! parameter. Either way the update reads and writes the same `f32` slices.

use std::path::Path;

use crate::storage::disk_vectors::{DiskVectors, Releaser};

/// A shard's state vectors (velocity, or Adam's two moments), each of the shard's length.
pub enum StateVectors {
    /// In memory.
    Memory(Vec<Vec<f32>>),
    /// In a mapped file.
    Disk(DiskVectors),
}

impl StateVectors {
    /// `count` zeroed vectors of `len` values: in a file under `dir` when given.
    pub fn zeros(count: usize, len: usize, dir: Option<&Path>) -> std::io::Result<Self> {
        Ok(match dir {
            Some(dir) => StateVectors::Disk(DiskVectors::create(dir, count, len)?),
            None => Self::in_memory(count, len),
        })
    }

    /// `count` zeroed vectors of `len` values in memory, each allocated zeroed (not cloned
    /// from the first, which would write every page of the copies before any is used).
    pub fn in_memory(count: usize, len: usize) -> Self {
        StateVectors::Memory((0..count).map(|_| vec![0.0; len]).collect())
    }

    /// How many vectors.
    pub fn count(&self) -> usize {
        match self {
            StateVectors::Memory(v) => v.len(),
            StateVectors::Disk(d) => d.vectors().len(),
        }
    }

    /// Bytes held in memory (none for a file: its pages come and go).
    pub fn memory_bytes(&self) -> usize {
        match self {
            StateVectors::Memory(v) => v.iter().map(Vec::len).sum::<usize>() * 4,
            StateVectors::Disk(_) => 0,
        }
    }

    /// The vectors.
    pub fn get(&self) -> Vec<&[f32]> {
        match self {
            StateVectors::Memory(v) => v.iter().map(Vec::as_slice).collect(),
            StateVectors::Disk(d) => d.vectors(),
        }
    }

    /// What releases a file's pages (none in memory).
    pub fn releaser(&self) -> Option<Releaser> {
        match self {
            StateVectors::Memory(_) => None,
            StateVectors::Disk(d) => Some(d.releaser()),
        }
    }

    /// The vectors to update, with what releases a file's pages.
    pub fn get_mut(&mut self) -> (Vec<&mut [f32]>, Option<Releaser>) {
        match self {
            StateVectors::Memory(v) => (v.iter_mut().map(Vec::as_mut_slice).collect(), None),
            StateVectors::Disk(d) => {
                let (v, r) = d.vectors_mut();
                (v, Some(r))
            }
        }
    }
}

impl From<Vec<Vec<f32>>> for StateVectors {
    fn from(v: Vec<Vec<f32>>) -> Self {
        StateVectors::Memory(v)
    }
}

/// A copy in memory.
impl Clone for StateVectors {
    fn clone(&self) -> Self {
        StateVectors::Memory(self.get().iter().map(|v| v.to_vec()).collect())
    }
}

/// Equal values, wherever they live.
impl PartialEq for StateVectors {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl std::fmt::Debug for StateVectors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateVectors::Memory(v) => write!(f, "StateVectors({} in memory)", v.len()),
            StateVectors::Disk(d) => write!(f, "StateVectors({d:?})"),
        }
    }
}
