//! The public API: [`CheckpointStore`] and what its methods take and return.
//! Each method is a few lines over the engine (`crate::engine`) and the
//! database handle (`crate::db`).

mod asynch;
mod chunk_map;
mod commit;
mod copy;
mod files;
mod hf;
mod manage;
mod open;
mod options;
mod ranges;
mod read;
#[cfg(feature = "remote")]
mod remembered;
#[cfg(feature = "remote")]
mod replica;
mod verify;

use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::db::Db;
use crate::Result;
use asynch::AsyncWriter;

pub use asynch::CommitHandle;
pub use chunk_map::ChunkMap;
pub use options::StoreOptions;
#[cfg(feature = "remote")]
pub(crate) use replica::{Replica, Replication};

/// A store of training checkpoints in one redb file, keyed by step.
///
/// Every method takes `&self`; share a store between threads with an `Arc`.
/// A store belongs to the process that opened it: in a child made by
/// `fork()` every call fails with [`Error::Forked`](crate::Error::Forked)
/// and dropping it does nothing (open the store again in the child).
/// A commit is one write transaction that makes the step (large commits
/// write their new chunks in transactions of their own first, which no
/// step references until that one): the step is visible, whole, once
/// [`commit`](Self::commit) returns, and not at all before.
///
/// ```
/// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
/// # let dir = tempfile::tempdir()?;
/// let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
/// let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 100);
/// ckpt.set_optimizer_state("adam_m", vec![0u8; 4096]);
/// let info = store.commit(&ckpt)?;
/// assert_eq!(info.step, 100);
/// assert_eq!(store.latest()?, Some(ckpt));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CheckpointStore {
    db: Arc<Db>,
    /// The background writer of `commit_async`, started on first use.
    writer: Mutex<Option<AsyncWriter>>,
    /// Background replication, with `StoreOptions::replicate_to`; dropped
    /// after the writer, whose last commits it may still see.
    #[cfg(feature = "remote")]
    replicator: Option<Box<dyn Replica>>,
}

impl CheckpointStore {
    fn from_db(db: Db) -> Self {
        Self::sharing(Arc::new(db))
    }

    /// A handle of its own on `db`, without background threads.
    fn sharing(db: Arc<Db>) -> Self {
        CheckpointStore {
            db,
            writer: Mutex::new(None),
            #[cfg(feature = "remote")]
            replicator: None,
        }
    }

    /// Start replicating to `target` (from the options), if any.
    #[cfg(feature = "remote")]
    fn start_replication(mut self, target: Option<&dyn Replication>) -> Result<Self> {
        let Some(target) = target else {
            return Ok(self);
        };
        let replicator = target.start(Self::sharing(self.db.clone()))?;
        self.db.set_after_write(replicator.on_write());
        self.replicator = Some(replicator);
        Ok(self)
    }

    /// Where background replication ([`StoreOptions::replicate_to`])
    /// stands, or `None` if this store does not replicate.
    #[cfg(feature = "remote")]
    pub fn replication_status(&self) -> Result<Option<crate::ReplicationStatus>> {
        self.check_process()?;
        self.replicator.as_ref().map(|r| r.status(self)).transpose()
    }

    /// Wait for background replication to cover every write so far.
    #[cfg(feature = "remote")]
    fn flush_replication(&self) -> Result<()> {
        match &self.replicator {
            Some(r) => r.flush(self),
            None => Ok(()),
        }
    }

    #[cfg(not(feature = "remote"))]
    #[allow(clippy::unused_self, clippy::unnecessary_wraps)]
    fn flush_replication(&self) -> Result<()> {
        Ok(())
    }

    /// Open the store at `path` with default [`StoreOptions`], creating it if
    /// it does not exist.
    ///
    /// # Errors
    /// [`Error::Open`](crate::Error::Open) when the file cannot be opened
    /// as a redb database (a directory, a file of another kind, a damaged
    /// file), [`Error::Locked`](crate::Error::Locked) while another writer
    /// holds it, [`Error::NotAStore`](crate::Error::NotAStore) for a redb
    /// database that is not a ckptstore, and
    /// [`Error::UnsupportedFormat`](crate::Error::UnsupportedFormat) for a
    /// store of a newer format.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        StoreOptions::new().open(path)
    }

    /// Open an existing store read-only with default [`StoreOptions`].
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let path = dir.path().join("run.ckpt");
    /// let writer = CheckpointStore::open(&path)?;
    /// writer.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// drop(writer);
    /// let reader = CheckpointStore::open_read_only(&path)?;
    /// assert_eq!(reader.steps()?, vec![1]);
    /// assert!(reader.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 2)).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn open_read_only(path: impl AsRef<Path>) -> Result<Self> {
        StoreOptions::new().open_read_only(path)
    }

    /// The store file's path.
    pub fn path(&self) -> &Path {
        self.db.path()
    }

    /// Whether the store was opened read-only.
    pub fn is_read_only(&self) -> bool {
        self.db.is_read_only()
    }

    /// Whether this read-only store was opened after its writer died
    /// without closing it (kill -9, a crash, a power cut) and before any
    /// writable open repaired it. Such a store is read as the repair would
    /// leave it: redb repairs a copy of its bookkeeping in memory, and the
    /// file is not changed. What it shows does not change while the file
    /// does not: once a writer opens the store and changes it, the next
    /// read opens it again and sees the store as that writer left it (a
    /// read under way runs again), so a step is whole or gone, never
    /// damaged by what the writer did since.
    pub fn recovered_in_memory(&self) -> bool {
        self.db.is_recovered_view()
    }
}

impl CheckpointStore {
    /// Refuse work in a forked child of the process that opened the store.
    pub(crate) fn check_process(&self) -> Result<()> {
        if self.db.forked() {
            // The database refuses it, naming the store and the processes.
            return self
                .db
                .read(&|| "checking the process".to_owned(), |_| Ok(()));
        }
        Ok(())
    }
}

impl Drop for CheckpointStore {
    /// In a forked child, nothing: the background threads are the
    /// parent's (they do not exist here), and so are the database and its
    /// file locks. They are leaked, and the parent's store is untouched.
    fn drop(&mut self) {
        if !self.db.forked() {
            return;
        }
        let writer = self
            .writer
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(w) = writer.take() {
            std::mem::forget(w);
        }
        #[cfg(feature = "remote")]
        if let Some(r) = self.replicator.take() {
            std::mem::forget(r);
        }
    }
}

impl std::fmt::Debug for CheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointStore")
            .field("path", &self.db.path())
            .field("settings", self.db.settings())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod legacy_metrics;
#[cfg(test)]
mod pack_faults;
#[cfg(test)]
mod pack_power_cuts;
#[cfg(test)]
mod sim_disk;

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn store_is_send_sync() {
        assert_send_sync::<CheckpointStore>();
    }
}
