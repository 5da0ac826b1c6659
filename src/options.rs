//! How to open a store: [`StoreOptions`] and [`Durability`].

#[cfg(doc)]
use crate::CheckpointStore;
use crate::{Error, Result, Retention};

/// When a commit is on disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Durability {
    /// Every commit is fsynced before it returns. The default.
    #[default]
    Immediate,
    /// Commits are not fsynced: a crash may lose the latest commits, though
    /// never leave a partial one. Faster; needs an exclusive store
    /// ([`StoreOptions::shared`]`(false)`), since readers in other processes
    /// only see durable commits.
    Eventual,
}

/// How to open a [`CheckpointStore`].
///
/// ```
/// use ckptstore::{Durability, StoreOptions};
/// # let dir = tempfile::tempdir()?;
/// let store = StoreOptions::new()
///     .cache_size(16 << 20)
///     .shared(false)
///     .durability(Durability::Eventual)
///     .open(dir.path().join("run.ckpt"))?;
/// assert!(store.steps()?.is_empty());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct StoreOptions {
    pub(crate) cache_size: usize,
    pub(crate) durability: Durability,
    pub(crate) shared: bool,
    pub(crate) retention: Retention,
    pub(crate) check_integrity: bool,
    pub(crate) async_queue_depth: usize,
    pub(crate) quick_repair: bool,
    #[cfg(feature = "remote")]
    pub(crate) replicate_to: Option<std::sync::Arc<crate::Remote>>,
}

/// Default page cache: a commit then needs at most the checkpoint plus
/// 64 MiB of memory (redb's own default of 1 GiB shows up as resident
/// memory).
const DEFAULT_CACHE_SIZE: usize = 56 << 20;

/// Smallest page cache accepted.
pub(crate) const MIN_CACHE_SIZE: usize = 1 << 20;

/// Most background commits that may wait in the queue.
pub(crate) const MAX_ASYNC_QUEUE_DEPTH: usize = 1024;

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            cache_size: DEFAULT_CACHE_SIZE,
            durability: Durability::Immediate,
            shared: true,
            retention: Retention::new(),
            check_integrity: false,
            async_queue_depth: 2,
            quick_repair: true,
            #[cfg(feature = "remote")]
            replicate_to: None,
        }
    }
}

impl StoreOptions {
    /// The defaults: 56 MiB cache, durable commits, readable by other
    /// processes while this one writes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of memory redb may use to cache pages (default 56 MiB, so that
    /// a commit needs at most the checkpoint plus 64 MiB of memory; redb's
    /// own default of 1 GiB shows up as resident memory). A commit with
    /// more than a quarter of this in new chunks writes them in
    /// transactions of a quarter each before the one that makes the step:
    /// redb would otherwise evict, read back and rewrite its pages.
    pub fn cache_size(mut self, bytes: usize) -> Self {
        self.cache_size = bytes;
        self
    }

    /// When a commit reaches the disk (default [`Durability::Immediate`]).
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Whether other processes may open the store read-only while this one
    /// writes (default `true`). With `false` the writer locks the file for
    /// itself.
    pub fn shared(mut self, shared: bool) -> Self {
        self.shared = shared;
        self
    }

    /// How many checkpoints [`CheckpointStore::commit_async`] may queue
    /// before it blocks the caller (default 2; at least 1). Memory held by
    /// queued commits is at most this many checkpoints plus the one being
    /// written.
    ///
    /// 0 counts as 1; more than 1,024 is refused when the store opens
    /// ([`Error::InvalidOptions`]).
    pub fn async_queue_depth(mut self, depth: usize) -> Self {
        self.async_queue_depth = depth.max(1);
        self
    }

    /// Check the checksum of every redb page when opening for writing
    /// (default `false`).
    ///
    /// redb trusts a cleanly closed file. ckptstore hashes every chunk and
    /// manifest, so damage inside them is always reported, and panics redb
    /// raises on damaged pages are turned into [`Error::Corrupt`]; but some
    /// damage to redb's own pages can make redb panic while already
    /// unwinding, which aborts the process. With this set, a damaged file is
    /// refused at open instead, at the cost of reading the whole file on
    /// every open, and with no partial access to the intact steps. Read-only
    /// opens never check.
    pub fn check_integrity(mut self, enabled: bool) -> Self {
        self.check_integrity = enabled;
        self
    }

    /// Make every commit record redb's allocator state and commit in two
    /// phases, so that opening the store after a crash loads that state
    /// instead of walking the whole file (default `true`).
    ///
    /// With it, recovery after kill -9 reads megabytes in milliseconds
    /// whatever the store's size; without it, the first writable open after
    /// a crash reads the whole file, twice (bench/README.md has the
    /// figures of both, and what each commit costs). Turn it off only for a
    /// store that is cheap to re-read and whose commits must be as fast as
    /// they can be.
    pub fn quick_repair(mut self, enabled: bool) -> Self {
        self.quick_repair = enabled;
        self
    }

    /// A retention policy applied in the transaction of every commit: the
    /// steps it does not keep are deleted with the commit, atomically
    /// (default: keep everything). See also
    /// [`CheckpointStore::apply_retention`].
    pub fn retention(mut self, policy: Retention) -> Self {
        self.retention = policy;
        self
    }

    /// Replicate every committed step to `remote` in the background: after
    /// each local commit a thread uploads what the bucket lacks
    /// ([`push`](crate::CheckpointStore::push)); a failed upload is
    /// retried with backoff (1 s doubling to 60 s) and reported by
    /// [`flush`](crate::CheckpointStore::flush) (which waits for uploads)
    /// and [`replication_status`](crate::CheckpointStore::replication_status).
    /// Opening the store starts with a push, so uploads cut short by a
    /// crash or a restart resume. Only for stores opened for writing.
    ///
    /// ```
    /// use ckptstore::{ComputationGraphStore, GradientCheckpoint, Remote, StoreOptions};
    /// # let dir = tempfile::tempdir()?;
    /// let remote = Remote::open(&format!("file://{}/bucket", dir.path().display()))?;
    /// let store = StoreOptions::new()
    ///     .replicate_to(remote)
    ///     .open(dir.path().join("run.ckpt"))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// store.flush()?; // waits for the upload
    /// let status = store.replication_status()?.expect("replicating");
    /// assert!(status.pending.is_empty());
    /// # let remote = Remote::open(&format!("file://{}/bucket", dir.path().display()))?;
    /// assert_eq!(remote.steps()?, vec![1]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(feature = "remote")]
    pub fn replicate_to(mut self, remote: crate::Remote) -> Self {
        self.replicate_to = Some(std::sync::Arc::new(remote));
        self
    }

    /// Check each option's range.
    pub(crate) fn validate(&self) -> Result<()> {
        if !(1..=MAX_ASYNC_QUEUE_DEPTH).contains(&self.async_queue_depth) {
            return Err(Error::InvalidOptions(format!(
                "async_queue_depth is {}; it must be from 1 to {MAX_ASYNC_QUEUE_DEPTH}",
                self.async_queue_depth
            )));
        }
        self.retention.check_keeps_something()?;
        if self.cache_size < MIN_CACHE_SIZE {
            return Err(Error::InvalidOptions(format!(
                "cache_size is {} bytes; it must be at least {MIN_CACHE_SIZE} (1 MiB)",
                self.cache_size
            )));
        }
        Ok(())
    }
}
