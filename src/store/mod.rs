//! The checkpoint store: one redb file, one write transaction per step.

mod asynch;
mod backend;
mod chunks;
mod manifest;
mod read;
mod retention;
mod schema;
mod verify;
mod write;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard};

use redb::{
    ConcurrencyMode, Database, ReadOnlyDatabase, ReadTransaction, ReadableDatabase, TableHandle,
    WriteTransaction,
};

use crate::error::StorageContext;
use crate::{Error, Result};
use asynch::AsyncWriter;
use backend::{DynBackend, Source};
use schema::{FORMAT_VERSION, META, META_CREATED, META_FORMAT, META_STORE_ID};

pub use asynch::CommitHandle;
pub use read::{StepInfo, StoreStats};
pub use retention::{Goal, Retention, StepSummary};
pub use verify::VerifyReport;
pub use write::CommitInfo;

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
    cache_size: usize,
    durability: Durability,
    shared: bool,
    retention: Retention,
    check_integrity: bool,
    async_queue_depth: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            cache_size: 56 << 20,
            durability: Durability::Immediate,
            shared: true,
            retention: Retention::new(),
            check_integrity: false,
            async_queue_depth: 2,
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

    /// A retention policy applied in the transaction of every commit: the
    /// steps it does not keep are deleted with the commit, atomically
    /// (default: keep everything). See also
    /// [`CheckpointStore::apply_retention`].
    pub fn retention(mut self, policy: Retention) -> Self {
        self.retention = policy;
        self
    }

    /// Open the store at `path` for reading and writing, creating it if it
    /// does not exist.
    pub fn open(self, path: impl AsRef<Path>) -> Result<CheckpointStore> {
        self.open_source(Source::Path(path.as_ref().to_owned()))
    }

    /// Open a store kept in a custom redb [`StorageBackend`](redb::StorageBackend)
    /// instead of a file: for fault injection in tests, or storage of your
    /// own. `open` makes a fresh backend each time the store opens its
    /// database: once now, and again after an I/O error (redb refuses all
    /// work after one until it is reopened). `name` stands for the store in
    /// messages.
    ///
    /// ```
    /// use ckptstore::{ComputationGraphStore, GradientCheckpoint, StoreOptions};
    /// use redb::backends::InMemoryBackend;
    ///
    /// let store = StoreOptions::new()
    ///     .shared(false) // an in-memory backend has no locks to share
    ///     .open_with_backend("in-memory", || Ok(InMemoryBackend::new()))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// assert_eq!(store.steps()?, vec![1]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn open_with_backend<B, F>(
        self,
        name: impl Into<PathBuf>,
        open: F,
    ) -> Result<CheckpointStore>
    where
        B: redb::StorageBackend,
        F: Fn() -> std::io::Result<B> + Send + Sync + 'static,
    {
        let factory = move || open().map(|b| DynBackend(Box::new(b)));
        self.open_source(Source::Backend(name.into(), std::sync::Arc::new(factory)))
    }

    fn open_source(self, source: Source) -> Result<CheckpointStore> {
        if self.shared && self.durability == Durability::Eventual {
            return Err(Error::InvalidOptions(
                "Durability::Eventual needs shared(false): readers in other processes \
                 only see durable commits"
                    .into(),
            ));
        }
        let handle = Handle::open_writable(&source, &self)?;
        Ok(CheckpointStore::from_core(Core {
            path: source.path().clone(),
            source,
            read_only: false,
            options: self,
            handle: RwLock::new(handle),
            staging: Mutex::new(()),
        }))
    }

    /// Open an existing store read-only. With a shared writer (the default)
    /// in another process, the reader sees each step that writer commits.
    pub fn open_read_only(self, path: impl AsRef<Path>) -> Result<CheckpointStore> {
        let path = path.as_ref().to_owned();
        let handle = Handle::open_read_only(&path, &self)?;
        Ok(CheckpointStore::from_core(Core {
            source: Source::Path(path.clone()),
            path,
            read_only: true,
            options: self,
            handle: RwLock::new(handle),
            staging: Mutex::new(()),
        }))
    }

    fn builder(&self) -> redb::Builder {
        let mut builder = Database::builder();
        builder.set_cache_size(self.cache_size);
        builder.set_check_integrity_on_open(self.check_integrity);
        builder.set_concurrency_mode(if self.shared {
            ConcurrencyMode::SingleWriter
        } else {
            ConcurrencyMode::ExclusiveWriter
        });
        builder
    }
}

/// A store of training checkpoints in one redb file, keyed by step.
///
/// Every method takes `&self`; share a store between threads with an `Arc`.
/// A commit is one write transaction: the step is visible, whole, once
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
    core: Arc<Core>,
    /// The background writer of `commit_async`, started on first use. Only
    /// the caller's handle has one; the writer's own handle does not.
    writer: Mutex<Option<AsyncWriter>>,
}

