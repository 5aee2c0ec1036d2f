//! Token shards as documents (`data.sequences`): samples that are whole documents instead
//! of fixed windows cut from one stream.
//!
//! The documents are given by `documents.idx.npy` beside the shards (`onnx-train tokenize`
//! writes it): 1-D integers, the position where each document starts in the shards laid
//! end to end, then the stream's length (Megatron's `.idx` beside its `.bin`, as numpy).
//!
//! * `"documents"` ([`DocumentDataset`]): each document is a sample (one longer than
//!   `seq_len` is cut into pieces of `seq_len`; a piece of one token, which predicts
//!   nothing, is dropped); a batch is padded with `pad_id` to its longest member, with an
//!   attention mask (1 real, 0 padding) for the graph's mask input
//!   (`model.attention_mask_name`), and only real positions that have a next token carry a
//!   label. The sampler balances the ranks by tokens and buckets lengths
//!   (`train::data::sampler`).
//! * `"packed"` ([`PackedDocuments`]): windows of `seq_len` as with plain token shards, but
//!   a position whose next token starts another document has no label (attention still
//!   crosses the boundary: the graph's mask input is `[B, L]`, not block-diagonal).
//!
//! Both yield [`Target::Tokens`]: the loss sums over the labels and divides by the number
//! of labels of the whole update over all ranks (per rank and micro-step), so data
//! parallelism and accumulation average over the same tokens one process would.

use std::path::Path;
use std::sync::Arc;

use ndarray::{ArrayD, IxDyn};

use super::sampler::{DistributedSampler, LengthBalance};
use super::{Batch, Dataset, IdAt, SampleSize, Target, TargetKind, TokenDataset};
use crate::error::{OnnxError, Result};
use crate::model::loss::IGNORE_INDEX;
use crate::train::config::{DataConfig, Sequences, TrainingConfig};
use crate::train::data::npy::read_npy;
use crate::value::host_tensor::HostTensor;

/// The index file beside the token shards.
pub const DOCUMENT_INDEX: &str = "documents.idx.npy";

/// The token data set `c.data.sequences` asks for, from the shards at `path`.
pub fn token_dataset(c: &TrainingConfig, path: &Path) -> Result<Arc<dyn Dataset>> {
    let d = &c.data;
    Ok(match d.sequences {
        Sequences::Windows => Arc::new(TokenDataset::load(path, d.seq_len)?),
        Sequences::Documents => Arc::new(DocumentDataset::load(path, d.seq_len, d.pad_id)?),
        Sequences::Packed => Arc::new(PackedDocuments::load(path, d.seq_len)?),
    })
}

/// The sampler of a run's training data `data` (batched as `data_config` says) for
/// data-parallel rank `rank` of `world`: shuffled by the run's `seed` (`train.seed`),
/// balanced by tokens when the samples are documents.
pub fn training_sampler(
    data_config: &DataConfig,
    seed: u64,
    data: &dyn Dataset,
    rank: usize,
    world: usize,
) -> DistributedSampler {
    DistributedSampler {
        len: data.len(),
        batch_size: data_config.batch_size,
        rank,
        world,
        seed,
        shuffle: true,
        balance: length_balance(data_config, data),
        last_order: Default::default(),
    }
}

/// How the sampler balances `data` under `data_config`: by each sample's tokens for
/// documents, `None` otherwise.
pub fn length_balance(data_config: &DataConfig, data: &dyn Dataset) -> Option<LengthBalance> {
    if data_config.sequences != Sequences::Documents {
        return None;
    }
    let lengths = (0..data.len())
        .map(|i| data.sample_size(i).map_or(0, |s| s.tokens as u32))
        .collect();
    Some(LengthBalance {
        lengths: Arc::new(lengths),
        bucket: data_config.length_bucket_batches,
    })
}

