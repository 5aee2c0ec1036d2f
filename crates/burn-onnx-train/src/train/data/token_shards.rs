//! Token shards read in place: memory-mapped and widened to `i64` one window at a time, so
//! a token stream larger than memory trains (nanoGPT's OpenWebText `train.bin` is 9 G
//! tokens: 17 GB as u16, 72 GB widened to i64 in RAM).
//!
//! Formats:
//! * `.npy`: a 1-D array of 8-, 16-, 32- or 64-bit integers, little-endian, C order.
//! * `.bin` with llm.c's header (256 little-endian i32: magic 20240520, version 1 for u16
//!   tokens or 2 for u32, the token count), tokens from byte 1024.
//! * any other `.bin`: nanoGPT's raw little-endian u16 tokens (`np.memmap(..., np.uint16)`).

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use npyz::{DType, NpyFile, TypeChar};

use crate::error::{OnnxError, Result};

/// llm.c's `.bin` header: 256 i32, the first being this magic number.
const LLMC_MAGIC: i32 = 20240520;
const LLMC_HEADER_BYTES: usize = 256 * 4;

/// How one shard stores a token id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
}

impl TokenType {
    fn bytes(self) -> usize {
        match self {
            TokenType::U8 | TokenType::I8 => 1,
            TokenType::U16 | TokenType::I16 => 2,
            TokenType::U32 | TokenType::I32 => 4,
            TokenType::U64 | TokenType::I64 => 8,
        }
    }

    /// The id stored little-endian in `b` (`self.bytes()` long); u64 above i64::MAX wraps,
    /// as a C cast would.
    fn decode(self, b: &[u8]) -> i64 {
        let mut w = [0u8; 8];
        w[..b.len()].copy_from_slice(b);
        let raw = u64::from_le_bytes(w);
        match self {
            TokenType::U8 | TokenType::U16 | TokenType::U32 | TokenType::U64 => raw as i64,
            TokenType::I8 => raw as u8 as i8 as i64,
            TokenType::I16 => raw as u16 as i16 as i64,
            TokenType::I32 => raw as u32 as i32 as i64,
            TokenType::I64 => raw as i64,
        }
    }
}

/// One memory-mapped shard.
struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Where the tokens start in the file.
    offset: usize,
    len: usize,
    ty: TokenType,
}

fn bad(path: &Path, m: impl std::fmt::Display) -> OnnxError {
    OnnxError::field(path.display().to_string(), m.to_string())
}

impl Shard {
    fn open(path: &Path) -> Result<Shard> {
        let file = File::open(path).map_err(|e| OnnxError::io(path, e))?;
        // SAFETY: the map is read-only; a shard rewritten while training changes the
        // tokens read, as it would for any reader, but cannot break memory safety beyond
        // what memmap2 documents (the file is not truncated under us by our own code).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| OnnxError::io(path, e))?;
        let is_npy = path.extension().is_some_and(|x| x == "npy");
        let (offset, ty, len) = if is_npy {
            npy_layout(path, &map)?
        } else {
            bin_layout(path, &map)?
        };
        let needed = offset + len * ty.bytes();
        if map.len() < needed {
            return Err(bad(
                path,
                format!(
                    "the file holds {} bytes, its header promises {needed}",
                    map.len()
                ),
            ));
        }
        Ok(Shard {
            path: path.to_path_buf(),
            map,
            offset,
            len,
            ty,
        })
    }

    /// Append tokens `from..to` of this shard to `out`.
    fn read(&self, from: usize, to: usize, out: &mut Vec<i64>) {
        let size = self.ty.bytes();
        let bytes = &self.map[self.offset + from * size..self.offset + to * size];
        out.extend(bytes.chunks_exact(size).map(|b| self.ty.decode(b)));
    }

    fn ids(&self) -> impl Iterator<Item = i64> + '_ {
        let size = self.ty.bytes();
        self.map[self.offset..self.offset + self.len * size]
            .chunks_exact(size)
            .map(|b| self.ty.decode(b))
    }
}

