//! Where a store's bytes live: a file path, or a caller's redb
//! `StorageBackend` (fault injection, custom storage).

use std::fmt;
use std::ops::Bound;
use std::path::PathBuf;
use std::sync::Arc;

use redb::{BackendError, StorageBackend};

use crate::engine::packs::PackDir;

/// Makes a fresh backend each time the store (re)opens its database.
pub(crate) type BackendFactory = Arc<dyn Fn() -> std::io::Result<DynBackend> + Send + Sync>;

/// What a store opens.
#[derive(Clone)]
pub(crate) enum Source {
    /// A file, created if missing (for writable opens).
    Path(PathBuf),
    /// A caller's backend; the path is only a name for messages. Its pack
    /// files, if it has any, are on a file system of the caller's (tests
    /// that cut the power under both).
    Backend(PathBuf, BackendFactory, Option<PackDir>),
}

impl Source {
    pub(crate) fn path(&self) -> &PathBuf {
        match self {
            Source::Path(p) | Source::Backend(p, ..) => p,
        }
    }

    /// The directory of the store's pack files; `None` for a caller's
    /// backend without one, which keeps every chunk in redb.
    pub(crate) fn pack_dir(&self) -> Option<PackDir> {
        match self {
            Source::Path(p) => Some(PackDir::real(crate::format::packs::pack_dir(p))),
            Source::Backend(_, _, packs) => packs.clone(),
        }
    }
}

/// A boxed backend, forwarding every method (locks included, so shared
/// concurrency modes keep working).
pub(crate) struct DynBackend(pub(crate) Box<dyn StorageBackend>);

impl fmt::Debug for DynBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl StorageBackend for DynBackend {
    fn len(&self) -> std::io::Result<u64> {
        self.0.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.0.read(offset, out)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.0.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        self.0.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.0.write(offset, data)
    }
    fn close(&self) -> std::io::Result<()> {
        self.0.close()
    }
    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.0.try_lock_range(start, end)
    }
    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.0.try_lock_shared_range(start, end)
    }
    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.0.lock_range(start, end)
    }
    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.0.lock_shared_range(start, end)
    }
    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.0.unlock_range(start, end)
    }
    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.0.query_lock_range(start, end)
    }
}
