//! Training and evaluation data: shard directories, distributed sampling and prefetch.
//!
//! ## Shard formats (NumPy `.npy`, so any tool can write them)
//! * **Token shards** (language models): every `*.npy` and `*.bin` in the directory, in
//!   file-name order, or one such file: 1-D integer arrays (8- to 64-bit) of token ids, or
//!   nanoGPT's raw u16 / llm.c's headed `.bin` files; the shards are laid end to end as one
//!   stream, cut into non-overlapping windows of `seq_len` tokens. They are memory-mapped
//!   and read a window at a time ([`self::token_shards`]), never widened whole in RAM.
//! * **Image shards** (classifiers and regressors): `images_<k>.npy` (float32 `[N, ...]`,
//!   e.g. `[N, C, H, W]` images or `[N, features]` vectors) paired with `labels_<k>.npy`
//!   (integer `[N]`, for cross-entropy) or `targets_<k>.npy` (float32 `[N, ...]`, for MSE).
//!
//! ## Sampling ([`DistributedSampler`] semantics, as `torch.utils.data.DistributedSampler`)
//! Every rank shuffles the sample indices with the same seed for the same epoch
//! (`seed + epoch`), pads the list by repeating its head up to a multiple of the world
//! size, and takes every `world`-th index starting at its rank: the ranks' sets are disjoint
//! except for the padding. Each rank then forms batches in order and drops a final partial
//! batch. The batch of micro-step `k` is a pure function of `(seed, rank, world, k)`, which
//! is what makes resumed runs bit-identical.

pub mod documents;
pub mod npy;
pub mod sampler;
pub mod token_shards;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use ndarray::{ArrayD, Axis, IxDyn, concatenate};

pub use self::sampler::{DistributedSampler, LastOrder, LengthBalance};
use self::token_shards::TokenShards;
use crate::error::{OnnxError, Result};
use crate::train::data::npy::read_npy;
use crate::value::host_tensor::HostTensor;

/// What the loss compares the output with.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    /// Language modelling: the input ids themselves, shifted by one.
    NextToken,
    /// Class ids, one per sample.
    Classes(ArrayD<i64>),
    /// Float targets, one row per sample (regression).
    Values(ArrayD<f32>),
    /// Language modelling on documents (padded or packed, `train::data::documents`): the id each
    /// position predicts (`labels[b, t]`, [`crate::model::loss::IGNORE_INDEX`] where there is
    /// none: padding, a document's last token, a position before a document boundary),
    /// the attention mask (1 real token, 0 padding) for the graph's mask input, and what
    /// the summed loss is divided by: the number of labels of the whole update over all
    /// ranks, per rank and micro-step (so data-parallel ranks and accumulation average
    /// over the update's labels, whatever each batch holds).
    Tokens {
        /// Next-token labels `[B, L]`.
        labels: ArrayD<i64>,
        /// Attention mask `[B, L]`.
        mask: ArrayD<i64>,
        /// The summed loss's divisor.
        divisor: f64,
    },
}

/// One batch on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// The model input (ids `[B, S]` or images `[B, C, H, W]`).
    pub input: HostTensor,
    /// The target.
    pub target: Target,
    /// Throughput unit count: tokens for language models, images for classifiers.
    pub items: usize,
}

impl Batch {
    /// Cut into `parts` equal batches along the sample axis (pipeline micro-batches); the
    /// sample count must divide.
    pub fn split(&self, parts: usize) -> Result<Vec<Batch>> {
        let samples = self.input.shape().first().copied().unwrap_or(0);
        if parts == 0 || samples % parts != 0 {
            return Err(OnnxError::field(
                "config.parallel.num_pipeline_micro_batches",
                format!(
                    "{parts} micro-batches do not divide a batch of {samples} samples: make batch_size a multiple of it"
                ),
            ));
        }
        let n = samples / parts;
        let rows = |i: usize| ndarray::Slice::from(i * n..(i + 1) * n);
        Ok((0..parts)
            .map(|i| Batch {
                input: match &self.input {
                    HostTensor::Float(a) => {
                        HostTensor::Float(a.slice_axis(Axis(0), rows(i)).to_owned())
                    }
                    HostTensor::Int(a) => {
                        HostTensor::Int(a.slice_axis(Axis(0), rows(i)).to_owned())
                    }
                    HostTensor::Bool(a) => {
                        HostTensor::Bool(a.slice_axis(Axis(0), rows(i)).to_owned())
                    }
                },
                target: match &self.target {
                    Target::NextToken => Target::NextToken,
                    Target::Classes(t) => {
                        Target::Classes(t.slice_axis(Axis(0), rows(i)).to_owned())
                    }
                    Target::Values(t) => Target::Values(t.slice_axis(Axis(0), rows(i)).to_owned()),
                    // Each micro-batch's loss is scaled by 1 / parts again by the pipeline.
                    Target::Tokens {
                        labels,
                        mask,
                        divisor,
                    } => Target::Tokens {
                        labels: labels.slice_axis(Axis(0), rows(i)).to_owned(),
                        mask: mask.slice_axis(Axis(0), rows(i)).to_owned(),
                        divisor: divisor / parts as f64,
                    },
                },
                items: self.items / parts,
            })
            .collect())
    }
}

