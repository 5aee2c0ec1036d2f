//! Errors of collective operations.

/// A collective failed: a peer died, timed out, or sent something unexpected.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A peer rank is gone or did not answer in time.
    #[error("rank {rank}: peer failure: {message}")]
    Peer {
        /// The rank that observed the failure.
        rank: usize,
        /// What happened.
        message: String,
    },
    /// A collective waited longer than the group's timeout (`collective_timeout`): which
    /// operation, how many bytes, which group, and which ranks never arrived.
    #[error("rank {rank}: collective timed out: {message}")]
    Timeout {
        /// The rank that gave up waiting.
        rank: usize,
        /// The operation, its bytes, the group, the ranks that never arrived.
        message: String,
    },
    /// Buffers or arguments disagree across ranks or with the group.
    #[error("rank {rank}: invalid collective call: {message}")]
    Invalid {
        /// The rank that observed the problem.
        rank: usize,
        /// What was wrong.
        message: String,
    },
    /// Reading, writing or checking saved state (optimizer records, ZeRO shards,
    /// checkpoint files) failed; no collective is involved.
    #[error("{message}")]
    State {
        /// What failed, naming the file or record.
        message: String,
    },
}

/// Result of a collective.
pub type DistResult<T> = Result<T, DistError>;

/// A [`DistError::State`]: saved state that cannot be read, written or used.
pub(crate) fn state_error(message: String) -> DistError {
    DistError::State { message }
}
