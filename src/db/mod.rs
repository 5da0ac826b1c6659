//! The database handle: its lifecycle, and the one place where redb is
//! called behind a panic boundary.
//!
//! redb trusts the pages of a cleanly closed file and panics on some kinds
//! of damage (an invalid page type, a malformed allocator state) instead of
//! returning an error. Every transaction runs behind [`Db::read`] or
//! [`Db::write`], which catch such a panic and poison the handle: the call
//! and every later one fail with [`Error::Poisoned`], as a fjall keyspace
//! does after a panic. After an I/O error redb refuses all work until the
//! database is reopened, so the handle is closed and reopened on next use.

pub(crate) mod backend;
mod dead;
mod open;
mod overlay;
mod writers;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use redb::{Database, ReadOnlyDatabase, ReadableDatabase};

use crate::engine::packs::{is_missing_pack, missing_pack, PackDir};
use crate::engine::{Engine, View};
use crate::error::StorageContext;
use crate::options::Settings;
use crate::process::Owner;
use crate::{Durability, Error, Result};
use backend::Source;
use dead::DeadFiles;
pub(crate) use open::check_pages;
use open::{open_read_only, open_writable};

/// How many times a read runs when writers keep deleting the pack files it
/// needs.
const READ_ATTEMPTS: usize = 3;

/// What a write transaction is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TxnKind {
    /// A whole change: durable when it commits (with the store's
    /// durability).
    Whole,
    /// One part of a larger change whose last transaction makes it
    /// durable; need not be durable itself on an exclusive store.
    Part,
    /// What the store remembers of a bucket, written by a push: durable,
    /// but not a change replication reacts to (no after-write hook).
    #[cfg(feature = "remote")]
    Memo,
}

/// The open database, or why there is none.
enum State {
    Writable(Database),
    ReadOnly(ReadOnlyDatabase),
    /// A store whose writer died without closing it, repaired in memory
    /// over the unchanged file ([`overlay`]) and used read-only; the file
    /// as it was then (a writer that opens it changes it, and the view
    /// is then opened again).
    Recovered(Database, open::Stamp),
    /// Dropped after an I/O error; reopened by the next operation.
    Closed,
    /// redb panicked: the handle is unusable.
    Poisoned(String),
}

/// A store's database handle, shared by the caller's handle and the
/// background writer.
pub(crate) struct Db {
    source: Source,
    read_only: bool,
    options: Settings,
    state: RwLock<State>,
    /// Held by a commit that stages its chunks in transactions of their
    /// own, so that one staging runs at a time.
    staging: Mutex<()>,
    /// Called after each write transaction commits (replication).
    after_write: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// The process that opened it: a forked child may not use or close it.
    owner: Owner,
    /// Set once the file proved damaged (redb panicked, or reported
    /// corruption): redb's close, which commits, is then never run.
    damaged: AtomicBool,
    /// Pack files made dead by commits, deleted once that is durable.
    dead: DeadFiles,
    /// This process's claim on the store's path, for a writable store on
    /// a path; released after the database closes (field order).
    _registered: Option<writers::Registered>,
}

impl Db {
    /// Open `source` for reading and writing, creating a missing file.
    pub(crate) fn open(source: Source, options: Settings) -> Result<Db> {
        let registered = match &source {
            Source::Path(path) => Some(writers::register(path)?),
            Source::Backend(..) => None,
        };
        let state = open_writable(&source, &options)?;
        Ok(Db::with_state(source, false, options, state, registered))
    }

    /// Open the store at `path` read-only.
    pub(crate) fn open_read_only(path: PathBuf, options: Settings) -> Result<Db> {
        let source = Source::Path(path);
        let state = open_read_only(&source, &options)?;
        Ok(Db::with_state(source, true, options, state, None))
    }

    fn with_state(
        source: Source,
        read_only: bool,
        options: Settings,
        state: State,
        registered: Option<writers::Registered>,
    ) -> Db {
        Db {
            source,
            read_only,
            options,
            state: RwLock::new(state),
            staging: Mutex::new(()),
            after_write: std::sync::OnceLock::new(),
            owner: Owner::current(),
            damaged: AtomicBool::new(false),
            dead: DeadFiles::default(),
            _registered: registered,
        }
    }

    /// Whether this is a forked child of the process that opened it.
    pub(crate) fn forked(&self) -> bool {
        self.owner.forked()
    }

    pub(crate) fn path(&self) -> &Path {
        self.source.path()
    }

    pub(crate) fn is_read_only(&self) -> bool {
        self.read_only
    }

    pub(crate) fn settings(&self) -> &Settings {
        &self.options
    }

