//! Opening a store's database: atomic creation, format checks, upgrade
//! from format 1, and the clean-up of an interrupted staging and of pack
//! files no record names.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use redb::{Database, ReadOnlyDatabase, ReadableDatabase};

use crate::engine::packs::{recorded_packs, sweep_unrecorded, PackDir};
use crate::engine::Engine;
use crate::error::StorageContext;
use crate::format::packs::pack_owner;
use crate::format::tables::{Found, META, META_STAGING, TABLES_FORMAT};
use crate::format::{check_tables, create_tables, upgrade_to_current};
use crate::options::Settings;
use crate::{Error, Result};

use super::backend::{DynBackend, Source};
use super::{overlay, panic_message, State};

/// redb's builder for `options`.
pub(crate) fn builder(options: &Settings) -> redb::Builder {
    let mut builder = Database::builder();
    builder.set_cache_size(options.cache_size);
    builder.set_check_integrity_on_open(options.check_integrity);
    builder.set_concurrency_mode(if options.shared {
        redb::ConcurrencyMode::SingleWriter
    } else {
        redb::ConcurrencyMode::ExclusiveWriter
    });
    builder
}

/// An error of redb's `open`/`create`, in our terms.
pub(crate) fn open_error(path: &Path, e: redb::DatabaseError) -> Error {
    match e {
        redb::DatabaseError::DatabaseAlreadyOpen => Error::Locked {
            path: path.to_owned(),
        },
        e => Error::Open {
            path: path.to_owned(),
            source: Box::new(e),
        },
    }
}

/// Check a writable database's format and bring it to the current one:
/// initialise an empty database, upgrade a format 1 store, delete the
/// chunks of a staging a crash interrupted and the pack files (in
/// `packs`) no record names.
pub(crate) fn prepare_writable(
    path: &Path,
    packs: Option<&PackDir>,
    db: &Database,
    options: &Settings,
) -> Result<()> {
    let what = || format!("opening {}", path.display());
    let (found, staging) = {
        let txn = db.begin_read().context(what)?;
        let found = check_tables(path, &txn)?;
        let staging = found != Found::Empty && staging_flag(&txn)?;
        (found, staging)
    };
    if staging || !matches!(found, Found::Store(v) if v >= TABLES_FORMAT) {
        let txn = super::begin_write(db, options, &what)?;
        match found {
            Found::Empty => create_tables(&txn, &|| format!("initialising {}", path.display()))?,
            Found::Store(v) if v < TABLES_FORMAT => upgrade_to_current(&txn, &|| {
                format!("upgrading {} to format {TABLES_FORMAT}", path.display())
            })?,
            Found::Store(_) => {}
        }
        let mut engine = Engine::open(&txn, packs.cloned())?;
        engine.sweep_staged()?;
        // Pack files this made dead are swept below, as unrecorded.
        engine.finish()?;
        txn.commit().context(what)?;
    }
    if let Some(dir) = packs {
        // No other writer can be under way: what no record names was
        // left by a transaction that did not commit, or made dead by one
        // whose process died before deleting it.
        let txn = db.begin_read().context(what)?;
        let recorded = recorded_packs(&txn)?;
        let meta = txn.open_table(META).context(what)?;
        sweep_unrecorded(dir, &recorded, &pack_owner(&meta)?)?;
    }
    Ok(())
}

/// Whether a commit was staging chunks when the store was last written.
fn staging_flag(txn: &redb::ReadTransaction) -> Result<bool> {
    let ctx = || "reading table meta".to_owned();
    let meta = txn.open_table(META).context(ctx)?;
    Ok(meta.get(META_STAGING).context(ctx)?.is_some())
}

/// Check that a read-only database is a store this build reads.
pub(crate) fn check_read_only(path: &Path, db: &ReadOnlyDatabase) -> Result<()> {
    check_txn(path, db.begin_read())
}

/// [`check_read_only`] for a database opened through an overlay.
pub(crate) fn check_tables_of(path: &Path, db: &Database) -> Result<()> {
    check_txn(path, db.begin_read())
}

fn check_txn(
    path: &Path,
    txn: std::result::Result<redb::ReadTransaction, redb::TransactionError>,
) -> Result<()> {
    let txn = txn.context(|| format!("reading {}", path.display()))?;
    match check_tables(path, &txn)? {
        Found::Store(_) => Ok(()),
        Found::Empty => Err(Error::NotAStore {
            path: path.to_owned(),
            reason: "it has no tables".into(),
        }),
    }
}

/// Create a new store at `path` so that a crash leaves either no file or a
/// complete, initialised store: build it under a temporary name beside
/// `path`, fsync it, link it into place (never over an existing file), and
/// fsync the directory. redb writes a new file's header in place, so a
/// process killed while creating one in place leaves a file no open accepts.
pub(crate) fn create_atomically(path: &Path, options: &Settings) -> Result<()> {
    let (dir, tmp) = crate::file::temp_beside(path, "creating");
    let result = (|| {
        let db = builder(options)
            .create(&tmp)
            .map_err(|e| open_error(path, e))?;
        prepare_writable(path, None, &db, options)?;
        drop(db);
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io("fsync", &tmp, e))?;
        match std::fs::hard_link(&tmp, path) {
            // Another process created it first: use theirs.
            Ok(()) | Err(_) if path.exists() => Ok(()),
            // A filesystem without hard links: rename (not atomic against a
            // concurrent creator, still atomic against a crash).
            _ => std::fs::rename(&tmp, path).map_err(|e| Error::io("rename new store to", path, e)),
        }
    })();
    let _ = std::fs::remove_file(&tmp);
    result?;
    crate::file::sync_dir(&dir)
}