/// The document starts of the shards at `path` (a directory with `documents.idx.npy`),
/// checked against the stream of `tokens` tokens.
fn read_index(path: &Path, tokens: usize) -> Result<Vec<usize>> {
    let file = if path.is_dir() {
        path.join(DOCUMENT_INDEX)
    } else {
        path.with_file_name(DOCUMENT_INDEX)
    };
    let bad = |m: String| OnnxError::field(file.display().to_string(), m);
    if !file.exists() {
        return Err(bad(
            "missing: data.sequences = \"documents\" or \"packed\" needs the documents' start positions (`onnx-train tokenize` writes them)".into(),
        ));
    }
    let HostTensor::Int(index) = read_npy(&file)? else {
        return Err(bad("must hold integers".into()));
    };
    let index: Vec<i64> = index.iter().copied().collect();
    if index.len() < 2 || index[0] != 0 || *index.last().unwrap_or(&0) != tokens as i64 {
        return Err(bad(format!(
            "must start at 0 and end at the shards' {tokens} tokens (got {} entries: {:?} .. {:?})",
            index.len(),
            index.first(),
            index.last()
        )));
    }
    if let Some(w) = index.windows(2).position(|w| w[1] < w[0]) {
        return Err(bad(format!(
            "entry {} ({}) is before entry {} ({}): the starts must not decrease",
            w + 1,
            index[w + 1],
            w,
            index[w]
        )));
    }
    Ok(index.into_iter().map(|v| v as usize).collect())
}

/// Each document a sample, padded batches (see the module doc).
pub struct DocumentDataset {
    tokens: TokenDataset,
    /// `(start, length)` of each sample in the stream.
    spans: Vec<(usize, usize)>,
    pad_id: i64,
}

impl DocumentDataset {
    /// The documents of the shards at `path` (with `documents.idx.npy`).
    pub fn load(path: &Path, seq_len: usize, pad_id: i64) -> Result<Self> {
        let tokens = TokenDataset::load(path, 1)?;
        let index = read_index(path, tokens.token_count())?;
        Self::new(tokens, &index, seq_len, pad_id)
    }

    /// In-memory documents.
    pub fn from_documents(docs: &[Vec<i64>], seq_len: usize, pad_id: i64) -> Result<Self> {
        let mut index = vec![0];
        for d in docs {
            index.push(index.last().copied().unwrap_or(0) + d.len());
        }
        let tokens = TokenDataset::from_tokens(docs.concat(), 1)?;
        Self::new(tokens, &index, seq_len, pad_id)
    }

    fn new(tokens: TokenDataset, index: &[usize], seq_len: usize, pad_id: i64) -> Result<Self> {
        if seq_len < 2 {
            return Err(OnnxError::field(
                "config.data.seq_len",
                "must be at least 2 for documents",
            ));
        }
        let spans: Vec<(usize, usize)> = index
            .windows(2)
            .flat_map(|w| {
                (w[0]..w[1])
                    .step_by(seq_len)
                    .map(move |s| (s, seq_len.min(w[1] - s)))
            })
            .filter(|&(_, len)| len >= 2)
            .collect();
        if spans.is_empty() {
            return Err(OnnxError::field(
                "data",
                "no document of two tokens or more (a one-token document predicts nothing)",
            ));
        }
        Ok(DocumentDataset {
            tokens,
            spans,
            pad_id,
        })
    }
}

impl Dataset for DocumentDataset {
    fn len(&self) -> usize {
        self.spans.len()
    }

