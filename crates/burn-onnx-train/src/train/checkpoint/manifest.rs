//! Checksums of a checkpoint's files: `manifest.json`, written last, holds the size and
//! SHA-256 of every file (`sha256sum` can check them by hand), so a damaged file is found
//! before a run resumes from it or an export writes it.
//!
//! Each rank hashes the files it writes while they are in memory and leaves its list in
//! `.sums/rank-<r>.json` inside the temporary directory; rank 0 merges the lists with
//! `state.json`'s, writes the manifest and removes `.sums/` before the directory is renamed
//! into place.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{OnnxError, Result};

/// The manifest's file name.
pub const MANIFEST_FILE: &str = "manifest.json";
const SUMS_DIR: &str = ".sums";

/// One file's size and SHA-256 (lowercase hex).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSum {
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the contents, lowercase hex.
    pub sha256: String,
}

/// A writer that counts and hashes what passes through it (a file's [`FileSum`] while it
/// is written).
pub struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    bytes: u64,
}

impl<W: std::io::Write> HashingWriter<W> {
    /// Hash what goes to `inner`.
    pub fn new(inner: W) -> Self {
        HashingWriter {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
        }
    }

    /// The inner writer and the sum of everything written.
    pub fn finish(self) -> (W, FileSum) {
        let sum = FileSum {
            bytes: self.bytes,
            sha256: hex(&self.hasher.finalize()),
        };
        (self.inner, sum)
    }
}

impl<W: std::io::Write> std::io::Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl FileSum {
    /// The sum of `bytes`.
    pub fn of(bytes: &[u8]) -> FileSum {
        FileSum {
            bytes: bytes.len() as u64,
            sha256: hex(&Sha256::digest(bytes)),
        }
    }

    /// The sum of the file at `path`, read in pieces.
    fn of_file(path: &Path) -> std::io::Result<FileSum> {
        let mut f = fs::File::open(path)?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            bytes += n as u64;
        }
        Ok(FileSum {
            bytes,
            sha256: hex(&hasher.finalize()),
        })
    }
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// What `manifest.json` holds: every file of the checkpoint by its path inside it.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Manifest {
    files: BTreeMap<String, FileSum>,
}

/// Leave rank `rank`'s list of the files it wrote into the temporary checkpoint `tmp`.
pub fn write_rank_sums(tmp: &Path, rank: usize, sums: BTreeMap<String, FileSum>) -> Result<()> {
    let dir = tmp.join(SUMS_DIR);
    fs::create_dir_all(&dir).map_err(|e| OnnxError::io(&dir, e))?;
    let path = dir.join(format!("rank-{rank}.json"));
    let json =
        serde_json::to_vec(&sums).map_err(|e| OnnxError::field("checkpoint", e.to_string()))?;
    fs::write(&path, json).map_err(|e| OnnxError::io(&path, e))
}

/// Rank 0, after every rank wrote its files: the ranks' lists in the temporary checkpoint
/// `tmp` merged with `also` (the files rank 0 writes last) as the manifest's bytes, for
/// the caller to write as [`MANIFEST_FILE`]; the lists are removed.
pub fn merged_manifest(tmp: &Path, also: BTreeMap<String, FileSum>) -> Result<Vec<u8>> {
    let dir = tmp.join(SUMS_DIR);
    let mut manifest = Manifest::default();
    for entry in fs::read_dir(&dir).map_err(|e| OnnxError::io(&dir, e))? {
        let path = entry.map_err(|e| OnnxError::io(&dir, e))?.path();
        let text = fs::read(&path).map_err(|e| OnnxError::io(&path, e))?;
        let sums: BTreeMap<String, FileSum> =
            serde_json::from_slice(&text).map_err(|e| OnnxError::Decode {
                path: path.clone(),
                what: "checkpoint checksums (JSON)",
                message: e.to_string(),
            })?;
        manifest.files.extend(sums);
    }
    manifest.files.extend(also);
    fs::remove_dir_all(&dir).map_err(|e| OnnxError::io(&dir, e))?;
    serde_json::to_vec_pretty(&manifest).map_err(|e| OnnxError::field("checkpoint", e.to_string()))
}

/// How a checkpoint passed [`verify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verified {
    /// Every file the manifest lists is there, with its size and SHA-256.
    Intact,
    /// No manifest: written before checkpoints carried checksums; nothing to check.
    Unchecked,
}

/// [`verify`], with a warning when the checkpoint has no manifest to check against.
pub fn check_files(path: &Path) -> Result<()> {
    if verify(path)? == Verified::Unchecked {
        tracing::warn!(checkpoint = %path.display(), "no manifest.json (written before checkpoints carried checksums): its files are not checked");
    }
    Ok(())
}

/// Check every file of the checkpoint at `path` against its manifest. The error names the
/// damaged or missing file.
pub fn verify(path: &Path) -> Result<Verified> {
    let manifest_path = path.join(MANIFEST_FILE);
    let text = match fs::read(&manifest_path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Verified::Unchecked),
        Err(e) => return Err(OnnxError::io(&manifest_path, e)),
    };
    let manifest: Manifest = serde_json::from_slice(&text).map_err(|e| OnnxError::Decode {
        path: manifest_path.clone(),
        what: "checkpoint manifest (JSON)",
        message: e.to_string(),
    })?;
    for (name, want) in &manifest.files {
        let file = path.join(name);
        let damaged = |message: String| OnnxError::Decode {
            path: file.clone(),
            what: "checkpoint file",
            message,
        };
        let got = FileSum::of_file(&file)
            .map_err(|e| damaged(format!("{e} (listed in {MANIFEST_FILE})")))?;
        if got.bytes != want.bytes {
            return Err(damaged(format!(
                "{} bytes, the manifest says {}: the file is damaged",
                got.bytes, want.bytes
            )));
        }
        if got.sha256 != want.sha256 {
            return Err(damaged(format!(
                "SHA-256 {} differs from the manifest's {}: the file is damaged",
                got.sha256, want.sha256
            )));
        }
    }
    Ok(Verified::Intact)
}