/// What every handle on one open store shares.
struct Core {
    path: PathBuf,
    source: Source,
    read_only: bool,
    options: StoreOptions,
    handle: RwLock<Handle>,
    /// Held by a commit that stages its chunks in transactions of their
    /// own, so that one staging runs at a time.
    staging: Mutex<()>,
}

impl CheckpointStore {
    fn from_core(core: Core) -> Self {
        CheckpointStore {
            core: Arc::new(core),
            writer: Mutex::new(None),
        }
    }

    /// A second handle on the same open database, for the background
    /// writer (it has no writer of its own).
    fn worker_handle(&self) -> Self {
        CheckpointStore {
            core: self.core.clone(),
            writer: Mutex::new(None),
        }
    }
}

impl std::fmt::Debug for CheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointStore")
            .field("path", &self.core.path)
            .field("options", &self.core.options)
            .finish_non_exhaustive()
    }
}

/// The open redb database behind a store.
pub(crate) enum Handle {
    Writable(Database),
    ReadOnly(ReadOnlyDatabase),
    /// Dropped after an I/O error; reopened by the next operation.
    Closed,
}

impl Handle {
    fn open_writable(source: &Source, options: &StoreOptions) -> Result<Handle> {
        let what = || format!("opening {}", source.path().display());
        shield(None, &what, || {
            Self::open_writable_unshielded(source, options)
        })
    }

    fn open_writable_unshielded(source: &Source, options: &StoreOptions) -> Result<Handle> {
        let path = source.path();
        let opened = match source {
            Source::Path(p) => {
                if !p.exists() {
                    create_atomically(p, options)?;
                }
                options.builder().create(p)
            }
            Source::Backend(_, factory) => {
                let backend = factory().map_err(|e| Error::io("open backend of", path, e))?;
                options.builder().create_with_backend(backend)
            }
        };
        let db = opened.map_err(|source| Error::Open {
            path: path.to_owned(),
            source,
        })?;
        init_or_check_meta(path, &db)?;
        Ok(Handle::Writable(db))
    }

    fn open_read_only(path: &Path, options: &StoreOptions) -> Result<Handle> {
        let what = || format!("opening {}", path.display());
        shield(None, &what, || {
            Self::open_read_only_unshielded(path, options)
        })
    }

    fn open_read_only_unshielded(path: &Path, options: &StoreOptions) -> Result<Handle> {
        let db = options
            .builder()
            .open_read_only(path)
            .map_err(|source| Error::Open {
                path: path.to_owned(),
                source,
            })?;
        let txn = db
            .begin_read()
            .context(|| format!("reading {}", path.display()))?;
        check_meta(path, &txn)?;
        Ok(Handle::ReadOnly(db))
    }
}

