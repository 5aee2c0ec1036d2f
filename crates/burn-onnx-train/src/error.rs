//! Error type of the importer, the interpreter and the tools around them.
//!
//! Every variant names what went wrong and where: the file, the node (name and op type) or
//! the field. Nothing in this crate panics on bad input; it returns one of these.

use std::path::PathBuf;

/// Errors raised while loading, running, training or exporting an ONNX model.
#[derive(Debug, thiserror::Error)]
pub enum OnnxError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file's bytes do not decode as what they should be (an ONNX model, a config, a
    /// `.npy` array, a checkpoint part).
    #[error("{path}: not a valid {what}: {message}")]
    Decode {
        /// The file.
        path: PathBuf,
        /// What the file should hold, e.g. `ONNX model` or `training config (TOML)`.
        what: &'static str,
        /// What the protobuf decoder or the structural check said.
        message: String,
    },
    /// The graph uses an operator this importer does not implement.
    #[error(
        "node `{node}`: unsupported operator `{op_type}` (domain `{domain}`); supported: {supported}"
    )]
    UnsupportedOp {
        /// Node name (or `<op_type>#<index>` if the node has none).
        node: String,
        /// The ONNX op type.
        op_type: String,
        /// The op domain (`ai.onnx` when empty in the file).
        domain: String,
        /// The list of supported op types.
        supported: String,
    },
    /// A node failed: a missing attribute, a bad shape, an input of the wrong type...
    #[error("node `{node}` ({op_type}): {message}")]
    Node {
        /// Node name.
        node: String,
        /// The ONNX op type.
        op_type: String,
        /// What went wrong.
        message: String,
    },
    /// A collective operation failed (a peer rank died, timed out or disagreed).
    #[error(transparent)]
    Distributed(#[from] burn_ort_dist::DistError),
    /// The run stopped on a signal (preemption) after writing a checkpoint: rerun the same
    /// command to resume from it.
    #[error("{what}: checkpoint written; run the same command again to resume")]
    Preempted {
        /// When and why, e.g. `stopped by SIGTERM after update 7`.
        what: String,
    },
    /// A training run failed before its first optimizer update (a config, data or model it
    /// cannot use, an op that cannot run): starting it again would fail the same way, so
    /// restarts skip it and the process ends with [`FAILED_BEFORE_FIRST_UPDATE`].
    #[error(transparent)]
    BeforeFirstUpdate(Box<OnnxError>),
    /// An initializer or graph-level field is malformed.
    #[error("{field}: {message}")]
    Field {
        /// The field, e.g. `initializer 'fc1.weight'` or `graph input 'input_ids'`.
        field: String,
        /// What went wrong.
        message: String,
    },
}

/// Exit status (and MPI abort code) of a training run that failed before its first update
/// (`EX_CONFIG`): `onnx-train launch` does not restart it.
pub const FAILED_BEFORE_FIRST_UPDATE: u8 = 78;

impl OnnxError {
    /// This error, marked as ending a run before its first update (once).
    pub fn before_first_update(self) -> Self {
        match self {
            e @ OnnxError::BeforeFirstUpdate(_) => e,
            e => OnnxError::BeforeFirstUpdate(Box::new(e)),
        }
    }

    /// Whether the run failed before its first update (see [`OnnxError::BeforeFirstUpdate`]).
    pub fn is_before_first_update(&self) -> bool {
        matches!(self, OnnxError::BeforeFirstUpdate(_))
    }

    /// The exit status of a training run that ended with this error:
    /// [`FAILED_BEFORE_FIRST_UPDATE`] before its first update, 1 after.
    pub fn training_exit_code(&self) -> u8 {
        if self.is_before_first_update() {
            FAILED_BEFORE_FIRST_UPDATE
        } else {
            1
        }
    }

    /// An error about a named field.
    pub fn field(field: impl Into<String>, message: impl Into<String>) -> Self {
        OnnxError::Field {
            field: field.into(),
            message: message.into(),
        }
    }

    /// An I/O error on a path.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        OnnxError::Io {
            path: path.into(),
            source,
        }
    }
}

impl From<String> for OnnxError {
    fn from(message: String) -> Self {
        OnnxError::field("worker", message)
    }
}

/// Result alias used throughout the crate.
pub type Result<T, E = OnnxError> = std::result::Result<T, E>;

/// Error of a single op, before the interpreter attaches the node's name and type to it.
#[derive(Debug, Clone, PartialEq)]
pub struct OpError(pub String);

impl<T: std::fmt::Display> From<T> for OpError {
    fn from(value: T) -> Self {
        OpError(value.to_string())
    }
}

/// Result of one op implementation.
pub type OpResult<T> = std::result::Result<T, OpError>;

/// `Err(OpError)` with a formatted message.
#[macro_export]
macro_rules! op_bail {
    ($($arg:tt)*) => {
        return Err($crate::error::OpError(format!($($arg)*)))
    };
}
