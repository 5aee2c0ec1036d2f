//! The run's parallel layout: [`parallel_plan::ParallelPlan`] builds the passes, the update
//! strategy and the model cuts for one layout; [`auto_layout`] picks a layout that fits;
//! [`memory_plan`] and [`memory_counts`] say what each layout holds per device;
//! [`streamed_export`] is how the ranks hand a cut model to world rank 0 for export.

pub mod auto_layout;
pub mod memory_counts;
pub mod memory_plan;
pub mod parallel_plan;
pub mod streamed_export;
