//! How to open a store: [`StoreOptions`].

#[cfg(feature = "remote")]
use std::sync::Arc;

#[cfg(feature = "remote")]
use super::replica::Replication;
use crate::options::Settings;
#[cfg(doc)]
use crate::{CheckpointStore, Error};
use crate::{Durability, Retention};

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
#[derive(Clone, Debug, Default)]
pub struct StoreOptions {
    pub(crate) settings: Settings,
    /// Where to replicate (set by `replicate_to`, in the remote layer).
    #[cfg(feature = "remote")]
    pub(crate) replicate_to: Option<Arc<dyn Replication>>,
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
    /// more than 3/8 of this in new chunks writes them in transactions of
    /// 3/8 each before the one that makes the step: redb would otherwise
    /// evict, read back and rewrite its pages.
    pub fn cache_size(mut self, bytes: usize) -> Self {
        self.settings.cache_size = bytes;
        self
    }

    /// When a commit reaches the disk (default [`Durability::Immediate`]).
    pub fn durability(mut self, durability: Durability) -> Self {
        self.settings.durability = durability;
        self
    }

    /// Whether other processes may open the store read-only while this one
    /// writes (default `true`). With `false` the writer locks the file for
    /// itself.
    pub fn shared(mut self, shared: bool) -> Self {
        self.settings.shared = shared;
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
        self.settings.async_queue_depth = depth.max(1);
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
        self.settings.check_integrity = enabled;
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
        self.settings.quick_repair = enabled;
        self
    }

    /// Threads a commit, a read or a verification may use to hash and copy
    /// chunks (default: the machine's cores, as
    /// [`std::thread::available_parallelism`] counts them). 1 does all the
    /// work on the calling thread. From 1 to 256; anything else is refused
    /// when the store opens ([`Error::InvalidOptions`]).
    pub fn threads(mut self, threads: usize) -> Self {
        self.settings.threads = threads;
        self
    }

    /// Threads a background commit ([`CheckpointStore::commit_async`] and
    /// its kin) may use (default 1: training keeps the other cores). From 1
    /// to 256.
    pub fn background_threads(mut self, threads: usize) -> Self {
        self.settings.background_threads = threads;
        self
    }

    /// Keep the chunks of large commits in pack files beside the store
    /// rather than in its redb file (default `true`; `false` keeps every
    /// chunk in the redb file, as ckptstore 0.3 did). A commit (or a staged part of one) with at least
    /// [`pack_threshold`](Self::pack_threshold) bytes of chunks writes
    /// its new chunks into a pack file of its own, from the caller's
    /// memory, fsyncs it, and then records where each chunk is in the one
    /// transaction that commits the step; reads copy each chunk from the
    /// pack file straight into its place. The store at `run.ckpt` keeps its
    /// pack files in `run.ckpt.packs/`: move the two together, copy a
    /// store with [`CheckpointStore::copy_to`] (`ckpt cp`, safe while it is
    /// written) and remove one with [`CheckpointStore::remove_store`]. A pack file is deleted when the last step using its
    /// chunks goes; [`CheckpointStore::compact`] rewrites pack files that
    /// are mostly dead. A store that has pack files is read by this option
    /// or without it (and not by ckptstore 0.3). docs/design.md has the
    /// layout and the measurements behind it.
    pub fn pack_files(mut self, enabled: bool) -> Self {
        self.settings.pack_files = enabled;
        self
    }

    /// Bytes of chunks from which a commit uses a pack file when
    /// [`pack_files`](Self::pack_files) is set (default
    /// [`DEFAULT_PACK_THRESHOLD`](crate::DEFAULT_PACK_THRESHOLD), 4 MiB).
    pub fn pack_threshold(mut self, bytes: usize) -> Self {
        self.settings.pack_threshold = bytes;
        self
    }

    /// A retention policy applied in the transaction of every commit: the
    /// steps it does not keep are deleted with the commit, atomically
    /// (default: keep everything). See also
    /// [`CheckpointStore::apply_retention`].
    pub fn retention(mut self, policy: Retention) -> Self {
        self.settings.retention = policy;
        self
    }
}
