//! The random streams' seeds: every dropout mask and random draw is a pure function of the
//! run's seed, the data-parallel replica, the micro-step and the node's position, so a run
//! draws the same values on any device, thread count or parallel layout, and a resumed run
//! draws what the uninterrupted one would.

/// Combine two values into a well-spread seed (SplitMix64 finalizer of `a ^ rotated b`).
pub fn mix_seed(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of one micro-step's forward pass (its dropout masks): a pure function of the
/// run's seed, the data-parallel replica and the micro-step, so masks depend on neither
/// threads, devices nor how the step is cut (segments, pipeline micro-batches mix in
/// their own index on top).
pub fn micro_step_seed(run_seed: u64, replica: usize, micro_step: usize) -> u64 {
    mix_seed(mix_seed(run_seed, replica as u64), micro_step as u64)
}