/// A random-access data set.
pub trait Dataset: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;
    /// True when there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Assemble the samples `indices` into a batch.
    fn batch(&self, indices: &[usize]) -> Result<Batch>;
    /// Unit of [`Batch::items`] (`tokens` or `images`).
    fn unit(&self) -> &'static str;
    /// What kind of targets the batches carry (checked against the loss before training).
    fn target_kind(&self) -> TargetKind;
    /// The smallest and the largest token id or class label, with where each is, to check
    /// against the model before training (`None`: no integer ids).
    fn id_range(&self) -> Option<(IdAt, IdAt)> {
        None
    }
    /// For data sets of documents: sample `i`'s real tokens and next-token labels (the
    /// sampler balances ranks by the first, the loss divides by the update's sum of the
    /// second). `None`: every sample is alike and the loss is a plain mean.
    fn sample_size(&self, _i: usize) -> Option<SampleSize> {
        None
    }
}

/// A document sample's size (see [`Dataset::sample_size`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleSize {
    /// Real (not padding) tokens.
    pub tokens: usize,
    /// Positions with a next-token label.
    pub labels: usize,
}

/// A token id or class label and where it is: its shard file (`memory` for data built in
/// memory) and its index in that shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdAt {
    /// The id or label.
    pub value: i64,
    /// The shard file it was read from.
    pub source: String,
    /// Its index in that shard.
    pub index: usize,
}

impl std::fmt::Display for IdAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (index {} of {})",
            self.value, self.index, self.source
        )
    }
}

/// Shards laid end to end: each one's name and the position where it starts.
#[derive(Debug, Clone)]
pub struct Sources(Vec<(String, usize)>);

impl Sources {
    /// Data built in memory, not read from files.
    pub fn memory() -> Self {
        Sources(vec![("memory".into(), 0)])
    }

    /// The smallest and the largest of `ids` (laid out as these shards), with where each is.
    pub fn extremes(&self, ids: impl Iterator<Item = i64>) -> Option<(IdAt, IdAt)> {
        let (mut lo, mut hi): (Option<(i64, usize)>, Option<(i64, usize)>) = (None, None);
        for (i, v) in ids.enumerate() {
            if lo.is_none_or(|(m, _)| v < m) {
                lo = Some((v, i));
            }
            if hi.is_none_or(|(m, _)| v > m) {
                hi = Some((v, i));
            }
        }
        Some((self.at(lo?), self.at(hi?)))
    }

    fn at(&self, (value, i): (i64, usize)) -> IdAt {
        let (source, start) = self
            .0
            .iter()
            .rev()
            .find(|(_, start)| *start <= i)
            .cloned()
            .unwrap_or_else(|| ("memory".into(), 0));
        IdAt {
            value,
            source,
            index: i - start,
        }
    }
}

/// The kind of [`Target`] a data set yields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetKind {
    /// Next-token prediction on integer ids.
    NextToken,
    /// Integer class labels.
    Classes,
    /// Float targets.
    Values,
}

