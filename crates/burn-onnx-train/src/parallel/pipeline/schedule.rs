//! Pipeline schedules: the order in which one pipeline rank runs the forward and backward
//! passes of the micro-batches of a batch, through each of its model chunks.
//!
//! A rank holds one stage, or with virtual stages (Megatron's interleaved schedule) `v`
//! chunks: stages `rank`, `rank + p`, `rank + 2p`, ... of `p * v`.
//!
//! * GPipe: every forward, then every backward (activations of all micro-batches live at
//!   once).
//! * 1F1B (PipeDream-flush, Megatron's default): `p - rank - 1` warm-up forwards, then
//!   one forward and one backward alternately, then the remaining backwards; at most
//!   `p - rank` micro-batches are in flight on a rank.
//! * Interleaved 1F1B (`v > 1`): the forwards go through the chunks in groups of `p`
//!   micro-batches (micro-batches `0..p` through chunk 0, then through chunk 1, ..., then
//!   `p..2p` through chunk 0, ...), the backwards likewise from the last chunk down;
//!   `2 (p - rank - 1) + (v - 1) p` warm-up forwards, then alternating, then the rest. The
//!   bubble shrinks to `(p - 1) / (v m + p - 1)` of the time, for `v` times the messages.
//!   It needs the micro-batch count to be a multiple of `p`.
//!
//! Every schedule runs each chunk's backward passes in micro-batch order, so they
//! accumulate the same gradients in the same order and give bit-identical updates. Sends
//! are buffered (they never wait for the receiver) and receives pick their message by tag
//! (`wire`), so no two ranks wait on each other.

use serde::{Deserialize, Serialize};

/// Which pipeline schedule (config `pipeline_schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum PipelineSchedule {
    /// One forward, one backward (PipeDream-flush): activation memory bounded by the stage count.
    #[default]
    #[serde(rename = "1f1b")]
    #[cfg_attr(feature = "cli", value(name = "1f1b"))]
    OneFOneB,
    /// All forwards, then all backwards.
    #[serde(rename = "gpipe")]
    #[cfg_attr(feature = "cli", value(name = "gpipe"))]
    Gpipe,
}

/// One step of a rank's schedule: a pass of micro-batch `micro` through the rank's model
/// chunk `chunk` (0 without virtual stages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Forward.
    Forward {
        /// The rank's model chunk it runs (0 without virtual stages).
        chunk: usize,
        /// The micro-batch it carries.
        micro: usize,
    },
    /// Backward.
    Backward {
        /// The rank's model chunk it runs (0 without virtual stages).
        chunk: usize,
        /// The micro-batch it carries.
        micro: usize,
    },
}

/// The pipeline a rank's schedule is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Ranks of the pipeline (`p`).
    pub ranks: usize,
    /// Model chunks per rank (`v`, the virtual stages).
    pub chunks: usize,
    /// Micro-batches per batch (`m`).
    pub micro: usize,
}

impl Shape {
    /// The `k`-th (chunk, micro-batch) of a rank's forwards (`backward`: of its backwards)
    /// under the interleaved order.
    fn interleaved(self, k: usize, backward: bool) -> (usize, usize) {
        let group = self.ranks * self.chunks;
        let chunk = (k % group) / self.ranks;
        let micro = (k / group) * self.ranks + k % self.ranks;
        (
            if backward {
                self.chunks - 1 - chunk
            } else {
                chunk
            },
            micro,
        )
    }

    /// The `k`-th forward and backward of a rank, in the order its chunks take them.
    fn nth(self, k: usize) -> (Pass, Pass) {
        if self.chunks == 1 {
            return (
                Pass::Forward { chunk: 0, micro: k },
                Pass::Backward { chunk: 0, micro: k },
            );
        }
        let (chunk, micro) = self.interleaved(k, false);
        let (b_chunk, b_micro) = self.interleaved(k, true);
        (
            Pass::Forward { chunk, micro },
            Pass::Backward {
                chunk: b_chunk,
                micro: b_micro,
            },
        )
    }
}

impl PipelineSchedule {
    /// The passes rank `rank` of `shape` runs, in order.
    pub fn passes(self, shape: Shape, rank: usize) -> Vec<Pass> {
        let total = shape.micro * shape.chunks;
        let forward = |k| shape.nth(k).0;
        let backward = |k| shape.nth(k).1;
        let warm = match self {
            PipelineSchedule::Gpipe => total,
            PipelineSchedule::OneFOneB if shape.chunks == 1 => shape.ranks - rank - 1,
            PipelineSchedule::OneFOneB => {
                2 * (shape.ranks - rank - 1) + (shape.chunks - 1) * shape.ranks
            }
        }
        .min(total);
        let mut out: Vec<Pass> = (0..warm).map(forward).collect();
        for k in warm..total {
            out.push(forward(k));
            out.push(backward(k - warm));
        }
        out.extend((total - warm..total).map(backward));
        out
    }
}