    /// The lock one staging commit holds.
    pub(crate) fn staging(&self) -> Result<MutexGuard<'_, ()>> {
        self.staging
            .lock()
            .map_err(|_| self.poisoned("a commit panicked while staging"))
    }

    /// [`read`](Self::read), run again in a new transaction (which sees
    /// the store as it is now) when a writer deleted a pack file under it
    /// (it removed the step or moved its chunks after the read began);
    /// [`Error::ReadInterrupted`] only if that keeps happening. Only for
    /// an `f` with no effect outside its result: an attempt may stop
    /// half-way.
    pub(crate) fn read_retrying<T>(
        &self,
        what: &dyn Fn() -> String,
        mut f: impl FnMut(&View) -> Result<T>,
    ) -> Result<T> {
        for _ in 1..READ_ATTEMPTS {
            match self.read(what, &mut f) {
                Err(Error::ReadInterrupted { .. }) => {}
                result => return result,
            }
        }
        self.read(what, f)
    }

    /// Run `f` in a read transaction. A pack file deleted under it is
    /// [`Error::ReadInterrupted`]; damage in a pack file leaves the handle
    /// usable (the redb file is not damaged).
    pub(crate) fn read<T>(
        &self,
        what: &dyn Fn() -> String,
        f: impl FnOnce(&View) -> Result<T>,
    ) -> Result<T> {
        let stale = AtomicBool::new(false);
        let result = self.guarded(what, |state| {
            let begin = || -> Result<redb::ReadTransaction> {
                match state {
                    State::Writable(db) | State::Recovered(db, _) => db.begin_read(),
                    State::ReadOnly(db) => db.begin_read(),
                    State::Closed | State::Poisoned(_) => {
                        return Err(self.poisoned("the handle is closed"))
                    }
                }
                .context(what)
            };
            let packs = self.pack_dir();
            let pack_fault = Arc::new(AtomicBool::new(false));
            let view = View {
                txn: begin()?,
                threads: self.settings().threads,
                packs: packs.clone(),
                pack_fault: pack_fault.clone(),
            };
            let result = match state {
                State::Recovered(_, stamp) => {
                    // The overlay reads the file as it is now: if a writer
                    // changed it, what was read (or a panic over pages it
                    // rewrote) is not the view's, and the view is stale.
                    let read = catch_unwind(AssertUnwindSafe(|| f(&view)));
                    if open::Stamp::of(self.path()).map_or(true, |now| now != *stamp) {
                        stale.store(true, Ordering::SeqCst);
                        return Err(Failed::Spared(Error::ReadInterrupted {
                            detail: format!(
                                "{} changed under a view opened after its writer died",
                                self.path().display()
                            ),
                        }));
                    }
                    read.unwrap_or_else(|payload| std::panic::resume_unwind(payload))
                }
                _ => f(&view),
            };
            match (result, packs) {
                // Deleted by a writer after this read began, or lost.
                (Err(e), Some(dir)) if is_missing_pack(&e, &dir.path) => {
                    Err(Failed::Spared(missing_pack(e, &begin()?, &dir)?))
                }
                // Damage in a pack file, not in the redb file: the handle
                // stays usable.
                (result, _) if pack_fault.load(Ordering::Relaxed) => result.map_err(Failed::Spared),
                (result, _) => Ok(result?),
            }
        });
        if stale.load(Ordering::SeqCst) {
            // Opened again by the next read: as the writer left the file.
            self.set_state(State::Closed);
        }
        result
    }

    /// Whether a transaction writing `chunk_bytes` of chunks puts its new
    /// ones in a pack file (the option is set, the size reached, and the
    /// store has a path).
    pub(crate) fn packs(&self, chunk_bytes: usize) -> bool {
        self.options.packs(chunk_bytes) && self.pack_dir().is_some()
    }

    /// The directory of the store's pack files ([`Source::pack_dir`]).
    pub(crate) fn pack_dir(&self) -> Option<PackDir> {
        self.source.pack_dir()
    }

    /// Run `f` in one write transaction and commit it; abort if `f` fails.
    /// `op` names the operation for a read-only store's refusal.
    pub(crate) fn write<T>(
        &self,
        op: &'static str,
        what: &dyn Fn() -> String,
        kind: TxnKind,
        f: impl FnOnce(&mut Engine<'_>) -> Result<T>,
    ) -> Result<T> {
        if self.read_only {
            return Err(self.read_only_error(op));
        }
        self.guarded(what, |state| {
            let State::Writable(db) = state else {
                return Err(self.read_only_error(op).into());
            };
            let mut txn = begin_write(db, &self.options, what)?;
            let durable = !(self.options.durability == Durability::Eventual
                || (kind == TxnKind::Part && !self.options.shared));
            if !durable {
                txn.set_durability(redb::Durability::None).context(what)?;
            }
            let mut pack_fault = false;
            let in_engine = || -> Result<(T, Vec<PathBuf>)> {
                let mut engine = Engine::open(&txn, self.pack_dir())?;
                let value = f(&mut engine);
                pack_fault = engine.pack_faulted();
                let value = value?;
                let dead = engine.finish()?;
                Ok((value, dead))
            };
            let (value, dead) = match in_engine() {
                Ok(done) => done,
                // Damage in a pack file, not in the redb file: the
                // transaction is aborted and the handle stays usable.
                Err(e) if pack_fault => return Err(Failed::Spared(e)),
                Err(e) => return Err(e.within(what).into()),
            };
            txn.commit().context(what)?;
            self.dead.committed(self.pack_dir().as_ref(), dead, durable);
            #[cfg(feature = "remote")]
            let quiet = kind == TxnKind::Memo;
            #[cfg(not(feature = "remote"))]
            let quiet = false;
            if let Some(hook) = self.after_write.get().filter(|_| !quiet) {
                hook();
            }
            Ok(value)
        })
    }

    /// Whether `path` is a pack file a commit of this handle made dead,
    /// waiting for a durable commit to be deleted.
    pub(crate) fn is_dead_pending(&self, path: &Path) -> bool {
        self.dead.contains(path)
    }

    /// Call `hook` after each write transaction commits (set once).
    #[cfg(feature = "remote")]
    pub(crate) fn set_after_write(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.after_write.set(hook);
    }

    /// Hand free space back to the filesystem (redb compaction).
    pub(crate) fn compact(&self) -> Result<bool> {
        let what = || format!("compacting {}", self.path().display());
        if self.read_only {
            return Err(self.read_only_error("compact"));
        }
        self.owner
            .check(&|| format!("checkpoint store {}", self.path().display()))?;
        let mut guard = self.live_mut()?;
        let State::Writable(db) = &mut *guard else {
            return Err(self.poisoned("the handle is closed"));
        };
        let outcome = catch_unwind(AssertUnwindSafe(|| match db.compact() {
            Err(redb::CompactionError::TransactionInProgress) => Err(Error::Busy {
                path: self.path().to_owned(),
                op: "compaction",
            }),
            result => {
                let compacted = result.context(what)?;
                // Compaction's own commits record no allocator state: record
                // it now, so that a crash after this still recovers quickly.
                begin_write(db, &self.options, &what)?
                    .commit()
                    .context(what)?;
                Ok(compacted)
            }
        }));
        drop(guard);
        self.settle(&what, outcome)
    }

    /// Whether the store was opened read-only after its writer died: what
    /// is read is the store as a writable open would repair it, and the
    /// file stays as it is.
    pub(crate) fn is_recovered_view(&self) -> bool {
        matches!(self.state.read().as_deref(), Ok(State::Recovered(..)))
    }

    /// Bytes of the file redb has allocated; 0 for a read-only store (redb
    /// reports it only in a write transaction, which is then aborted).
    pub(crate) fn allocated_bytes(&self) -> Result<u64> {
        let what = || "reading store statistics".to_owned();
        self.guarded(&what, |state| {
            let State::Writable(db) = state else {
                return Ok(0);
            };
            let txn = db.begin_write().context(what)?;
            let stats = txn.stats().context(what)?;
            let bytes = stats.allocated_pages() * stats.page_size() as u64;
            txn.abort().context(what)?;
            Ok(bytes)
        })
    }

    /// Run `f` on the live state behind the panic boundary; close the
    /// handle after an I/O error of the store, poison it after a panic; an
    /// error `f` says spares the handle ([`Failed::Spared`]) is returned
    /// as it is.
    fn guarded<T>(
        &self,
        what: &dyn Fn() -> String,
        f: impl FnOnce(&State) -> std::result::Result<T, Failed>,
    ) -> Result<T> {
        self.owner
            .check(&|| format!("checkpoint store {}", self.path().display()))?;
        let outcome = {
            let guard = self.live()?;
            catch_unwind(AssertUnwindSafe(|| f(&guard)))
        };
        match outcome {
            Ok(Err(Failed::Spared(e))) => Err(e),
            Ok(Err(Failed::Store(e))) => self.settle(what, Ok(Err(e))),
            Ok(Ok(value)) => Ok(value),
            Err(payload) => self.settle(what, Err(payload)),
        }
    }

    fn settle<T>(
        &self,
        what: &dyn Fn() -> String,
        outcome: std::thread::Result<Result<T>>,
    ) -> Result<T> {
        match outcome {
            Ok(result) => {
                if let Err(e) = &result {
                    if is_damage(e) {
                        self.damaged.store(true, Ordering::SeqCst);
                    }
                    // Only the store's own device failing (redb's I/O
                    // error) closes the handle; a failure of another file
                    // (an export target, say) is that file's.
                    if matches!(e, Error::Storage { .. }) && e.is_io() {
                        self.set_state(State::Closed);
                    }
                }
                result
            }
            Err(payload) => {
                let detail = format!(
                    "redb panicked while {}: {}",
                    what(),
                    panic_message(&*payload)
                );
                let e = self.poisoned(&detail);
                self.damaged.store(true, Ordering::SeqCst);
                self.set_state(State::Poisoned(detail));
                Err(e)
            }
        }
    }

    /// The state, reopened first if an I/O error closed it.
    fn live(&self) -> Result<RwLockReadGuard<'_, State>> {
        {
            let guard = self
                .state
                .read()
                .map_err(|_| self.poisoned("lock poisoned"))?;
            match &*guard {
                State::Closed => {}
                State::Poisoned(detail) => return Err(self.poisoned(detail)),
                _ => return Ok(guard),
            }
        }
        drop(self.live_mut()?);
        self.state
            .read()
            .map_err(|_| self.poisoned("lock poisoned"))
    }

    /// The state for exclusive use, reopened first if closed.
    fn live_mut(&self) -> Result<RwLockWriteGuard<'_, State>> {
        let mut guard = self
            .state
            .write()
            .map_err(|_| self.poisoned("lock poisoned"))?;
        match &*guard {
            State::Closed => {
                *guard = if self.read_only {
                    open_read_only(&self.source, &self.options)?
                } else {
                    open_writable(&self.source, &self.options)?
                };
            }
            State::Poisoned(detail) => return Err(self.poisoned(detail)),
            _ => {}
        }
        Ok(guard)
    }

    fn set_state(&self, state: State) {
        // A poisoned lock holds nothing that must be kept: replace it.
        let mut guard = self
            .state
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !matches!(&*guard, State::Poisoned(_)) {
            let old = std::mem::replace(&mut *guard, state);
            self.close(old);
        }
    }

    /// Close the database `state` holds: not at all on a damaged file or in
    /// a forked child (the state is leaked: redb's close commits, which
    /// can panic on damaged pages, and releases file locks the parent
    /// holds); otherwise behind a panic boundary, reporting a panic once
    /// on stderr rather than taking the process down.
    fn close(&self, state: State) {
        if self.damaged.load(Ordering::SeqCst) || self.forked() {
            std::mem::forget(state);
            return;
        }
        let closing = || {
            if let (State::Writable(db), true) = (&state, self.dead.waiting()) {
                // An empty durable commit first, so that the files the
                // last commits made dead can go.
                let what = || "making the last commits durable".to_owned();
                let durable = begin_write(db, &self.options, &what)
                    .and_then(|txn| txn.commit().context(what))
                    .is_ok();
                self.dead.closing(self.pack_dir().as_ref(), durable);
            }
            drop(state);
        };
        if let Err(payload) = catch_unwind(AssertUnwindSafe(closing)) {
            eprintln!(
                "ckptstore: closing {} failed: redb panicked: {} (run `ckpt verify --pages`)",
                self.path().display(),
                panic_message(&*payload)
            );
        }
    }

    fn poisoned(&self, detail: &str) -> Error {
        Error::Poisoned {
            path: self.path().to_owned(),
            detail: detail.to_owned(),
        }
    }

    fn read_only_error(&self, op: &'static str) -> Error {
        Error::ReadOnly {
            path: self.path().to_owned(),
            op,
        }
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        let state = std::mem::replace(
            self.state
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            State::Closed,
        );
        self.close(state);
    }
}

