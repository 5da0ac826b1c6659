//! Copies of an error for a second reader (a background failure goes to
//! its handle and to `flush`, a replication failure to every `flush`).

use super::{Cause, Error};

impl Error {
    /// A copy for a second reader of one failure (a background commit's
    /// error goes to its handle and to `flush`): the variant and its fields
    /// are kept; a source is kept as its message, with its I/O kind.
    pub(crate) fn duplicate(&self) -> Error {
        let io = self.is_io();
        let cause = |c: &Cause| -> Cause {
            Box::new(Detached {
                message: c.to_string(),
                io,
            })
        };
        match self {
            Error::Io { op, path, source } => Error::Io {
                op,
                path: path.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
            Error::Open { path, source } => Error::Open {
                path: path.clone(),
                source: cause(source),
            },
            Error::Storage { context, source } => Error::Storage {
                context: context.clone(),
                source: cause(source),
            },
            Error::Json { path, source } => Error::Json {
                path: path.clone(),
                source: cause(source),
            },
            Error::AsyncCommitFailed { steps, source } => Error::AsyncCommitFailed {
                steps: steps.clone(),
                source: Box::new(source.duplicate()),
            },
            Error::Locked { path } => Error::Locked { path: path.clone() },
            Error::ShardedStep { .. }
            | Error::WorldSizeMismatch { .. }
            | Error::ReplicationFailed { .. }
            | Error::RemoteBusy { .. }
            | Error::Remote { .. }
            | Error::InvalidUrl { .. }
            | Error::NoBucket { .. }
            | Error::PrefixOwned { .. } => self.duplicate_remote(),
            Error::NotAStore { path, reason } => Error::NotAStore {
                path: path.clone(),
                reason: reason.clone(),
            },
            Error::UnsupportedFormat {
                what,
                found,
                supported,
            } => Error::UnsupportedFormat {
                what: what.clone(),
                found: *found,
                supported: *supported,
            },
            Error::StepExists { step } => Error::StepExists { step: *step },
            Error::InvalidSafetensors { path, reason } => Error::InvalidSafetensors {
                path: path.clone(),
                reason: reason.clone(),
            },
            Error::InvalidTensor { name, reason } => Error::InvalidTensor {
                name: name.clone(),
                reason: reason.clone(),
            },
            Error::InvalidCheckpoint { step, reason } => Error::InvalidCheckpoint {
                step: *step,
                reason: reason.clone(),
            },
            Error::StepPinned { step, op } => Error::StepPinned { step: *step, op },
            Error::StepNotFound { step } => Error::StepNotFound { step: *step },
            Error::WriterStopped { detail } => Error::WriterStopped {
                detail: detail.clone(),
            },
            Error::Busy { path, op } => Error::Busy {
                path: path.clone(),
                op,
            },
            Error::StepsNotFound { steps } => Error::StepsNotFound {
                steps: steps.clone(),
            },
            Error::Corrupt { step, detail } => Error::Corrupt {
                step: *step,
                detail: detail.clone(),
            },
            Error::Poisoned { path, detail } => Error::Poisoned {
                path: path.clone(),
                detail: detail.clone(),
            },
            Error::ReadOnly { path, op } => Error::ReadOnly {
                path: path.clone(),
                op,
            },
            Error::InvalidOptions(m) => Error::InvalidOptions(m.clone()),
            Error::StoreChanged { .. } | Error::Forked { .. } => self.duplicate_handle(),
            Error::UnknownNode { id } => Error::UnknownNode { id: id.clone() },
            Error::GraphCycle { stuck, total } => Error::GraphCycle {
                stuck: *stuck,
                total: *total,
            },
        }
    }

    /// [`duplicate`](Self::duplicate) of the errors about a handle's use.
    fn duplicate_handle(&self) -> Error {
        match self {
            Error::StoreChanged { path } => Error::StoreChanged { path: path.clone() },
            Error::Forked {
                what,
                opened_by,
                this,
            } => Error::Forked {
                what: what.clone(),
                opened_by: *opened_by,
                this: *this,
            },
            e => Error::InvalidOptions(e.to_string()),
        }
    }

    /// [`duplicate`](Self::duplicate) of the object-storage errors.
    fn duplicate_remote(&self) -> Error {
        let cause = |c: &Cause| -> Cause {
            Box::new(Detached {
                message: c.to_string(),
                io: false,
            })
        };
        match self {
            Error::ReplicationFailed { url, steps, source } => Error::ReplicationFailed {
                url: url.clone(),
                steps: steps.clone(),
                source: Box::new(source.duplicate()),
            },
            Error::RemoteBusy { url, detail } => Error::RemoteBusy {
                url: url.clone(),
                detail: detail.clone(),
            },
            Error::InvalidUrl { url, reason } => Error::InvalidUrl {
                url: url.clone(),
                reason: reason.clone(),
            },
            Error::NoBucket { url, source } => Error::NoBucket {
                url: url.clone(),
                source: source.as_ref().map(cause),
            },
            Error::PrefixOwned { url, owner, ours } => Error::PrefixOwned {
                url: url.clone(),
                owner: owner.clone(),
                ours: ours.clone(),
            },
            Error::Remote { op, url, source } => Error::Remote {
                op: op.clone(),
                url: url.clone(),
                source: cause(source),
            },
            Error::ShardedStep { step, world_size } => Error::ShardedStep {
                step: *step,
                world_size: *world_size,
            },
            Error::WorldSizeMismatch {
                url,
                step,
                ours,
                theirs,
            } => Error::WorldSizeMismatch {
                url: url.clone(),
                step: *step,
                ours: *ours,
                theirs: *theirs,
            },
            e => Error::InvalidOptions(e.to_string()),
        }
    }
}

/// An error kept as its message and whether it was an I/O error (see
/// [`Error::duplicate`]).
#[derive(Debug)]
pub(super) struct Detached {
    message: String,
    pub(super) io: bool,
}

impl std::fmt::Display for Detached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Detached {}
