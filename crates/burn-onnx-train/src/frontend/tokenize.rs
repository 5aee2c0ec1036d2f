//! Text to token shards with a Hugging Face `tokenizer.json` (`onnx-train tokenize`): the
//! documents are encoded in parallel batches, an end-of-document token is appended to each
//! when asked (GPT-2's `<|endoftext|>`, as nanoGPT's OpenWebText preparation does), and the
//! stream is cut into `.npy` shards of uint16 ids (uint32 when the vocabulary does not fit
//! 16 bits) that [`crate::train::data::TokenDataset`] memory-maps, with
//! `documents.idx.npy` beside them: where each document starts in the stream, then the
//! stream's length (what `data.sequences = "documents"` and `"packed"` read).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use crate::error::{OnnxError, Result};
use crate::train::data::npy::write_npy_1d;

/// Lines encoded per parallel batch (`--per-line`).
const LINES_PER_BATCH: usize = 4096;

/// What `tokenize` reads and how it cuts the stream.
#[derive(Debug, Clone)]
pub struct TokenizeOptions {
    /// The Hugging Face `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// UTF-8 text files, in stream order.
    pub files: Vec<PathBuf>,
    /// Where the shards go: `tokens_00000.npy`, `tokens_00001.npy`, ...
    pub output: PathBuf,
    /// Tokens per shard (the last one may hold fewer).
    pub shard_tokens: usize,
    /// Each non-empty line is a document (else each file is one).
    pub per_line: bool,
    /// A token of the tokenizer's vocabulary appended after every document.
    pub eos: Option<String>,
}

/// What `tokenize` wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizeSummary {
    /// Documents encoded.
    pub documents: usize,
    /// Token ids written, end-of-document tokens included.
    pub tokens: usize,
    /// Shard files written, in order.
    pub shards: Vec<PathBuf>,
    /// `u16` or `u32`.
    pub dtype: &'static str,
    /// The documents' start positions (`documents.idx.npy`).
    pub index: PathBuf,
}

/// Encode `o.files` with `o.tokenizer` and write the token shards.
pub fn tokenize(o: &TokenizeOptions) -> Result<TokenizeSummary> {
    if o.shard_tokens == 0 {
        return Err(OnnxError::field("--shard-tokens", "must be at least 1"));
    }
    let tokenizer = Tokenizer::from_file(&o.tokenizer)
        .map_err(|e| OnnxError::field(o.tokenizer.display().to_string(), e.to_string()))?;
    let eos = match &o.eos {
        Some(t) => Some(tokenizer.token_to_id(t).ok_or_else(|| {
            OnnxError::field(
                "--eos",
                format!("'{t}' is not in {}'s vocabulary", o.tokenizer.display()),
            )
        })?),
        None => None,
    };
    let wide = tokenizer.get_vocab_size(true) > usize::from(u16::MAX) + 1;
    std::fs::create_dir_all(&o.output).map_err(|e| OnnxError::io(&o.output, e))?;
    let mut out = ShardWriter {
        dir: o.output.clone(),
        shard_tokens: o.shard_tokens,
        wide,
        pending: Vec::new(),
        shards: Vec::new(),
        written: 0,
    };
    let mut documents = 0;
    let mut starts: Vec<i64> = Vec::new();
    for file in &o.files {
        for batch in documents_of(file, o.per_line)? {
            let encoded = tokenizer
                .encode_batch(batch?, false)
                .map_err(|e| OnnxError::field(file.display().to_string(), e.to_string()))?;
            for doc in encoded {
                documents += 1;
                starts.push((out.written + out.pending.len()) as i64);
                out.push(doc.get_ids().iter().copied().chain(eos))?;
            }
        }
    }
    out.finish()?;
    starts.push(out.written as i64);
    let index = o.output.join(crate::train::data::documents::DOCUMENT_INDEX);
    write_npy_1d(&index, &starts)?;
    Ok(TokenizeSummary {
        documents,
        tokens: out.written,
        shards: out.shards,
        dtype: if wide { "u32" } else { "u16" },
        index,
    })
}

/// The documents of `file` in batches: the whole file as one, or its non-empty lines.
fn documents_of(
    file: &Path,
    per_line: bool,
) -> Result<Box<dyn Iterator<Item = Result<Vec<String>>>>> {
    let io = |e: std::io::Error| OnnxError::io(file, e);
    if !per_line {
        let text = std::fs::read_to_string(file).map_err(io)?;
        return Ok(Box::new(std::iter::once(Ok(vec![text]))));
    }
    let path = file.to_path_buf();
    let mut lines = BufReader::new(std::fs::File::open(file).map_err(io)?).lines();
    Ok(Box::new(std::iter::from_fn(move || {
        let mut batch = Vec::new();
        loop {
            match lines.next() {
                None => return (!batch.is_empty()).then_some(Ok(batch)),
                Some(Err(e)) => return Some(Err(OnnxError::io(&path, e))),
                Some(Ok(l)) if l.trim().is_empty() => {}
                Some(Ok(l)) => {
                    batch.push(l);
                    if batch.len() == LINES_PER_BATCH {
                        return Some(Ok(batch));
                    }
                }
            }
        }
    })))
}

/// Cuts a token stream into shards of `shard_tokens`.
struct ShardWriter {
    dir: PathBuf,
    shard_tokens: usize,
    wide: bool,
    pending: Vec<u32>,
    shards: Vec<PathBuf>,
    /// Token ids written to the shards so far.
    written: usize,
}

impl ShardWriter {
    fn push(&mut self, ids: impl Iterator<Item = u32>) -> Result<()> {
        for id in ids {
            self.pending.push(id);
            if self.pending.len() == self.shard_tokens {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        if !self.pending.is_empty() {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let path = self
            .dir
            .join(format!("tokens_{:05}.npy", self.shards.len()));
        if self.wide {
            write_npy_1d(&path, &self.pending)?;
        } else {
            let narrow: Vec<u16> = self.pending.iter().map(|&id| id as u16).collect();
            write_npy_1d(&path, &narrow)?;
        }
        self.shards.push(path);
        self.written += self.pending.len();
        self.pending.clear();
        Ok(())
    }
}
