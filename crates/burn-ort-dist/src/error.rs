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
    /// Buffers or arguments disagree across ranks or with the group.
    #[error("rank {rank}: invalid collective call: {message}")]
    Invalid {
        /// The rank that observed the problem.
        rank: usize,
        /// What was wrong.
        message: String,
    },
}

/// Result of a collective.
pub type DistResult<T> = Result<T, DistError>;

/// An [`DistError::Invalid`] observed while reading or checking state (rank 0: the caller
/// knows no better).
pub(crate) fn invalid(message: String) -> DistError {
    DistError::Invalid { rank: 0, message }
}
