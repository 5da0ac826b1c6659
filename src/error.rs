//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong in ckptstore.
///
/// Each variant carries the context needed to act on it: the step, the file
/// or the table involved. The enum is `#[non_exhaustive]`: match the variants
/// you handle and keep a catch-all arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file or directory could not be read or written.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done ("write", "rename", "read", ...).
        op: &'static str,
        /// The file or directory involved.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The store file could not be opened by redb.
    #[error("cannot open checkpoint store {path}: {source}")]
    Open {
        /// The store file.
        path: PathBuf,
        /// redb's reason.
        #[source]
        source: redb::DatabaseError,
    },

    /// The file is a redb database (or something else) but not a ckptstore.
    #[error("{path} is not a ckptstore file: {reason}")]
    NotAStore {
        /// The file that was opened.
        path: PathBuf,
        /// Why it was rejected.
        reason: String,
    },

    /// The store (or one manifest in it) was written by a newer ckptstore.
    #[error("{what} has format version {found}; this build of ckptstore reads versions up to {supported}")]
    UnsupportedFormat {
        /// What carries the version: the store file or a step's manifest.
        what: String,
        /// The version found.
        found: u32,
        /// The newest version this build understands.
        supported: u32,
    },

    /// `commit` was asked to store a step that is already stored.
    #[error("step {step} is already stored; use replace() to overwrite it")]
    StepExists {
        /// The step number.
        step: u64,
    },

    /// A checkpoint cannot be stored as it is.
    #[error("checkpoint of step {step} cannot be stored: {reason}")]
    InvalidCheckpoint {
        /// The step number.
        step: u64,
        /// What is wrong with it.
        reason: String,
    },

    /// An operation would delete a pinned step.
    #[error("step {step} is pinned; unpin it before {op}")]
    StepPinned {
        /// The pinned step.
        step: u64,
        /// The refused operation ("removing it", "rolling back past it").
        op: &'static str,
    },

    /// One or more background commits failed.
    #[error("background commit of step(s) {steps:?} failed: {reason}")]
    AsyncCommitFailed {
        /// The steps whose commits failed.
        steps: Vec<u64>,
        /// The first failure's message.
        reason: String,
    },

    /// A step named by the caller is not stored.
    #[error("step {step} is not in the store")]
    StepNotFound {
        /// The step number.
        step: u64,
    },

    /// Stored data failed its integrity check (hash mismatch, missing chunk,
    /// undecodable manifest).
    #[error("corrupt data{}: {detail}", step.map(|s| format!(" in step {s}")).unwrap_or_default())]
    Corrupt {
        /// The step whose data is damaged, when it is known.
        step: Option<u64>,
        /// What is wrong.
        detail: String,
    },

    /// A redb operation failed.
    #[error("storage error while {context}: {source}")]
    Storage {
        /// What ckptstore was doing ("committing step 42", "reading table steps").
        context: String,
        /// redb's error.
        #[source]
        source: redb::Error,
    },

    /// The store was opened read-only and a write was attempted.
    #[error("store {path} is open read-only; {op} needs a writable store")]
    ReadOnly {
        /// The store file.
        path: PathBuf,
        /// The refused operation.
        op: &'static str,
    },

    /// The options given to open a store contradict each other.
    #[error("invalid store options: {0}")]
    InvalidOptions(String),

    /// A checkpoint JSON file could not be encoded or decoded.
    #[error("checkpoint JSON {path}: {source}")]
    Json {
        /// The file involved.
        path: PathBuf,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },

    /// A graph operation named a node that is not in the graph.
    #[error("node {id} is not in the computation graph")]
    UnknownNode {
        /// The node id.
        id: String,
    },

    /// The computation graph has a cycle, so it has no topological order.
    #[error("computation graph has a cycle: {stuck} of {total} nodes are on or behind it")]
    GraphCycle {
        /// Nodes that could not be ordered.
        stuck: usize,
        /// Nodes in the graph.
        total: usize,
    },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn corrupt(step: Option<u64>, detail: impl Into<String>) -> Self {
        Error::Corrupt {
            step,
            detail: detail.into(),
        }
    }

    /// True when the error comes from the storage device (an I/O error, or
    /// redb refusing work after one): the store reopens its file before the
    /// next operation.
    pub fn is_io(&self) -> bool {
        match self {
            Error::Io { .. } => true,
            Error::Storage { source, .. } => {
                matches!(source, redb::Error::Io(_) | redb::Error::PreviousIo)
            }
            _ => false,
        }
    }
}

/// Attach context to a redb result.
pub(crate) trait StorageContext<T> {
    /// Wrap the error with a description of what was being done.
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Into<redb::Error>> StorageContext<T> for std::result::Result<T, E> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::Storage {
            context: what(),
            source: e.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync + 'static>() {}

    #[test]
    fn error_is_send_sync() {
        assert_send_sync::<Error>();
    }

    #[test]
    fn corrupt_message_names_the_step() {
        let e = Error::corrupt(Some(42), "chunk missing");
        assert_eq!(e.to_string(), "corrupt data in step 42: chunk missing");
        let e = Error::corrupt(None, "bad meta");
        assert_eq!(e.to_string(), "corrupt data: bad meta");
    }
}
