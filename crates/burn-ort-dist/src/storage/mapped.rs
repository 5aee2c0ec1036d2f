//! The process's shared file mappings whose pages an update may release: a part of the
//! model that lives in a memory-mapped file (ZeRO-3's parameter chunks on disk) registers
//! its mapping, and code that writes values without knowing where they live (ZeRO's
//! update) calls [`release`] on each piece once done with it. For values in a registered
//! mapping that drops their pages from the process (the page cache keeps them, the file
//! receives them); for any other memory it does nothing, since releasing ordinary memory
//! would lose it.

use std::fs::{self, File, OpenOptions};
use std::ops::Range;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Byte ranges of the registered mappings.
static MAPPED: Mutex<Vec<Range<usize>>> = Mutex::new(Vec::new());

/// Tells the offload files of one process apart (ranks on threads share the process id).
static NEXT_FILE: AtomicUsize = AtomicUsize::new(0);

/// A new file of `bytes` zeros under `dir` (created if missing), named `stem-PID-N.f32`,
/// already unlinked: it lives while the returned handle or a mapping of it does, so nothing
/// is left behind, even after a kill. Map it to use it.
pub fn unlinked_file(dir: &Path, stem: &str, bytes: u64) -> std::io::Result<File> {
    fs::create_dir_all(dir)?;
    let path = dir.join(format!(
        "{stem}-{}-{}.f32",
        std::process::id(),
        NEXT_FILE.fetch_add(1, Ordering::Relaxed)
    ));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)?;
    file.set_len(bytes)?;
    fs::remove_file(&path)?;
    Ok(file)
}

/// A registered mapping; dropping it unregisters the range (before the mapping goes).
#[derive(Debug)]
pub struct Registered(Range<usize>);

impl Drop for Registered {
    fn drop(&mut self) {
        let mut all = MAPPED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = all.iter().position(|r| r == &self.0) {
            all.swap_remove(i);
        }
    }
}

/// Register the shared file mapping of `len` bytes at `start` (page aligned, as mmap
/// returns it).
pub fn register(start: *const u8, len: usize) -> Registered {
    let r = start as usize..start as usize + len;
    MAPPED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(r.clone());
    Registered(r)
}

/// Drop the pages of `values` from this process's memory when they lie in a registered
/// mapping (rounded out to whole pages within it: a neighbour's page released early is
/// only read again); otherwise nothing.
pub fn release(values: &[f32]) {
    let (a, b) = (
        values.as_ptr() as usize,
        values.as_ptr() as usize + std::mem::size_of_val(values),
    );
    let Some(map) = MAPPED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|r| r.start <= a && b <= r.end)
        .cloned()
    else {
        return;
    };
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
    let start = a / page * page;
    let end = b.div_ceil(page) * page;
    let end = end.min(map.end.div_ceil(page) * page);
    if end > start.max(map.start) {
        let start = start.max(map.start);
        // SAFETY: the range lies inside a registered shared file mapping (its last page
        // included: the mapping covers it), where MADV_DONTNEED keeps the data (the page
        // cache holds it, the file receives it) and the next access reads it back.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of a process's own memory are never dropped (that would zero them); pages of
    /// a registered shared file mapping are, and read back with their values.
    #[test]
    fn release_drops_only_registered_file_pages_and_keeps_their_values() {
        let own: Vec<f32> = (0..4096).map(|i| i as f32).collect();
        release(&own);
        assert!(own.iter().enumerate().all(|(i, &v)| v == i as f32));

        let dir = std::env::temp_dir().join("mapped-test");
        let file = unlinked_file(&dir, "values", 4 * 4096).unwrap();
        let map = memmap2::MmapRaw::map_raw(&file).unwrap();
        // SAFETY: the mapping holds 4096 f32 values and is this test's alone.
        let values =
            unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr().cast::<f32>(), 4096) };
        values
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = i as f32);
        let registered = register(map.as_ptr(), map.len());
        release(&values[100..3000]);
        assert!(values.iter().enumerate().all(|(i, &v)| v == i as f32));
        drop(registered);
        assert!(
            MAPPED
                .lock()
                .unwrap()
                .iter()
                .all(|r| r.start != map.as_ptr() as usize)
        );
    }
}
