//! The 3D layout of ranks: `data x tensor x pipeline = world`, laid out as Megatron-LM
//! does: tensor-parallel ranks adjacent (they talk most), then data-parallel, then
//! pipeline stages (`rank = (pp * dp_size + dp) * tp_size + tp`). [`Topology::groups`]
//! carves each rank's data-, tensor- and pipeline-parallel groups out of the world.

use std::sync::Arc;

use crate::comm::communicator::Communicator;
use crate::error::{DistError, DistResult};

/// Sizes of the three kinds of parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Tensor-parallel ranks per replica.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
}

/// One rank's coordinates and groups.
pub struct Groups {
    /// Position in the data-parallel group.
    pub dp_rank: usize,
    /// Position in the tensor-parallel group.
    pub tp_rank: usize,
    /// Pipeline stage.
    pub pp_rank: usize,
    /// Ranks holding the same part of the model (same tp rank and stage): gradients are
    /// averaged here.
    pub dp: Arc<dyn Communicator>,
    /// Ranks splitting the same layers (same replica and stage).
    pub tp: Arc<dyn Communicator>,
    /// The stages of one replica (same dp and tp rank), ranked by stage.
    pub pp: Arc<dyn Communicator>,
}

impl Topology {
    /// Check `dp * tp * pp == world` (every size at least 1).
    pub fn new(dp: usize, tp: usize, pp: usize, world: usize) -> DistResult<Self> {
        if dp == 0 || tp == 0 || pp == 0 || dp * tp * pp != world {
            return Err(DistError::Invalid {
                rank: 0,
                message: format!(
                    "data ({dp}) x tensor ({tp}) x pipeline ({pp}) parallel sizes make {}, but the world has {world} rank(s)",
                    dp * tp * pp
                ),
            });
        }
        Ok(Topology { dp, tp, pp })
    }

    /// The layout of `world` ranks as replicas of `tp x pp` model ranks: the data-parallel
    /// size is what the tensor and pipeline sizes leave (an error when they do not divide
    /// the world).
    pub fn filling(world: usize, tp: usize, pp: usize) -> DistResult<Self> {
        let model_ranks = tp * pp;
        if model_ranks == 0 || !world.is_multiple_of(model_ranks) {
            return Err(DistError::Invalid {
                rank: 0,
                message: format!(
                    "tensor ({tp}) x pipeline ({pp}) parallel sizes make {model_ranks} rank(s) per replica, which do not divide a world of {world}"
                ),
            });
        }
        Self::new(world / model_ranks, tp, pp, world)
    }

    /// Ranks the layout needs: `dp * tp * pp`.
    pub fn world_size(&self) -> usize {
        self.dp * self.model_ranks()
    }

    /// Ranks holding one replica of the model: `tp * pp`.
    pub fn model_ranks(&self) -> usize {
        self.tp * self.pp
    }

    /// `(dp, tp, pp)` coordinates of world rank `rank`.
    pub fn coords(&self, rank: usize) -> (usize, usize, usize) {
        (
            rank / self.tp % self.dp,
            rank % self.tp,
            rank / (self.tp * self.dp),
        )
    }

    /// The world rank at coordinates `(dp, tp, pp)`.
    pub fn rank_of(&self, dp: usize, tp: usize, pp: usize) -> usize {
        (pp * self.dp + dp) * self.tp + tp
    }

    /// This rank's groups: three collective splits of `world` (every rank must call it).
    pub fn groups(&self, world: &dyn Communicator) -> DistResult<Groups> {
        let rank = world.rank();
        if world.world_size() != self.dp * self.tp * self.pp {
            return Err(DistError::Invalid {
                rank,
                message: format!("topology {self:?} on a world of {}", world.world_size()),
            });
        }
        let (d, t, p) = self.coords(rank);
        let dp: Arc<dyn Communicator> = Arc::from(world.split(p * self.tp + t, d)?);
        let tp: Arc<dyn Communicator> = Arc::from(world.split(p * self.dp + d, t)?);
        let pp: Arc<dyn Communicator> = Arc::from(world.split(d * self.tp + t, p)?);
        Ok(Groups {
            dp_rank: d,
            tp_rank: t,
            pp_rank: p,
            dp,
            tp,
            pp,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_order() {
        let t = Topology::new(2, 2, 2, 8).unwrap();
        // tp adjacent, then dp, then pp.
        assert_eq!(t.coords(0), (0, 0, 0));
        assert_eq!(t.coords(1), (0, 1, 0));
        assert_eq!(t.coords(2), (1, 0, 0));
        assert_eq!(t.coords(4), (0, 0, 1));
        assert_eq!(t.coords(7), (1, 1, 1));
        for r in 0..8 {
            let (d, tp, p) = t.coords(r);
            assert_eq!(t.rank_of(d, tp, p), r);
        }
        assert!(Topology::new(2, 1, 2, 3).is_err());
    }

    #[test]
    fn filling_a_world() {
        let t = Topology::filling(12, 2, 3).unwrap();
        assert_eq!((t.dp, t.tp, t.pp), (2, 2, 3));
        assert_eq!((t.world_size(), t.model_ranks()), (12, 6));
        assert!(Topology::filling(8, 3, 1).is_err());
        assert!(Topology::filling(0, 1, 1).is_err());
        assert!(Topology::filling(4, 0, 1).is_err());
    }
}