/// Run an open behind the panic boundary: a panic there means a damaged
/// file, reported as an open error.
fn open_guarded(path: &Path, f: impl FnOnce() -> Result<State>) -> Result<State> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        Err(Error::Open {
            path: path.to_owned(),
            source: format!("redb panicked: {}", panic_message(&*payload)).into(),
        })
    })
}

pub(super) fn open_writable(source: &Source, options: &Settings) -> Result<State> {
    let path = source.path();
    match source {
        Source::Path(p) => {
            let packs = source.pack_dir();
            if let Some(packs) = packs
                .as_ref()
                .map(|d| &d.path)
                .filter(|d| d.exists() && !d.is_dir())
            {
                // Checked before a new store is created: a refused open
                // leaves nothing behind.
                let e = std::io::Error::from(std::io::ErrorKind::NotADirectory);
                return Err(Error::io(
                    "use as the store's pack directory (move that file away)",
                    packs,
                    e,
                ));
            }
            if !p.exists() {
                create_atomically(p, options)?;
            }
            open_guarded(path, || {
                let db = builder(options)
                    .create(p)
                    .map_err(|e| open_error(path, e))?;
                prepare_writable(path, packs.as_ref(), &db, options)?;
                Ok(State::Writable(db))
            })
        }
        Source::Backend(_, factory, packs) => {
            // The caller's factory runs outside the boundary: its panics
            // are its own.
            let backend: DynBackend =
                factory().map_err(|e| Error::io("open backend of", path, e))?;
            open_guarded(path, || {
                let db = builder(options)
                    .create_with_backend(backend)
                    .map_err(|e| open_error(path, e))?;
                prepare_writable(path, packs.as_ref(), &db, options)?;
                Ok(State::Writable(db))
            })
        }
    }
}

pub(super) fn open_read_only(source: &Source, options: &Settings) -> Result<State> {
    let path = source.path();
    open_guarded(path, || {
        let db = match builder(options).open_read_only(path) {
            // The writer died: redb would repair the file, which a reader
            // must not change. Repair a copy in memory instead.
            Err(redb::DatabaseError::RepairAborted) => {
                let stamp = Stamp::of(path)?;
                let db = open_overlay(path, options)?;
                check_tables_of(path, &db)?;
                return Ok(State::Recovered(db, stamp));
            }
            opened => opened.map_err(|e| open_error(path, e))?,
        };
        check_read_only(path, &db)?;
        Ok(State::ReadOnly(db))
    })
}

/// Open the file at `path` for redb through an [`overlay::Overlay`]: redb
/// may repair it, and nothing reaches the file.
pub(super) fn open_overlay(path: &Path, options: &Settings) -> Result<Database> {
    let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let overlay = overlay::Overlay::new(file).map_err(|e| Error::io("read", path, e))?;
    let mut builder = builder(options);
    // The overlay has no locks: no other handle shares it.
    builder.set_concurrency_mode(redb::ConcurrencyMode::ExclusiveWriter);
    builder.set_check_integrity_on_open(false);
    builder
        .create_with_backend(overlay)
        .map_err(|e| open_error(path, e))
}

/// Check the checksum of every redb page of the store at `path` without
/// changing the file. `Ok(false)`: damage was found.
pub(crate) fn check_pages(path: &Path, options: &Settings) -> Result<bool> {
    let before = Stamp::of(path)?;
    let checked = catch_unwind(AssertUnwindSafe(|| {
        let mut db = open_overlay(path, options)?;
        check_tables_of(path, &db)?;
        match db.check_integrity() {
            Ok(ok) => Ok(ok),
            Err(redb::DatabaseError::Storage(redb::StorageError::Corrupted(_))) => Ok(false),
            Err(e) => Err(open_error(path, e)),
        }
    }));
    let ok = checked.unwrap_or(Ok(false));
    // What was read is one state of the file only if no commit landed
    // meanwhile (each rewrites the header). Damage is reported only when
    // the file stays still a moment longer: a commit under way when the
    // check ended would have shown itself by then.
    if !matches!(ok, Ok(true)) {
        std::thread::sleep(SETTLE);
    }
    if Stamp::of(path)? != before {
        return Err(Error::StoreChanged {
            path: path.to_owned(),
        });
    }
    ok
}

/// How long a damaged-looking file must stay unchanged to be reported.
const SETTLE: std::time::Duration = std::time::Duration::from_secs(1);

/// What changes when a commit lands: the length, the modification time
/// and redb's header (the first page, with the commit slots).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Stamp {
    len: u64,
    modified: Option<std::time::SystemTime>,
    header: Vec<u8>,
}

impl Stamp {
    pub(super) fn of(path: &Path) -> Result<Stamp> {
        use std::io::Read;
        let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
        let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
        let mut header = Vec::with_capacity(4096);
        file.take(4096)
            .read_to_end(&mut header)
            .map_err(|e| Error::io("read", path, e))?;
        Ok(Stamp {
            len: meta.len(),
            modified: meta.modified().ok(),
            header,
        })
    }
}
