//! Processes and ranks: the device, the launch of thread or MPI ranks (with the layout
//! picked when asked), elastic restarts, preemption, and the runner each rank drives.

pub mod device;
pub mod elastic;
pub mod launch;
pub mod preemption;
pub mod runner;