impl CheckpointStore {
    /// Open the store at `path` with default [`StoreOptions`], creating it if
    /// it does not exist.
    ///
    /// # Errors
    /// [`Error::Open`] when the file cannot be opened as a redb database (a
    /// directory, a file of another kind, a damaged file),
    /// [`Error::NotAStore`] for a redb database that is not a ckptstore, and
    /// [`Error::UnsupportedFormat`] for a store of a newer format.
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
        &self.core.path
    }

    /// Whether the store was opened read-only.
    pub fn is_read_only(&self) -> bool {
        matches!(&*self.read_handle(), Handle::ReadOnly(_))
    }

    fn read_handle(&self) -> RwLockReadGuard<'_, Handle> {
        self.core
            .handle
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The live handle, reopening the database if an I/O error closed it.
    pub(crate) fn live_handle(&self) -> Result<RwLockReadGuard<'_, Handle>> {
        {
            let guard = self.read_handle();
            if !matches!(&*guard, Handle::Closed) {
                return Ok(guard);
            }
        }
        drop(self.handle_mut()?);
        Ok(self.read_handle())
    }

    /// The handle for exclusive use (compaction), reopened if closed.
    fn handle_mut(&self) -> Result<std::sync::RwLockWriteGuard<'_, Handle>> {
        let mut guard = self
            .core
            .handle
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if matches!(&*guard, Handle::Closed) {
            *guard = if self.core.read_only {
                Handle::open_read_only(&self.core.path, &self.core.options)?
            } else {
                Handle::open_writable(&self.core.source, &self.core.options)?
            };
        }
        Ok(guard)
    }

    /// After an I/O error redb refuses all work until the database is
    /// reopened (which repairs it): drop it now, reopen on next use.
    fn close_after_io_error(&self) {
        let mut guard = self
            .core
            .handle
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        *guard = Handle::Closed;
    }

    /// Run a public operation behind [`shield`]; after a panic the database
    /// is dropped and reopened on next use, since its state is unknown.
    pub(crate) fn shielded<T>(
        &self,
        step: Option<u64>,
        what: &dyn Fn() -> String,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        catch_panic(f).unwrap_or_else(|msg| {
            self.close_after_io_error();
            Err(damaged(step, what, &msg))
        })
    }

    pub(crate) fn begin_read(&self) -> Result<ReadTransaction> {
        let result = {
            let guard = self.live_handle()?;
            match &*guard {
                Handle::Writable(db) => db.begin_read(),
                Handle::ReadOnly(db) => db.begin_read(),
                Handle::Closed => unreachable_closed(),
            }
            .context(|| format!("starting a read of {}", self.core.path.display()))
        };
        if let Err(e) = &result {
            if e.is_io() {
                self.close_after_io_error();
            }
        }
        result
    }

    /// Run `f` in one write transaction and commit it; abort if `f` fails.
    /// `what` describes the operation for error messages.
    pub(crate) fn write<T>(
        &self,
        op: &'static str,
        what: &dyn Fn() -> String,
        f: impl FnOnce(&WriteTransaction) -> Result<T>,
    ) -> Result<T> {
        self.write_with(op, what, false, f)
    }

    /// [`write`](Self::write); `part` marks a transaction that is one part
    /// of a larger change, which need not be durable by itself when the
    /// store is exclusive (the change's last transaction makes it durable).
    pub(crate) fn write_with<T>(
        &self,
        op: &'static str,
        what: &dyn Fn() -> String,
        part: bool,
        f: impl FnOnce(&WriteTransaction) -> Result<T>,
    ) -> Result<T> {
        let result = self.shielded(None, what, || {
            let guard = self.live_handle()?;
            let Handle::Writable(db) = &*guard else {
                return Err(Error::ReadOnly {
                    path: self.core.path.clone(),
                    op,
                });
            };
            let mut txn = db.begin_write().context(what)?;
            if self.core.options.durability == Durability::Eventual
                || (part && !self.core.options.shared)
            {
                txn.set_durability(redb::Durability::None).context(what)?;
            }
            let value = f(&txn)?;
            txn.commit().context(what)?;
            Ok(value)
        });
        if let Err(e) = &result {
            if e.is_io() {
                self.close_after_io_error();
            }
        }
        result
    }
}

/// Run `f`, turning a panic inside it into [`Error::Corrupt`].
///
/// redb trusts the pages of a cleanly closed file and panics on some kinds
/// of damage (an invalid page type, a malformed allocator state) instead of
/// returning an error. A damaged file must not crash a training run, so every
/// public operation runs behind this shield. (With `panic = "abort"` nothing
/// can be caught; `verify` and the hashes still report damage that redb
/// reads without panicking.)
pub(crate) fn shield<T>(
    step: Option<u64>,
    what: &dyn Fn() -> String,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    catch_panic(f).unwrap_or_else(|msg| Err(damaged(step, what, &msg)))
}

/// `f`'s result, or the message of the panic it raised.
fn catch_panic<T>(f: impl FnOnce() -> Result<T>) -> std::result::Result<Result<T>, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "unknown panic".to_owned())
    })
}

fn damaged(step: Option<u64>, what: &dyn Fn() -> String, msg: &str) -> Error {
    Error::corrupt(
        step,
        format!("{}: the store file is damaged (redb: {msg})", what()),
    )
}

fn unreachable_closed() -> std::result::Result<ReadTransaction, redb::TransactionError> {
    // live_handle() never returns a closed handle; answer as redb would.
    Err(redb::TransactionError::Storage(
        redb::StorageError::PreviousIo,
    ))
}

/// Create a new store at `path` so that a crash leaves either no file or a
/// complete, initialised store: build it under a temporary name beside
/// `path`, fsync it, link it into place (never over an existing file), and
/// fsync the directory. (redb writes a new file's header in place, so a
/// process killed while creating one left a file that no later open
/// accepted; the kill -9 test found that.)
fn create_atomically(path: &Path, options: &StoreOptions) -> Result<()> {
    let (dir, tmp) = crate::checkpoint::temp_beside(path, "creating");
    let result = (|| {
        let db = options
            .builder()
            .create(&tmp)
            .map_err(|source| Error::Open {
                path: path.to_owned(),
                source,
            })?;
        init_or_check_meta(path, &db)?;
        drop(db);
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io("fsync", &tmp, e))?;
        match std::fs::hard_link(&tmp, path) {
            Ok(()) => Ok(()),
            // Another process created it first: use theirs.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            // A filesystem without hard links: rename (not atomic against a
            // concurrent creator, still atomic against a crash).
            Err(_) => {
                std::fs::rename(&tmp, path).map_err(|e| Error::io("rename new store to", path, e))
            }
        }
    })();
    let _ = std::fs::remove_file(&tmp);
    result?;
    crate::checkpoint::sync_dir(&dir)
}

