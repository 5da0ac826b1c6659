//! The settings of a store below its public API: [`Durability`] and the
//! plain values [`StoreOptions`](crate::StoreOptions) carries down to the database.

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
    /// (`StoreOptions::shared(false)`), since readers in other processes
    /// only see durable commits.
    Eventual,
}

/// The settings of a store that the layers under the public API read
/// (everything [`StoreOptions`](crate::StoreOptions) holds but its
/// replication target).
#[derive(Clone, Debug)]
#[allow(clippy::struct_excessive_bools)] // independent switches, one option each
pub(crate) struct Settings {
    pub(crate) cache_size: usize,
    pub(crate) durability: Durability,
    pub(crate) shared: bool,
    pub(crate) retention: Retention,
    pub(crate) check_integrity: bool,
    pub(crate) async_queue_depth: usize,
    pub(crate) quick_repair: bool,
    /// Threads a foreground commit, read or verification hashes and
    /// copies chunks on.
    pub(crate) threads: usize,
    /// Threads a background commit uses.
    pub(crate) background_threads: usize,
    /// Whether large commits put their chunks in pack files.
    pub(crate) pack_files: bool,
    /// Bytes of chunks from which a transaction packs them.
    pub(crate) pack_threshold: usize,
}

/// The default of [`StoreOptions::pack_threshold`](crate::StoreOptions::pack_threshold):
/// below it a pack file's own fsync costs more than the copy it saves.
pub const DEFAULT_PACK_THRESHOLD: usize = 4 << 20;

impl Settings {
    /// Whether a transaction writing `chunk_bytes` of chunks puts its new
    /// ones in a pack file.
    pub(crate) fn packs(&self, chunk_bytes: usize) -> bool {
        self.pack_files && chunk_bytes >= self.pack_threshold
    }
}

/// Default page cache: a commit then needs at most the checkpoint plus
/// 64 MiB of memory (redb's own default of 1 GiB shows up as resident
/// memory).
const DEFAULT_CACHE_SIZE: usize = 56 << 20;

/// Smallest page cache accepted.
pub(crate) const MIN_CACHE_SIZE: usize = 1 << 20;

/// Most threads one operation may use.
pub(crate) const MAX_THREADS: usize = 256;

/// Threads for foreground work by default: the machine's cores.
fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Most background commits that may wait in the queue.
pub(crate) const MAX_ASYNC_QUEUE_DEPTH: usize = 1024;

impl Default for Settings {
    fn default() -> Self {
        Settings {
            cache_size: DEFAULT_CACHE_SIZE,
            durability: Durability::Immediate,
            shared: true,
            retention: Retention::new(),
            check_integrity: false,
            async_queue_depth: 2,
            quick_repair: true,
            threads: default_threads(),
            background_threads: 1,
            pack_files: true,
            pack_threshold: DEFAULT_PACK_THRESHOLD,
        }
    }
}

impl Settings {
    /// Check each option's range.
    pub(crate) fn validate(&self) -> Result<()> {
        if !(1..=MAX_ASYNC_QUEUE_DEPTH).contains(&self.async_queue_depth) {
            return Err(Error::InvalidOptions(format!(
                "async_queue_depth is {}; it must be from 1 to {MAX_ASYNC_QUEUE_DEPTH}",
                self.async_queue_depth
            )));
        }
        self.retention.check_keeps_something()?;
        for (name, n) in [
            ("threads", self.threads),
            ("background_threads", self.background_threads),
        ] {
            if !(1..=MAX_THREADS).contains(&n) {
                return Err(Error::InvalidOptions(format!(
                    "{name} is {n}; it must be from 1 to {MAX_THREADS}"
                )));
            }
        }
        if self.cache_size < MIN_CACHE_SIZE {
            return Err(Error::InvalidOptions(format!(
                "cache_size is {} bytes; it must be at least {MIN_CACHE_SIZE} (1 MiB)",
                self.cache_size
            )));
        }
        Ok(())
    }
}