fn shard_files(dir: &Path, prefix: &str, extensions: &[&str]) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| OnnxError::io(dir, e))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            // `<name>.idx.npy` is an index beside the shards (`documents.idx.npy`), no shard.
            !p.to_string_lossy().ends_with(".idx.npy")
                && p.extension()
                    .is_some_and(|x| extensions.iter().any(|e| x == *e))
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(OnnxError::field(
            dir.display().to_string(),
            format!(
                "no {} shards in this directory",
                extensions
                    .iter()
                    .map(|e| format!("{prefix}*.{e}"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
        ));
    }
    Ok(files)
}

/// Token stream cut into windows of `seq_len`.
pub struct TokenDataset {
    tokens: Tokens,
    seq_len: usize,
    sources: Sources,
}

/// Where a [`TokenDataset`]'s stream lives.
enum Tokens {
    /// Built in memory.
    Memory(Vec<i64>),
    /// Shard files, memory-mapped.
    Mapped(TokenShards),
}

impl Tokens {
    fn len(&self) -> usize {
        match self {
            Tokens::Memory(t) => t.len(),
            Tokens::Mapped(m) => m.len(),
        }
    }
}

impl TokenDataset {
    /// Map the token shards at `path`: every `*.npy` and `*.bin` of a directory, in
    /// file-name order, or one such file.
    pub fn load(path: &Path, seq_len: usize) -> Result<Self> {
        let files = if path.is_dir() {
            shard_files(path, "", &["npy", "bin"])?
        } else {
            vec![path.to_path_buf()]
        };
        let shards = TokenShards::open(&files)?;
        let sources = Sources(shards.sources());
        let mut data = Self::with_tokens(Tokens::Mapped(shards), seq_len)
            .map_err(|e| OnnxError::field(path.display().to_string(), e.to_string()))?;
        data.sources = sources;
        Ok(data)
    }

    /// Tokens in the stream.
    pub fn token_count(&self) -> usize {
        self.tokens.len()
    }

    /// Append tokens `from..to` of the stream to `out`.
    pub fn read(&self, from: usize, to: usize, out: &mut Vec<i64>) {
        match &self.tokens {
            Tokens::Memory(t) => out.extend_from_slice(&t[from..to]),
            Tokens::Mapped(m) => m.read(from, to, out),
        }
    }

    /// The window length.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Wrap an in-memory token stream.
    pub fn from_tokens(tokens: Vec<i64>, seq_len: usize) -> Result<Self> {
        Self::with_tokens(Tokens::Memory(tokens), seq_len)
    }

    fn with_tokens(tokens: Tokens, seq_len: usize) -> Result<Self> {
        if seq_len == 0 || tokens.len() < seq_len {
            return Err(OnnxError::field(
                "tokens",
                format!(
                    "{} tokens cannot fill one window of {seq_len}",
                    tokens.len()
                ),
            ));
        }
        Ok(TokenDataset {
            tokens,
            seq_len,
            sources: Sources::memory(),
        })
    }
}

impl Dataset for TokenDataset {
    fn len(&self) -> usize {
        self.tokens.len() / self.seq_len
    }

    fn batch(&self, indices: &[usize]) -> Result<Batch> {
        let s = self.seq_len;
        let mut ids = Vec::with_capacity(indices.len() * s);
        for &i in indices {
            self.read(i * s, (i + 1) * s, &mut ids);
        }
        let input = ArrayD::from_shape_vec(IxDyn(&[indices.len(), s]), ids)
            .map_err(|e| OnnxError::field("batch", e.to_string()))?;
        Ok(Batch {
            input: HostTensor::Int(input),
            target: Target::NextToken,
            items: indices.len() * s,
        })
    }

    fn unit(&self) -> &'static str {
        "tokens"
    }

    fn target_kind(&self) -> TargetKind {
        TargetKind::NextToken
    }

    fn id_range(&self) -> Option<(IdAt, IdAt)> {
        match &self.tokens {
            Tokens::Memory(t) => self.sources.extremes(t.iter().copied()),
            Tokens::Mapped(m) => self.sources.extremes(m.ids()),
        }
    }
}

/// Images (or feature vectors) with their labels or float targets, held in memory.
pub struct ImageDataset {
    images: ArrayD<f32>,
    targets: Target,
    label_sources: Sources,
}

fn concat<T: Clone>(parts: &[ArrayD<T>], dir: &Path) -> Result<ArrayD<T>> {
    let views: Vec<_> = parts.iter().map(|a| a.view()).collect();
    concatenate(Axis(0), &views).map_err(|e| {
        OnnxError::field(
            dir.display().to_string(),
            format!("shards disagree in shape: {e}"),
        )
    })
}

