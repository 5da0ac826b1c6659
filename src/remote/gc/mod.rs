//! Retention and garbage collection under the lock protocol (`retention`),
//! and the rewrite of packs that are mostly dead (`repack`).

pub(crate) mod repack;
pub(crate) mod retention;

use crate::remote::gc::retention::GcReport;
use crate::remote::write::Writer;
use crate::remote::Remote;
use crate::{Result, Retention};

/// A remote's collector: retention and garbage collection, and the
/// rewrite of packs that are mostly dead (it writes packs and commits).
#[derive(Clone, Copy)]
pub(crate) struct Collector<'r> {
    write: Writer<'r>,
}

impl<'r> Collector<'r> {
    pub(crate) fn over(write: Writer<'r>) -> Collector<'r> {
        Collector { write }
    }
}

impl<'r> std::ops::Deref for Collector<'r> {
    type Target = Writer<'r>;
    fn deref(&self) -> &Writer<'r> {
        &self.write
    }
}

impl Remote {
    /// The steps `policy` would delete from the bucket, ascending.
    pub fn retention_preview(&self, policy: &Retention) -> Result<Vec<u64>> {
        self.collector().retention_preview(policy)
    }

    /// Delete the steps `policy` does not keep (as
    /// [`CheckpointStore::apply_retention`](crate::CheckpointStore::apply_retention)
    /// does locally; the bucket has no pins), then the chunks no remaining step
    /// needs ([`collect_garbage`](Self::collect_garbage)). Returns the steps
    /// deleted. A push does not upload a deleted step again.
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Remote, Retention};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// # let remote = Remote::open(&format!("file://{}", dir.path().join("bucket").display()))?;
    /// for step in 1..=4 {
    ///     store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), step))?;
    /// }
    /// remote.push(&store)?;
    /// assert_eq!(remote.apply_retention(&Retention::new().keep_last(2))?, vec![1, 2]);
    /// assert_eq!(remote.steps()?, vec![3, 4]);
    /// assert!(remote.push(&store)?.steps_pushed.is_empty()); // 1 and 2 stay deleted
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidOptions`](crate::Error::InvalidOptions) for a policy
    /// that keeps nothing (see [`Retention::allow_deleting_all`]);
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket
    /// fails.
    pub fn apply_retention(&self, policy: &Retention) -> Result<Vec<u64>> {
        self.collector().apply_retention(policy)
    }

    /// [`apply_retention`](Self::apply_retention), reporting what the
    /// garbage collection after it did too.
    pub fn gc(&self, policy: &Retention) -> Result<GcReport> {
        self.collector().gc(policy)
    }

    /// Delete the chunks no committed step names and the manifests no
    /// commit names, if older than the grace period; nothing at all while
    /// a push is in flight.
    ///
    /// # Errors
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket fails.
    pub fn collect_garbage(&self) -> Result<GcReport> {
        self.collector().collect_garbage()
    }
}