/// Check a store's `meta` table, or initialise an empty database as a store;
/// mark an older store as the current format (it is opened for writing, and
/// an older build must not misread the manifests it is about to get).
fn init_or_check_meta(path: &Path, db: &Database) -> Result<()> {
    let what = || format!("initialising {}", path.display());
    let txn = db.begin_read().context(what)?;
    match check_meta(path, &txn) {
        Err(Error::NotAStore { .. }) if txn.list_tables().context(what)?.next().is_none() => {}
        Ok(found) if found < FORMAT_VERSION => {
            drop(txn);
            let what = || format!("upgrading {} to format {FORMAT_VERSION}", path.display());
            let txn = db.begin_write().context(what)?;
            txn.open_table(META)
                .context(what)?
                .insert(META_FORMAT, FORMAT_VERSION.to_le_bytes().as_slice())
                .context(what)?;
            txn.open_table(schema::CHUNK_DATA).context(what)?;
            txn.open_table(schema::CHUNK_INDEX).context(what)?;
            return txn.commit().context(what);
        }
        Ok(_) => {
            let staging = txn
                .open_table(META)
                .and_then(|meta| Ok(meta.get(schema::META_STAGING)?.is_some()))
                .context(what)?;
            drop(txn);
            if staging {
                let what = || {
                    format!(
                        "deleting an unfinished commit's chunks in {}",
                        path.display()
                    )
                };
                let txn = db.begin_write().context(what)?;
                chunks::sweep_staged(&txn, what())?;
                return txn.commit().context(what);
            }
            return Ok(());
        }
        other => return other.map(drop),
    }
    drop(txn);

    let txn = db.begin_write().context(what)?;
    {
        let mut meta = txn.open_table(META).context(what)?;
        meta.insert(META_FORMAT, FORMAT_VERSION.to_le_bytes().as_slice())
            .context(what)?;
        let id = uuid::Uuid::new_v4().to_string();
        meta.insert(META_STORE_ID, id.as_bytes()).context(what)?;
        let now = crate::checkpoint::unix_now();
        meta.insert(META_CREATED, now.to_le_bytes().as_slice())
            .context(what)?;
        txn.open_table(schema::STEPS).context(what)?;
        txn.open_table(schema::CHUNK_DATA).context(what)?;
        txn.open_table(schema::CHUNK_INDEX).context(what)?;
        txn.open_table(schema::SUMMARIES).context(what)?;
        txn.open_table(schema::PINS).context(what)?;
        txn.open_table(schema::PACKED).context(what)?;
    }
    txn.commit().context(what)
}

/// Check that a database is a store of a format this build reads; returns
/// its format version.
fn check_meta(path: &Path, txn: &ReadTransaction) -> Result<u32> {
    let not_a_store = |reason: &str| Error::NotAStore {
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    let meta = match txn.open_table(META) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => {
            return Err(not_a_store("it has no meta table"))
        }
        Err(e) => {
            return Err(e).context(|| format!("reading table meta of {}", path.display()));
        }
    };
    let version = meta
        .get(META_FORMAT)
        .context(|| format!("reading table meta of {}", path.display()))?
        .ok_or_else(|| not_a_store("its meta table has no format version"))?;
    let bytes: [u8; 4] = version
        .value()
        .try_into()
        .map_err(|_| not_a_store("its format version is not 4 bytes"))?;
    let found = u32::from_le_bytes(bytes);
    if found > FORMAT_VERSION {
        return Err(Error::UnsupportedFormat {
            what: format!("store {}", path.display()),
            found,
            supported: FORMAT_VERSION,
        });
    }
    let chunk_tables = if found < 2 {
        [schema::LEGACY_CHUNKS.name(), schema::LEGACY_REFS.name()]
    } else {
        [schema::CHUNK_DATA.name(), schema::CHUNK_INDEX.name()]
    };
    for table in [
        schema::STEPS.name(),
        schema::SUMMARIES.name(),
        schema::PINS.name(),
        schema::PACKED.name(),
    ]
    .into_iter()
    .chain(chunk_tables)
    {
        let exists = txn
            .list_tables()
            .context(|| format!("listing tables of {}", path.display()))?
            .any(|t| t.name() == table);
        if !exists {
            return Err(not_a_store(&format!("table {table} is missing")));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn store_is_send_sync() {
        assert_send_sync::<CheckpointStore>();
    }
}