impl ImageDataset {
    /// Load every `images_<k>.npy` of `dir` with its `labels_<k>.npy` (or `targets_<k>.npy`).
    pub fn load(dir: &Path) -> Result<Self> {
        let (mut images, mut labels, mut values) = (Vec::new(), Vec::new(), Vec::new());
        let (mut label_sources, mut label_count) = (Vec::new(), 0);
        for f in shard_files(dir, "images_", &["npy"])? {
            let sibling = |prefix: &str| {
                let name = f
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or_default()
                    .replacen("images_", prefix, 1);
                f.with_file_name(name)
            };
            let bad = |p: &Path, m: String| OnnxError::field(p.display().to_string(), m);
            let HostTensor::Float(img) = read_npy(&f)? else {
                return Err(bad(&f, "images must be float32".into()));
            };
            let (lf, tf) = (sibling("labels_"), sibling("targets_"));
            let n = match (lf.is_file(), tf.is_file()) {
                (true, false) => {
                    let HostTensor::Int(lab) = read_npy(&lf)? else {
                        return Err(bad(&lf, "labels must be integers".into()));
                    };
                    if lab.ndim() != 1 {
                        return Err(bad(
                            &lf,
                            format!("labels must be 1-D [N], got {:?}", lab.shape()),
                        ));
                    }
                    label_sources.push((lf.display().to_string(), label_count));
                    label_count += lab.len();
                    labels.push(lab);
                    labels.last().map(|l| l.len())
                }
                (false, true) => {
                    let HostTensor::Float(t) = read_npy(&tf)? else {
                        return Err(bad(&tf, "targets must be float32".into()));
                    };
                    values.push(t);
                    values.last().and_then(|t| t.shape().first().copied())
                }
                (true, true) => {
                    return Err(bad(
                        &f,
                        format!("has both {} and {}: keep one", lf.display(), tf.display()),
                    ));
                }
                (false, false) => {
                    return Err(bad(
                        &f,
                        format!("has neither {} nor {}", lf.display(), tf.display()),
                    ));
                }
            };
            if img.ndim() < 2 || n != Some(img.shape()[0]) {
                return Err(bad(
                    &f,
                    format!(
                        "{:?} images and {n:?} labels/targets: the first dimensions must agree",
                        img.shape()
                    ),
                ));
            }
            images.push(img);
        }
        if !labels.is_empty() && !values.is_empty() {
            return Err(OnnxError::field(
                dir.display().to_string(),
                "some shards have labels_*.npy and others targets_*.npy",
            ));
        }
        let targets = if values.is_empty() {
            Target::Classes(concat(&labels, dir)?)
        } else {
            Target::Values(concat(&values, dir)?)
        };
        let mut data = Self::new(concat(&images, dir)?, targets)?;
        data.label_sources = Sources(label_sources);
        Ok(data)
    }

    /// Wrap in-memory arrays: images `[N, ...]` with `Target::Classes` `[N]` or
    /// `Target::Values` `[N, ...]`.
    pub fn new(images: ArrayD<f32>, targets: Target) -> Result<Self> {
        let n = match &targets {
            Target::Classes(l) if l.ndim() == 1 => Some(l.len()),
            Target::Values(v) if v.ndim() >= 1 => Some(v.shape()[0]),
            _ => None,
        };
        if images.ndim() < 2 || n != Some(images.shape()[0]) {
            return Err(OnnxError::field(
                "data set",
                format!(
                    "images {:?} do not pair up with their labels/targets",
                    images.shape()
                ),
            ));
        }
        Ok(ImageDataset {
            images,
            targets,
            label_sources: Sources::memory(),
        })
    }
}

impl Dataset for ImageDataset {
    fn len(&self) -> usize {
        self.images.shape()[0]
    }

    fn batch(&self, indices: &[usize]) -> Result<Batch> {
        let targets = match &self.targets {
            Target::Classes(l) => Target::Classes(l.select(Axis(0), indices)),
            Target::Values(v) => Target::Values(v.select(Axis(0), indices)),
            other => other.clone(),
        };
        Ok(Batch {
            input: HostTensor::Float(self.images.select(Axis(0), indices)),
            target: targets,
            items: indices.len(),
        })
    }

