//! Crash-safe file writes: write a temporary file beside the target, fsync it, rename it
//! over the target, fsync the directory. A reader sees the old file or the new one, never
//! a torn one.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use crate::error::{OnnxError, Result};

/// Atomically replace `path` with `bytes`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |e| OnnxError::io(path, e);
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| OnnxError::field(path.display().to_string(), "not a file path"))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        if let Ok(d) = File::open(dir) {
            // Persist the rename; not every filesystem supports fsync on directories.
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(io)
}
