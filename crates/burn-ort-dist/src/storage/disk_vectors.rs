//! Optimizer state on disk (ZeRO-Infinity's NVMe offload, for the CPU update): the state
//! vectors (Adam's two moments; SGD's velocity) of a flat buffer or of a ZeRO shard live in
//! one memory-mapped file under the offload directory, and the update releases each
//! parameter's pages as soon as it is done with them, so the process keeps one parameter's
//! state resident at a time instead of all of it. The kernel writes the released pages
//! back to the file and reads them again at the next update. The file is unlinked as soon
//! as it is mapped: nothing is left behind, even after a kill.

use std::ops::Range;
use std::path::Path;

use memmap2::MmapMut;

/// `count` vectors of `len` values each, in a file-backed mapping.
pub struct DiskVectors {
    map: MmapMut,
    count: usize,
    len: usize,
}

impl std::fmt::Debug for DiskVectors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DiskVectors({} x {} on disk)", self.count, self.len)
    }
}

impl DiskVectors {
    /// `count` zeroed vectors of `len` values in a new file under `dir`.
    pub fn create(dir: &Path, count: usize, len: usize) -> std::io::Result<Self> {
        let bytes = (count.max(1) * len.max(1) * 4) as u64;
        let file = crate::storage::mapped::unlinked_file(dir, "optimizer-state", bytes)?;
        // SAFETY: the file is this process's own (created and unlinked above), so no one
        // else truncates or writes it while it is mapped.
        let map = unsafe { MmapMut::map_mut(&file)? };
        Ok(DiskVectors { map, count, len })
    }

    /// The vectors.
    pub fn vectors(&self) -> Vec<&[f32]> {
        // SAFETY: the mapping is page aligned and holds count * len f32 values.
        let all = unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().cast::<f32>(), self.count * self.len)
        };
        all.chunks(self.len.max(1)).take(self.count).collect()
    }

    /// What drops ranges of the vectors' pages from this process's memory.
    pub fn releaser(&self) -> Releaser {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
        Releaser {
            base: self.map.as_ptr() as usize,
            count: self.count,
            len: self.len,
            page,
        }
    }

    /// The vectors, to update, with what releases their pages.
    pub fn vectors_mut(&mut self) -> (Vec<&mut [f32]>, Releaser) {
        let releaser = self.releaser();
        // SAFETY: as in `vectors`, borrowed mutably through `self`.
        let all = unsafe {
            std::slice::from_raw_parts_mut(
                self.map.as_mut_ptr().cast::<f32>(),
                self.count * self.len,
            )
        };
        let vectors = all.chunks_mut(self.len.max(1)).take(self.count).collect();
        (vectors, releaser)
    }
}

/// Drops ranges of the vectors from this process's memory (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Releaser {
    base: usize,
    count: usize,
    len: usize,
    page: usize,
}

impl Releaser {
    /// Release the pages of values `range` of every vector (rounded out to whole pages:
    /// a neighbour's page released early is only read again).
    pub fn release(&self, range: Range<usize>) {
        let page = self.page;
        for first in (0..self.count).map(|k| k * self.len) {
            let start = (self.base + (first + range.start) * 4) / page * page;
            let end = (self.base + (first + range.end) * 4).div_ceil(page) * page;
            let limit = self.base + self.count * self.len * 4;
            let end = end.min(limit.div_ceil(page) * page);
            if end > start {
                // SAFETY: the range lies inside the shared file mapping; MADV_DONTNEED on
                // a shared mapping keeps the data (the page cache holds it and the file
                // receives it), the next access reads it back.
                unsafe {
                    libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
                }
            }
        }
    }
}
