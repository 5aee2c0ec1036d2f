//! Update strategies: how a step turns averaged gradients into new parameters, replicated
//! (DDP) or sharded (ZeRO 1-3), behind one [`strategy::UpdateStrategy`] trait.

pub mod grad_norm;
pub mod replica_optimizer;
pub mod strategy;
pub mod zero;