/// What fails behind the guard ([`Db::guarded`]): the store itself (its
/// device, a transaction: the handle may close), or another file whose
/// failure spares the handle (a pack file damaged or deleted under a read,
/// a view gone stale).
enum Failed {
    Store(Error),
    Spared(Error),
}

impl From<Error> for Failed {
    fn from(e: Error) -> Failed {
        Failed::Store(e)
    }
}

/// Whether `e` shows the file damaged (not merely an I/O failure).
fn is_damage(e: &Error) -> bool {
    match e {
        Error::Corrupt { .. } | Error::Poisoned { .. } => true,
        Error::Storage { source, .. } => matches!(
            source.downcast_ref::<redb::Error>(),
            Some(redb::Error::Corrupted(_))
        ),
        _ => false,
    }
}

/// A write transaction that (unless the options say otherwise) records
/// redb's allocator state and commits in two phases ("quick repair"): after
/// a crash, opening the store loads that state instead of walking every
/// page of the file, so recovery reads megabytes, not the whole store.
pub(crate) fn begin_write(
    db: &Database,
    options: &Settings,
    what: &dyn Fn() -> String,
) -> Result<redb::WriteTransaction> {
    let mut txn = db.begin_write().context(what)?;
    txn.set_quick_repair(options.quick_repair);
    Ok(txn)
}

/// The message of a panic's payload.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "unknown panic".to_owned())
}