/// The most activation a rank holds at once under `passes`: the largest sum of
/// `weight(chunk)` over the (chunk, micro-batch) forwards whose backward has not run yet
/// (`|_| 1.0`: how many are in flight).
pub fn peak_in_flight(passes: &[Pass], weight: impl Fn(usize) -> f64) -> f64 {
    let (mut live, mut peak) = (0.0f64, 0.0f64);
    for pass in passes {
        match *pass {
            Pass::Forward { chunk, .. } => live += weight(chunk),
            Pass::Backward { chunk, .. } => live -= weight(chunk),
        }
        peak = peak.max(live);
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run every rank's passes against each other with buffered sends, each pass taking
    /// `forward` / `backward` time units: the time the batch takes, or `None` when the
    /// ranks wait on each other for good. Checks each pass's inputs arrived first.
    fn simulate(
        schedule: PipelineSchedule,
        shape: Shape,
        forward: u64,
        backward: u64,
    ) -> Option<u64> {
        use std::collections::HashMap;
        let (p, stages) = (shape.ranks, shape.ranks * shape.chunks);
        let lists: Vec<Vec<Pass>> = (0..p).map(|r| schedule.passes(shape, r)).collect();
        // When each (forward?, stage, micro) finished.
        let mut done: HashMap<(bool, usize, usize), u64> = HashMap::new();
        let (mut next, mut clock) = (vec![0usize; p], vec![0u64; p]);
        loop {
            let mut moved = false;
            for r in 0..p {
                let Some(&pass) = lists[r].get(next[r]) else {
                    continue;
                };
                let (fwd, chunk, micro) = match pass {
                    Pass::Forward { chunk, micro } => (true, chunk, micro),
                    Pass::Backward { chunk, micro } => (false, chunk, micro),
                };
                let stage = chunk * p + r;
                let needs = match fwd {
                    true if stage > 0 => vec![(true, stage - 1, micro)],
                    true => vec![],
                    false if stage + 1 < stages => {
                        vec![(true, stage, micro), (false, stage + 1, micro)]
                    }
                    false => vec![(true, stage, micro)],
                };
                let Some(ready) = needs
                    .iter()
                    .map(|n| done.get(n).copied())
                    .collect::<Option<Vec<_>>>()
                else {
                    continue;
                };
                let start = ready.into_iter().fold(clock[r], u64::max);
                clock[r] = start + if fwd { forward } else { backward };
                done.insert((fwd, stage, micro), clock[r]);
                next[r] += 1;
                moved = true;
            }
            if (0..p).all(|r| next[r] == lists[r].len()) {
                return clock.into_iter().max();
            }
            if !moved {
                return None;
            }
        }
    }

    fn backwards_of(passes: &[Pass], of: usize) -> Vec<usize> {
        passes
            .iter()
            .filter_map(|x| match *x {
                Pass::Backward { chunk, micro } if chunk == of => Some(micro),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn every_schedule_completes_and_keeps_each_chunks_backward_order() {
        for schedule in [PipelineSchedule::OneFOneB, PipelineSchedule::Gpipe] {
            for ranks in 1..5 {
                for chunks in 1..4 {
                    for micro in 1..9 {
                        if chunks > 1 && micro % ranks != 0 {
                            continue;
                        }
                        let shape = Shape {
                            ranks,
                            chunks,
                            micro,
                        };
                        let what = format!("{schedule:?} {shape:?}");
                        assert!(simulate(schedule, shape, 1, 2).is_some(), "{what} stalls");
                        for rank in 0..ranks {
                            let p = schedule.passes(shape, rank);
                            assert_eq!(p.len(), 2 * micro * chunks, "{what}");
                            for c in 0..chunks {
                                assert_eq!(backwards_of(&p, c), (0..micro).collect::<Vec<_>>());
                            }
                            for (i, x) in p.iter().enumerate() {
                                if let Pass::Backward { chunk, micro } = *x {
                                    assert!(p[..i].contains(&Pass::Forward { chunk, micro }));
                                }
                            }
                            if schedule == PipelineSchedule::OneFOneB && chunks == 1 {
                                assert!(
                                    peak_in_flight(&p, |_| 1.0) <= (ranks - rank).min(micro) as f64
                                );
                            }
                            if schedule == PipelineSchedule::Gpipe {
                                assert_eq!(peak_in_flight(&p, |_| 1.0), (micro * chunks) as f64);
                            }
                        }
                    }
                }
            }
        }
        // The last rank alternates from the start.
        let shape = Shape {
            ranks: 4,
            chunks: 1,
            micro: 2,
        };
        assert_eq!(
            PipelineSchedule::OneFOneB.passes(shape, 3),
            vec![
                Pass::Forward { chunk: 0, micro: 0 },
                Pass::Backward { chunk: 0, micro: 0 },
                Pass::Forward { chunk: 0, micro: 1 },
                Pass::Backward { chunk: 0, micro: 1 }
            ]
        );
    }

    /// With passes of equal cost per layer (a chunk's forward and backward take 1/v of a
    /// whole stage's), the interleaved schedule's idle time is Megatron's
    /// `(p - 1) / (v m + p - 1)` of the batch, against `(p - 1) / (m + p - 1)` without
    /// virtual stages.
    #[test]
    fn interleaving_shrinks_the_bubble_to_megatrons_bound() {
        for (ranks, micro) in [(2, 4), (4, 8), (4, 4), (3, 6)] {
            for chunks in [1, 2, 3] {
                let shape = Shape {
                    ranks,
                    chunks,
                    micro,
                };
                // A whole stage's forward takes 6 units and its backward 12, split over
                // the chunks.
                let (f, b) = (6 / chunks as u64, 12 / chunks as u64);
                let time = simulate(PipelineSchedule::OneFOneB, shape, f, b).unwrap();
                let busy = (micro * chunks) as u64 * (f + b);
                let bubble = (time - busy) as f64 / time as f64;
                let bound = (ranks - 1) as f64 / (chunks * micro + ranks - 1) as f64;
                assert!(
                    (bubble - bound).abs() < 1e-9,
                    "{shape:?}: bubble {bubble}, Megatron's {bound}"
                );
            }
        }
    }
}
