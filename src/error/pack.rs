//! The pack files' errors (`engine/packs`): one type, [`PackError`],
//! wrapped by one variant of the crate's error
//! ([`Error::Pack`](crate::Error::Pack)), kept beside it so that the
//! error layer names nothing above it.

use std::path::PathBuf;

/// What was being done to a pack file or the pack directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PackOp {
    /// Opening a pack file to read it.
    Open,
    /// Reading a pack file.
    Read,
    /// Creating a pack file.
    Create,
    /// Creating a pack file where the directory holds another store's.
    CreateAmongOthers,
    /// Writing a pack file.
    Write,
    /// Making a pack file durable.
    Sync,
    /// Making the pack directory's entries durable.
    SyncDirectory,
    /// Creating the pack directory.
    CreateDirectory,
    /// Listing the pack directory.
    ListDirectory,
    /// Removing a pack file.
    Remove,
}

impl std::fmt::Display for PackOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PackOp::Open => "open pack file",
            PackOp::Read => "read pack file",
            PackOp::Create => "create pack file",
            PackOp::CreateAmongOthers => {
                "create pack file (the directory holds another store's files)"
            }
            PackOp::Write => "write pack file",
            PackOp::Sync => "fsync pack file",
            PackOp::SyncDirectory => "fsync directory",
            PackOp::CreateDirectory => "create pack directory",
            PackOp::ListDirectory => "list pack directory",
            PackOp::Remove => "remove pack file",
        })
    }
}

/// What went wrong with a store's pack files. `#[non_exhaustive]`: match
/// the variants you handle and keep a catch-all arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PackError {
    /// The operating system failed an operation on a pack file or on the
    /// pack directory.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: PackOp,
        /// The file or directory.
        path: PathBuf,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },

    /// A chunk read from a pack file is not the one recorded there: its
    /// bytes fail its hash check, or its place lies past the file's end or
    /// in a directory. The store says which step it belongs to.
    #[error("a chunk {what}")]
    Damaged {
        /// The pack file's name.
        file: String,
        /// What is wrong, in words that follow "chunk HASH" (e.g. "fails
        /// its hash check in pack file ... at offset ...").
        what: String,
    },
}

impl PackError {
    pub(crate) fn io(op: PackOp, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        PackError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}
