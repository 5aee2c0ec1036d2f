//! Pipeline schedules: the order in which one stage runs the forward and backward passes of
//! the micro-batches of a batch.
//!
//! * GPipe: every forward, then every backward (activations of all micro-batches live at
//!   once).
//! * 1F1B (PipeDream-flush, Megatron's default): `stages - stage - 1` warm-up forwards, then
//!   one forward and one backward alternately, then the remaining backwards; at most
//!   `stages - stage` micro-batches are in flight on a stage.
//!
//! Both run the backward passes in micro-batch order, so they accumulate the same gradients
//! in the same order and give bit-identical updates. Sends are buffered (they never wait for
//! the receiver), so with receives in this order no two stages wait on each other.

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

/// One step of a stage's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Forward of micro-batch `j`.
    Forward(usize),
    /// Backward of micro-batch `j`.
    Backward(usize),
}

impl PipelineSchedule {
    /// The passes stage `stage` of `stages` runs for `micro` micro-batches, in order.
    pub fn passes(self, stages: usize, stage: usize, micro: usize) -> Vec<Pass> {
        match self {
            PipelineSchedule::Gpipe => (0..micro)
                .map(Pass::Forward)
                .chain((0..micro).map(Pass::Backward))
                .collect(),
            PipelineSchedule::OneFOneB => {
                let warm = (stages - stage - 1).min(micro);
                let mut out: Vec<Pass> = (0..warm).map(Pass::Forward).collect();
                for j in warm..micro {
                    out.push(Pass::Forward(j));
                    out.push(Pass::Backward(j - warm));
                }
                out.extend((micro - warm..micro).map(Pass::Backward));
                out
            }
        }
    }
}

/// The most micro-batches whose activations a stage holds at once under `passes`.
pub fn peak_in_flight(passes: &[Pass]) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    for p in passes {
        match p {
            Pass::Forward(_) => live += 1,
            Pass::Backward(_) => live -= 1,
        }
        peak = peak.max(live);
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_f_one_b_bounds_activations_and_keeps_order() {
        for stages in 1..5 {
            for stage in 0..stages {
                for micro in 1..9 {
                    let p = PipelineSchedule::OneFOneB.passes(stages, stage, micro);
                    let g = PipelineSchedule::Gpipe.passes(stages, stage, micro);
                    assert_eq!(p.len(), 2 * micro);
                    assert!(peak_in_flight(&p) <= (stages - stage).min(micro));
                    assert_eq!(peak_in_flight(&g), micro);
                    let back = |v: &[Pass]| {
                        v.iter()
                            .filter_map(|x| {
                                if let Pass::Backward(j) = x {
                                    Some(*j)
                                } else {
                                    None
                                }
                            })
                            .collect::<Vec<_>>()
                    };
                    assert_eq!(back(&p), (0..micro).collect::<Vec<_>>());
                    assert_eq!(back(&g), back(&p));
                    for (i, x) in p.iter().enumerate() {
                        if let Pass::Backward(j) = x {
                            assert!(p[..i].contains(&Pass::Forward(*j)));
                        }
                    }
                }
            }
        }
        // The last stage alternates from the start.
        assert_eq!(
            PipelineSchedule::OneFOneB.passes(4, 3, 2),
            vec![
                Pass::Forward(0),
                Pass::Backward(0),
                Pass::Forward(1),
                Pass::Backward(1)
            ]
        );
    }
}
