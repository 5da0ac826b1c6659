//! The crate's one error type.

use std::path::PathBuf;

#[cfg(feature = "remote")]
mod bucket;
#[cfg(feature = "remote")]
pub use bucket::BucketError;
mod pack;
pub use pack::{PackError, PackOp};

/// A dependency's error, kept as [`source()`](std::error::Error::source)
/// only, so that no dependency's type is part of this crate's API.
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in ckptstore.
///
/// Each variant carries the context needed to act on it: the step, the file
/// or the operation involved; errors of redb and `serde_json` are kept as
/// [`source()`](std::error::Error::source). The enum is `#[non_exhaustive]`:
/// match the variants you handle and keep a catch-all arm, or ask
/// [`is_io`](Error::is_io) and [`is_locked`](Error::is_locked).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A bucket (object storage, or a directory used as one) failed,
    /// refused, or holds what this operation cannot use: its own error.
    #[cfg(feature = "remote")]
    #[error(transparent)]
    Bucket(#[from] BucketError),

    /// A store's pack files (where large chunks live beside its file)
    /// could not be read or written, or hold damage: their own error.
    #[error(transparent)]
    Pack(#[from] PackError),

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

    /// The store file could not be opened (a directory, a file of another
    /// kind, a damaged file).
    #[error("cannot open checkpoint store {path}: {source}")]
    Open {
        /// The store file.
        path: PathBuf,
        /// Why: redb's error.
        #[source]
        source: Cause,
    },

    /// Another process (or another handle in this one) holds the store for
    /// writing, or holds it exclusively.
    #[error(
        "checkpoint store {path} is locked by another writer (a training run, or a \
         `ckpt` command that writes); readers can open it read-only meanwhile"
    )]
    Locked {
        /// The store file.
        path: PathBuf,
    },

    /// This process already has the store open for writing, through
    /// another handle (one writer per store; share the handle).
    #[error(
        "checkpoint store {path} is already open for writing in this process: use that \
         handle (share it with an Arc; in Python, one Store), or drop it before opening \
         the store again"
    )]
    AlreadyOpen {
        /// The store file.
        path: PathBuf,
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
    #[error("step {step} is already stored; replace() overwrites it")]
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

    /// A tensor's data does not match its dtype and shape.
    #[error("tensor{}: {reason}", name.as_ref().map(|n| format!(" {n:?}")).unwrap_or_default())]
    InvalidTensor {
        /// The tensor's name, when it has one.
        name: Option<String>,
        /// What is wrong, with the numbers.
        reason: String,
    },

    /// A safetensors file cannot be imported (nothing was written).
    #[error("safetensors file {path}: {reason}")]
    InvalidSafetensors {
        /// The file.
        path: PathBuf,
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
    #[error("background commit of step(s) {steps:?} failed: {source}")]
    AsyncCommitFailed {
        /// The steps whose commits failed.
        steps: Vec<u64>,
        /// The first failure.
        #[source]
        source: Box<Error>,
    },

    /// The background writer of `commit_async` stopped.
    #[error("{detail}")]
    WriterStopped {
        /// What happened.
        detail: String,
    },

    /// An operation needs the store to itself and readers are using it.
    #[error(
        "{op} of {path} needs no read in progress, and a reader (in this process, or a \
         `ckpt` command or job that opened it read-only) is reading; try again when \
         it is done"
    )]
    Busy {
        /// The store file.
        path: PathBuf,
        /// The refused operation.
        op: &'static str,
    },

    /// A store file changed while its pages were checked: a writer is
    /// committing, and what was read is no one state of the file.
    #[error(
        "{path} changed while its pages were checked (a writer is committing): page checks \
         need the writer to be gone; stop it or check a copy (`ckpt verify` without --pages \
         checks every hash beside a writer)"
    )]
    StoreChanged {
        /// The store file.
        path: PathBuf,
    },

    /// A read lost a race with a writer three times in a row: a pack file
    /// it needed was deleted after the read began, because the step was
    /// removed (by retention, `remove` or a replace) or `compact` moved its
    /// chunks. (A read that loses once runs again in a new transaction.)
    /// Read again: the store as it is now answers.
    #[error(
        "{detail}: a writer deleted it after the read began (the step was removed, or \
         compaction moved its chunks); read again"
    )]
    ReadInterrupted {
        /// Which file went.
        detail: String,
    },

    /// A step named by the caller is not stored.
    #[error("step {step} is not in the store")]
    StepNotFound {
        /// The step number.
        step: u64,
    },

    /// Steps named by the caller are not stored (nothing was changed).
    #[error("{} not in the store; nothing was changed", match steps.as_slice() {
        [one] => format!("step {one} is"),
        many => format!("steps {many:?} are"),
    })]
    StepsNotFound {
        /// The missing steps, ascending.
        steps: Vec<u64>,
    },

    /// A ranged read asked for bytes a step does not hold: an entry it
    /// does not store, or bytes beyond an entry's end.
    #[error("step {step}: {detail}")]
    RangeNotStored {
        /// The step read.
        step: u64,
        /// Which entry and bytes, and what the step holds.
        detail: String,
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

    /// A file of a node's directory of the local tier (a record, an
    /// in-bucket mark) is not what the tier writes (damaged, of another
    /// format, not matching its name), or a record given to be written is
    /// not one a reader would take.
    #[error("{path}: {reason}")]
    TierFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A redb operation failed.
    #[error("storage error while {context}: {source}")]
    Storage {
        /// What ckptstore was doing ("committing step 42", "reading table steps").
        context: String,
        /// redb's error.
        #[source]
        source: Cause,
    },

    /// redb panicked inside this handle (a damaged page, most likely): the
    /// handle refuses all work. Drop it and open the store again; `ckpt
    /// verify --pages` checks every page.
    #[error("checkpoint store {path} can no longer be used through this handle: {detail}; open it again")]
    Poisoned {
        /// The store file.
        path: PathBuf,
        /// What happened.
        detail: String,
    },

    /// A handle (a store or a remote) used in a process other than the one
    /// that opened it: a child made by `fork()`. Its database, threads and
    /// locks belong to the parent; open the store again in the child.
    #[error(
        "{what} was opened by process {opened_by}; this is process {this} (a fork): \
         open it again here"
    )]
    Forked {
        /// The store file or the bucket's URL.
        what: String,
        /// The process that opened it.
        opened_by: u32,
        /// This process.
        this: u32,
    },

    /// The store was opened read-only and a write was attempted.
    #[error("store {path} is open read-only; {op} needs a writable store")]
    ReadOnly {
        /// The store file.
        path: PathBuf,
        /// The refused operation.
        op: &'static str,
    },

    /// The options given to open a store are out of range or contradict
    /// each other.
    #[error("invalid store options: {0}")]
    InvalidOptions(String),

    /// A checkpoint JSON file could not be encoded or decoded.
    #[error("checkpoint JSON{}: {source}", path.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    Json {
        /// The file involved, if any.
        path: Option<PathBuf>,
        /// `serde_json`'s error.
        #[source]
        source: Cause,
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
    /// redb refusing work after one), here or in a background commit: the
    /// store reopens its file before the next operation.
    ///
    /// ```
    /// # use ckptstore::Error;
    /// let e = Error::StepNotFound { step: 3 };
    /// assert!(!e.is_io());
    /// ```
    pub fn is_io(&self) -> bool {
        match self {
            Error::Io { .. } | Error::Pack(PackError::Io { .. }) => true,
            Error::Storage { source, .. } => {
                matches!(
                    source.downcast_ref::<redb::Error>(),
                    Some(redb::Error::Io(_) | redb::Error::PreviousIo)
                )
            }
            Error::AsyncCommitFailed { source, .. } => source.is_io(),
            _ => false,
        }
    }

    /// The operating system's error behind this one, if there is one (for
    /// its `kind()` or errno).
    ///
    /// ```
    /// # use ckptstore::CheckpointStore;
    /// # let dir = tempfile::tempdir()?;
    /// let e = CheckpointStore::open(dir.path().join("no/such/dir/run.ckpt")).expect_err("no dir");
    /// assert_eq!(e.os_error().map(|e| e.kind()), Some(std::io::ErrorKind::NotFound));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn os_error(&self) -> Option<&std::io::Error> {
        fn storage(source: &Cause) -> Option<&std::io::Error> {
            match source.downcast_ref::<redb::DatabaseError>() {
                Some(redb::DatabaseError::Storage(redb::StorageError::Io(e))) => Some(e),
                _ => match source.downcast_ref::<redb::Error>() {
                    Some(redb::Error::Io(e)) => Some(e),
                    _ => None,
                },
            }
        }
        match self {
            Error::Io { source, .. } | Error::Pack(PackError::Io { source, .. }) => Some(source),
            Error::Open { source, .. } | Error::Storage { source, .. } => storage(source),
            Error::AsyncCommitFailed { source, .. } => source.os_error(),
            _ => None,
        }
    }

    /// True when the store is held by another writer: try again when it
    /// has finished, or open it read-only.
    ///
    /// ```
    /// # use ckptstore::CheckpointStore;
    /// # let dir = tempfile::tempdir()?;
    /// # let path = dir.path().join("run.ckpt");
    /// let writer = CheckpointStore::open(&path)?;
    /// let second = CheckpointStore::open(&path).expect_err("one writer at a time");
    /// assert!(second.is_locked());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn is_locked(&self) -> bool {
        matches!(self, Error::Locked { .. } | Error::AlreadyOpen { .. })
    }

    /// The bucket's error, when the error is one.
    ///
    /// ```
    /// # use ckptstore::{BucketError, Remote};
    /// let e = Remote::open("ftp://host/x").expect_err("no such scheme");
    /// assert!(matches!(e.bucket(), Some(BucketError::InvalidUrl { .. })));
    /// ```
    #[cfg(feature = "remote")]
    pub fn bucket(&self) -> Option<&BucketError> {
        match self {
            Error::Bucket(e) => Some(e),
            _ => None,
        }
    }

    /// The pack files' error, when the error is one.
    ///
    /// ```
    /// # use ckptstore::Error;
    /// let e = Error::StepNotFound { step: 3 };
    /// assert!(e.pack().is_none());
    /// ```
    pub fn pack(&self) -> Option<&PackError> {
        match self {
            Error::Pack(e) => Some(e),
            _ => None,
        }
    }

    /// The error with `what` (the operation, naming its step) before a
    /// storage error's context.
    pub(crate) fn within(self, what: &dyn Fn() -> String) -> Error {
        match self {
            Error::Storage { context, source } => Error::Storage {
                context: format!("{}: {context}", what()),
                source,
            },
            e => e,
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
            source: Box::new(e.into()),
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

    #[test]
    fn a_background_failure_keeps_its_kind() {
        let io = Error::Storage {
            context: "committing step 3".into(),
            source: Box::new(redb::Error::Io(std::io::Error::other("disk gone"))),
        };
        assert!(io.is_io());
        let failed = Error::AsyncCommitFailed {
            steps: vec![3],
            source: Box::new(io),
        };
        assert!(failed.is_io());
        assert!(failed.to_string().contains("disk gone"), "{failed}");
        let other = Error::Storage {
            context: "x".into(),
            source: Box::new(redb::Error::TransactionInProgress),
        };
        assert!(!other.is_io());
    }
}