    fn unit(&self) -> &'static str {
        "images"
    }

    fn target_kind(&self) -> TargetKind {
        match self.targets {
            Target::Values(_) => TargetKind::Values,
            _ => TargetKind::Classes,
        }
    }

    fn id_range(&self) -> Option<(IdAt, IdAt)> {
        match &self.targets {
            Target::Classes(l) => self.label_sources.extremes(l.iter().copied()),
            _ => None,
        }
    }
}

/// Background batch assembly: a thread computes batches `start, start + 1, ...` ahead of
/// the training loop, `depth` at most.
pub struct Prefetcher {
    rx: Receiver<Result<Batch>>,
    handle: Option<JoinHandle<()>>,
    /// Batches taken from the thread by [`Prefetcher::peek`], handed out first.
    front: std::sync::Mutex<std::collections::VecDeque<Batch>>,
}

impl Prefetcher {
    /// Start prefetching from batch number `start`; updates take `accumulation` batches
    /// (the documents' loss divisor counts an update's labels).
    pub fn start(
        data: Arc<dyn Dataset>,
        sampler: DistributedSampler,
        start: usize,
        depth: usize,
        accumulation: usize,
    ) -> Self {
        let (tx, rx): (SyncSender<Result<Batch>>, _) = sync_channel(depth.max(1));
        let handle = std::thread::spawn(move || {
            // The labels of the update in progress: (its first micro-step, their count).
            let mut update: Option<(usize, usize)> = None;
            for k in start.. {
                let batch = sampler
                    .batch_indices(k)
                    .and_then(|idx| data.batch(&idx))
                    .and_then(|b| {
                        with_update_divisor(
                            b,
                            data.as_ref(),
                            &sampler,
                            k,
                            accumulation,
                            &mut update,
                        )
                    });
                let stop = batch.is_err();
                if tx.send(batch).is_err() || stop {
                    break;
                }
            }
        });
        Prefetcher {
            rx,
            handle: Some(handle),
            front: Default::default(),
        }
    }

    /// The next batch.
    pub fn next_batch(&self) -> Result<Batch> {
        if let Some(batch) = self.front_queue().pop_front() {
            return Ok(batch);
        }
        self.received()
    }

    /// The next `n` batches, which [`Self::next_batch`] still hands out after (a captured
    /// update writes their values before its replay takes them).
    pub fn peek(&self, n: usize) -> Result<Vec<Batch>> {
        while self.front_queue().len() < n {
            let batch = self.received()?;
            self.front_queue().push_back(batch);
        }
        Ok(self.front_queue().iter().take(n).cloned().collect())
    }

    fn front_queue(&self) -> std::sync::MutexGuard<'_, std::collections::VecDeque<Batch>> {
        self.front.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn received(&self) -> Result<Batch> {
        self.rx
            .recv()
            .map_err(|_| OnnxError::field("data", "the prefetch thread stopped"))?
    }
}

/// `batch` (micro-step `k`) with the loss divisor of documents: the labels of every
/// rank's batches of its update, per rank and micro-step (see [`Target::Tokens`]);
/// `update` keeps the count of the update in progress for its other micro-steps.
fn with_update_divisor(
    mut batch: Batch,
    data: &dyn Dataset,
    sampler: &DistributedSampler,
    k: usize,
    accumulation: usize,
    update: &mut Option<(usize, usize)>,
) -> Result<Batch> {
    let Target::Tokens { divisor, .. } = &mut batch.target else {
        return Ok(batch);
    };
    let accumulation = accumulation.max(1);
    let first = k - k % accumulation;
    let labels = match *update {
        Some((f, labels)) if f == first => labels,
        _ => {
            let mut labels = 0usize;
            for m in first..first + accumulation {
                for rank in sampler.global_batch(m)? {
                    labels += rank
                        .iter()
                        .filter_map(|&i| data.sample_size(i))
                        .map(|s| s.labels)
                        .sum::<usize>();
                }
            }
            *update = Some((first, labels));
            labels
        }
    };
    *divisor = (labels.max(1) as f64) / (sampler.world * accumulation) as f64;
    Ok(batch)
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Unblock the producer (its send fails once the receiver is gone), then join it.
        let (_, dummy) = sync_channel(0);
        drop(std::mem::replace(&mut self.rx, dummy));
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