    fn batch(&self, indices: &[usize]) -> Result<Batch> {
        let longest = indices.iter().map(|&i| self.spans[i].1).max().unwrap_or(0);
        let n = indices.len() * longest;
        let (mut ids, mut labels, mut mask) =
            (vec![self.pad_id; n], vec![IGNORE_INDEX; n], vec![0i64; n]);
        let mut doc = Vec::with_capacity(longest);
        for (b, &i) in indices.iter().enumerate() {
            let (start, len) = self.spans[i];
            doc.clear();
            self.tokens.read(start, start + len, &mut doc);
            let row = b * longest;
            ids[row..row + len].copy_from_slice(&doc);
            labels[row..row + len - 1].copy_from_slice(&doc[1..]);
            mask[row..row + len].fill(1);
        }
        let shape = IxDyn(&[indices.len(), longest]);
        let array = |v: Vec<i64>| {
            ArrayD::from_shape_vec(shape.clone(), v)
                .map_err(|e| OnnxError::field("batch", e.to_string()))
        };
        let counted = labels.iter().filter(|&&l| l != IGNORE_INDEX).count();
        Ok(Batch {
            items: indices.iter().map(|&i| self.spans[i].1).sum(),
            input: HostTensor::Int(array(ids)?),
            target: Target::Tokens {
                labels: array(labels)?,
                mask: array(mask)?,
                divisor: counted.max(1) as f64,
            },
        })
    }

    fn unit(&self) -> &'static str {
        "tokens"
    }

    fn target_kind(&self) -> TargetKind {
        TargetKind::NextToken
    }

    fn id_range(&self) -> Option<(IdAt, IdAt)> {
        self.tokens.id_range()
    }

    fn sample_size(&self, i: usize) -> Option<SampleSize> {
        let len = self.spans.get(i)?.1;
        Some(SampleSize {
            tokens: len,
            labels: len - 1,
        })
    }
}

/// Windows that never predict across a document boundary (see the module doc).
pub struct PackedDocuments {
    windows: TokenDataset,
    /// Where each document starts, ascending.
    starts: Vec<usize>,
}

impl PackedDocuments {
    /// The shards at `path` (with `documents.idx.npy`) in windows of `seq_len`.
    pub fn load(path: &Path, seq_len: usize) -> Result<Self> {
        let windows = TokenDataset::load(path, seq_len)?;
        let starts = read_index(path, windows.token_count())?;
        Ok(PackedDocuments { windows, starts })
    }

    /// Whether a document starts at stream position `p`.
    fn starts_at(&self, p: usize) -> bool {
        self.starts.binary_search(&p).is_ok()
    }

    /// Document starts inside `from..to` of the stream.
    fn starts_within(&self, from: usize, to: usize) -> usize {
        self.starts.partition_point(|&s| s < to) - self.starts.partition_point(|&s| s < from)
    }
}

impl Dataset for PackedDocuments {
    fn len(&self) -> usize {
        self.windows.len()
    }

    fn batch(&self, indices: &[usize]) -> Result<Batch> {
        let plain = self.windows.batch(indices)?;
        let HostTensor::Int(ids) = &plain.input else {
            return Err(OnnxError::field("batch", "token windows are integers"));
        };
        let s = self.windows.seq_len();
        let mut labels = ArrayD::from_elem(ids.raw_dim(), IGNORE_INDEX);
        for (b, &i) in indices.iter().enumerate() {
            for t in 0..s - 1 {
                if !self.starts_at(i * s + t + 1) {
                    labels[[b, t]] = ids[[b, t + 1]];
                }
            }
        }
        let counted = labels.iter().filter(|&&l| l != IGNORE_INDEX).count();
        Ok(Batch {
            target: Target::Tokens {
                mask: ArrayD::from_elem(ids.raw_dim(), 1),
                labels,
                divisor: counted.max(1) as f64,
            },
            ..plain
        })
    }

    fn unit(&self) -> &'static str {
        "tokens"
    }

    fn target_kind(&self) -> TargetKind {
        TargetKind::NextToken
    }

    fn id_range(&self) -> Option<(IdAt, IdAt)> {
        self.windows.id_range()
    }

    fn sample_size(&self, i: usize) -> Option<SampleSize> {
        let s = self.windows.seq_len();
        (i < self.len()).then(|| SampleSize {
            tokens: s,
            labels: s - 1 - self.starts_within(i * s + 1, i * s + s),
        })
    }
}