/// `(data offset, token type, token count)` of a 1-D integer `.npy` file.
fn npy_layout(path: &Path, map: &[u8]) -> Result<(usize, TokenType, usize)> {
    let header = NpyFile::new(BufReader::new(map)).map_err(|e| bad(path, e))?;
    let shape = header.shape().to_vec();
    let DType::Plain(ty) = header.dtype() else {
        return Err(bad(path, "structured dtypes are not token shards"));
    };
    if header.order() != npyz::Order::C {
        return Err(bad(path, "Fortran-order arrays are not token shards"));
    }
    let ty_name = ty.to_string();
    if ty.endianness() == npyz::Endianness::Big && ty.size_field() > 1 {
        return Err(bad(
            path,
            format!("big-endian {ty_name} tokens are not supported"),
        ));
    }
    let token = match (ty.type_char(), ty.size_field()) {
        (TypeChar::Uint, 1) => TokenType::U8,
        (TypeChar::Int, 1) => TokenType::I8,
        (TypeChar::Uint, 2) => TokenType::U16,
        (TypeChar::Int, 2) => TokenType::I16,
        (TypeChar::Uint, 4) => TokenType::U32,
        (TypeChar::Int, 4) => TokenType::I32,
        (TypeChar::Uint, 8) => TokenType::U64,
        (TypeChar::Int, 8) => TokenType::I64,
        _ => {
            return Err(bad(
                path,
                format!("token shard must be 1-D integers, got dtype {ty_name} {shape:?}"),
            ));
        }
    };
    let [len] = shape[..] else {
        return Err(bad(
            path,
            format!("token shard must be 1-D integers, got shape {shape:?}"),
        ));
    };
    // The header: magic (6), version (2), its length (u16 in version 1, u32 after), text.
    let offset = match map.get(6) {
        Some(1) => 10 + u16::from_le_bytes([map[8], map[9]]) as usize,
        Some(_) if map.len() >= 12 => {
            12 + u32::from_le_bytes([map[8], map[9], map[10], map[11]]) as usize
        }
        _ => return Err(bad(path, "truncated .npy header")),
    };
    Ok((offset, token, len as usize))
}

/// `(data offset, token type, token count)` of a `.bin` shard: llm.c's when it starts
/// with llm.c's header, else nanoGPT's raw u16.
fn bin_layout(path: &Path, map: &[u8]) -> Result<(usize, TokenType, usize)> {
    let word = |i: usize| -> Option<i32> {
        map.get(4 * i..4 * i + 4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if word(0) == Some(LLMC_MAGIC) {
        let ty = match word(1) {
            Some(1) => TokenType::U16,
            Some(2) => TokenType::U32,
            v => {
                return Err(bad(
                    path,
                    format!("llm.c header version {v:?}: 1 (u16 tokens) or 2 (u32) expected"),
                ));
            }
        };
        let count = word(2).unwrap_or(-1);
        let len = usize::try_from(count)
            .map_err(|_| bad(path, format!("llm.c header token count {count}")))?;
        return Ok((LLMC_HEADER_BYTES, ty, len));
    }
    if map.len() % 2 != 0 {
        return Err(bad(
            path,
            format!(
                "{} bytes: not whole u16 tokens (nanoGPT's raw .bin) and no llm.c header",
                map.len()
            ),
        ));
    }
    Ok((0, TokenType::U16, map.len() / 2))
}

/// Token shards laid end to end as one stream, read in place.
pub struct TokenShards {
    shards: Vec<Shard>,
    /// Where each shard starts in the stream; one more entry: the stream's length.
    starts: Vec<usize>,
}

impl TokenShards {
    /// Map `files` in this order.
    pub fn open(files: &[PathBuf]) -> Result<Self> {
        let shards = files
            .iter()
            .map(|f| Shard::open(f))
            .collect::<Result<Vec<_>>>()?;
        let mut starts = vec![0];
        for s in &shards {
            starts.push(starts.last().copied().unwrap_or(0) + s.len);
        }
        Ok(TokenShards { shards, starts })
    }

    /// Tokens in the stream.
    pub fn len(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    /// True when the shards hold no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Append tokens `from..to` of the stream to `out` (a window may span shards).
    pub fn read(&self, from: usize, to: usize, out: &mut Vec<i64>) {
        let first = self
            .starts
            .partition_point(|&s| s <= from)
            .saturating_sub(1);
        let mut at = from;
        for (shard, &start) in self.shards[first..].iter().zip(&self.starts[first..]) {
            if at >= to {
                break;
            }
            let end = (start + shard.len).min(to);
            if end > at {
                shard.read(at - start, end - start, out);
                at = end;
            }
        }
    }

    /// Every token id, in stream order.
    pub fn ids(&self) -> impl Iterator<Item = i64> + '_ {
        self.shards.iter().flat_map(Shard::ids)
    }

    /// Each shard's file name and where it starts in the stream.
    pub fn sources(&self) -> Vec<(String, usize)> {
        self.shards
            .iter()
            .zip(&self.starts)
            .map(|(s, &start)| (s.path.display().to_string(), start))
            .collect()
    }
}
