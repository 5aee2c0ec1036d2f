//! Which samples each rank takes at each micro-step ([`DistributedSampler`]).
//!
//! Plain (windows, images; `torch.utils.data.DistributedSampler`'s semantics): every rank
//! shuffles the sample indices with the same seed for the same epoch (`seed + epoch`),
//! pads the list by repeating its head up to a multiple of the world size, and takes every
//! `world`-th index starting at its rank: the ranks' sets are disjoint except for the
//! padding. Each rank then forms batches in order and drops a final partial batch.
//!
//! Balanced by length (documents, [`LengthBalance`]): the shuffled epoch is cut into
//! global batches of `batch_size x world` samples; every `bucket` consecutive global
//! batches are sorted by length together and their order shuffled again (length
//! bucketing: a batch holds documents of similar lengths and pads little); each global
//! batch is dealt to the ranks longest first, each document to the rank with the fewest
//! tokens so far among those with room (so every rank has `batch_size` samples and about
//! the same number of tokens). A final partial global batch is dropped.
//!
//! Either way the batch of micro-step `k` is a pure function of `(seed, rank, world, k)`,
//! which is what makes resumed runs bit-identical, and every rank can compute every other
//! rank's batch (the documents' loss divisor counts them).

use std::sync::{Arc, Mutex};

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use crate::error::{OnnxError, Result};

/// Length-balanced batching: each sample's token count, and how many global batches are
/// sorted together.
#[derive(Debug, Clone, PartialEq)]
pub struct LengthBalance {
    /// Tokens of each sample.
    pub lengths: Arc<Vec<u32>>,
    /// Global batches sorted by length together (1: none).
    pub bucket: usize,
}

/// Deterministic distributed sampling (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct DistributedSampler {
    /// Number of samples in the data set.
    pub len: usize,
    /// Samples per batch on this rank.
    pub batch_size: usize,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Shuffle seed (epoch `e` uses `seed + e`).
    pub seed: u64,
    /// Shuffle at all.
    pub shuffle: bool,
    /// Balance the ranks by sample length (documents); `None`: plain.
    pub balance: Option<LengthBalance>,
    /// The last epoch order it computed (`LastOrder::default()` to start empty).
    pub last_order: LastOrder,
}

/// What identifies an epoch's order: length, seed, shuffle, epoch.
type OrderKey = (usize, u64, bool, u64);

/// The last epoch order a sampler computed: the prefetch thread asks for the same epoch at
/// every micro-step (and for every rank's batch, to count an update's labels), and
/// shuffling millions of indices each time would cost more than the step. A cache, not
/// part of what the sampler is: every two are equal, and a clone starts from the same.
#[derive(Default)]
pub struct LastOrder(Mutex<Option<(OrderKey, Arc<Vec<usize>>)>>);

impl LastOrder {
    /// The order cached under `key`, if it is the last one.
    fn get(&self, key: OrderKey) -> Option<Arc<Vec<usize>>> {
        let last = self.0.lock().unwrap_or_else(|p| p.into_inner());
        last.as_ref()
            .filter(|(k, _)| *k == key)
            .map(|(_, o)| o.clone())
    }

    /// Keep `order` as the one of `key`.
    fn set(&self, key: OrderKey, order: Arc<Vec<usize>>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some((key, order));
    }
}

impl Clone for LastOrder {
    fn clone(&self) -> Self {
        LastOrder(Mutex::new(
            self.0.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        ))
    }
}

impl PartialEq for LastOrder {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for LastOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LastOrder")
    }
}

impl DistributedSampler {
    fn shuffled(&self, epoch: u64) -> Arc<Vec<usize>> {
        let key = (self.len, self.seed, self.shuffle, epoch);
        if let Some(order) = self.last_order.get(key) {
            return order;
        }
        let mut all: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            all.shuffle(&mut ChaCha8Rng::seed_from_u64(
                self.seed.wrapping_add(epoch),
            ));
        }
        let all = Arc::new(all);
        self.last_order.set(key, all.clone());
        all
    }

    /// The indices rank `rank` sees in `epoch` with plain sampling, in order.
    fn rank_epoch(&self, all: &[usize], rank: usize) -> Vec<usize> {
        let total = self.len.div_ceil(self.world) * self.world;
        (0..total)
            .map(|i| all[i % self.len.max(1)])
            .skip(rank)
            .step_by(self.world)
            .collect()
    }

    /// The indices this rank sees in `epoch`, in order (plain sampling).
    pub fn epoch_indices(&self, epoch: u64) -> Vec<usize> {
        self.rank_epoch(&self.shuffled(epoch), self.rank)
    }

    /// Full batches per epoch on each rank.
    pub fn batches_per_epoch(&self) -> usize {
        match &self.balance {
            None => self.len.div_ceil(self.world) / self.batch_size,
            Some(_) => self.len / (self.batch_size * self.world),
        }
    }

    /// Indices of this rank's batch number `k` counted from the start of training.
    pub fn batch_indices(&self, k: usize) -> Result<Vec<usize>> {
        Ok(self.global_batch(k)?.swap_remove(self.rank))
    }

    /// Every rank's indices of batch number `k` (rank `r`'s at `r`).
    pub fn global_batch(&self, k: usize) -> Result<Vec<Vec<usize>>> {
        let per = self.batches_per_epoch();
        if per == 0 {
            return Err(OnnxError::field(
                "config.data.batch_size",
                format!(
                    "{} samples over {} rank(s) cannot fill one batch of {}",
                    self.len, self.world, self.batch_size
                ),
            ));
        }
        let epoch = (k / per) as u64;
        let all = self.shuffled(epoch);
        let j = k % per;
        let Some(balance) = &self.balance else {
            // Rank r's m-th index of the epoch is the padded order's (r + m * world)-th.
            let offset = j * self.batch_size;
            return Ok((0..self.world)
                .map(|r| {
                    (offset..offset + self.batch_size)
                        .map(|m| all[(r + m * self.world) % self.len])
                        .collect()
                })
                .collect());
        };
        let global = self.batch_size * self.world;
        let bucket = balance.bucket.max(1);
        let pool = j / bucket;
        let first = pool * bucket;
        let batches = bucket.min(per - first);
        let mut members = all[first * global..(first + batches) * global].to_vec();
        let length = |i: &usize| balance.lengths.get(*i).copied().unwrap_or(0);
        members.sort_by_key(|i| (std::cmp::Reverse(length(i)), *i));
        let mut order: Vec<usize> = (0..batches).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(
            self.seed
                .wrapping_add(epoch)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ pool as u64,
        ));
        let at = order[j - first];
        Ok(self.deal(&members[at * global..(at + 1) * global], length))
    }

    /// `members` (sorted longest first) dealt to the ranks: each to the rank with the
    /// fewest tokens among those with fewer than `batch_size` samples (the lowest rank on
    /// a tie).
    fn deal(&self, members: &[usize], length: impl Fn(&usize) -> u32) -> Vec<Vec<usize>> {
        let mut ranks: Vec<(u64, Vec<usize>)> = vec![(0, Vec::new()); self.world];
        for i in members {
            let (_, to) = ranks
                .iter_mut()
                .filter(|(_, b)| b.len() < self.batch_size)
                .map(|r| (r.0, r))
                .min_by_key(|(tokens, _)| *tokens)
                .expect("room on some rank: members = batch_size x world");
            to.0 += u64::from(length(i));
            to.1.push(*i);
        }
        ranks.into_iter().map(|(_, b)| b).collect()
    }
}
