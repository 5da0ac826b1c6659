//! Reading chunks from pack files: each file opened once per reader, each
//! chunk read straight into its place and hash-checked there; and what a
//! pack file that is not there means.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use redb::{ReadOnlyTable, ReadTransaction};

use super::io::{PackDir, PackFile};
use crate::engine::hashing::read_hashed;
use crate::error::StorageContext;
use crate::format::packs::{pack_name, parse_pack_name, PackLoc};
use crate::format::tables::PACK_FILES;
use crate::{Error, PackError, PackOp, Result};

/// Pack files one reader keeps open at most.
const MAX_OPEN_PACKS: usize = 64;

/// The pack files of a store's directory, each opened on first use.
pub(crate) struct PackFiles {
    dir: PackDir,
    open: Mutex<HashMap<u32, Arc<dyn PackFile>>>,
}

impl PackFiles {
    pub(crate) fn new(dir: PackDir) -> Self {
        PackFiles {
            dir,
            open: Mutex::new(HashMap::new()),
        }
    }

    fn file(&self, pack: u32) -> std::result::Result<Arc<dyn PackFile>, PackError> {
        // Only a cache of open files: a thread that panicked holding it
        // left it whole.
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(f) = open.get(&pack) {
            return Ok(f.clone());
        }
        let path = self.dir.file(pack);
        let file: Arc<dyn PackFile> = Arc::from(
            self.dir
                .io
                .open_read(&path)
                .map_err(|e| PackError::io(PackOp::Open, &path, e))?,
        );
        if open.len() >= MAX_OPEN_PACKS {
            // A step whose chunks are spread over many files (a long run
            // that changes a little each step): stay far below the
            // process's file limit. Files in use stay open where used.
            open.clear();
        }
        open.insert(pack, file.clone());
        Ok(file)
    }

    /// Read the chunk at `loc` into `out` (its length) and check its hash:
    /// [`PackError::Damaged`] when it fails the check or lies past the end
    /// of its file (`out` is then zeroed: wrong bytes never stay).
    pub(crate) fn read(&self, loc: &PackLoc, out: &mut [u8]) -> std::result::Result<(), PackError> {
        let file = self.file(loc.pack)?;
        let name = pack_name(loc.pack);
        let damaged = |what: String| PackError::Damaged {
            file: name.clone(),
            what,
        };
        match read_hashed(out, &mut |slice, at| file.read_at(slice, loc.offset + at)) {
            Ok(hash) if hash == loc.hash => Ok(()),
            Ok(_) => {
                out.fill(0);
                Err(damaged(format!(
                    "fails its hash check in pack file {name} at offset {}",
                    loc.offset
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(damaged(format!(
                "is past the end of pack file {name} (bytes {}..{})",
                loc.offset,
                loc.end()
            ))),
            Err(e) if e.kind() == std::io::ErrorKind::IsADirectory => Err(damaged(format!(
                "is in pack file {name}, which is a directory, not a file"
            ))),
            Err(e) => Err(PackError::io(PackOp::Read, self.dir.path.join(&name), e)),
        }
    }
}

/// Reads chunks from a read transaction's pack files.
pub(crate) struct PackReader {
    table: ReadOnlyTable<u64, &'static [u8]>,
    files: PackFiles,
    /// Set when a pack file fails a check ([`View::pack_fault`]).
    ///
    /// [`View::pack_fault`]: crate::engine::read::View
    faulted: Arc<AtomicBool>,
}

impl PackReader {
    pub(crate) fn new(
        dir: PackDir,
        table: ReadOnlyTable<u64, &'static [u8]>,
        faulted: Arc<AtomicBool>,
    ) -> Self {
        PackReader {
            table,
            files: PackFiles::new(dir),
            faulted,
        }
    }

    /// Where chunk `id` is, if it is in a pack file.
    pub(crate) fn loc(&self, id: u64) -> Result<Option<PackLoc>> {
        let found = self
            .table
            .get(id)
            .context(|| format!("reading table pack_chunks for chunk id {id}"))?;
        found.map(|g| PackLoc::decode(id, g.value())).transpose()
    }

    /// Read the chunk at `loc` into `out` (its length), checked
    /// ([`PackFiles::read`]); `fault` words an integrity failure.
    pub(crate) fn read_into(
        &self,
        loc: &PackLoc,
        out: &mut [u8],
        fault: &dyn Fn(String) -> Error,
    ) -> Result<()> {
        match self.files.read(loc, out) {
            Ok(()) => Ok(()),
            Err(PackError::Damaged { what, .. }) => {
                self.faulted.store(true, Ordering::Relaxed);
                Err(fault(what))
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// Whether `e` is a pack file of `dir` that was not there: deleted by a
/// writer after this reader's transaction began (the read is retried in a
/// new one), or lost.
pub(crate) fn is_missing_pack(e: &Error, dir: &Path) -> bool {
    matches!(e, Error::Pack(PackError::Io { op: PackOp::Open, path, source })
        if source.kind() == std::io::ErrorKind::NotFound && path.starts_with(dir))
}

/// The error for pack file `e` ([`is_missing_pack`]) given the store as it
/// is now (`now`): still recorded, it was lost ([`Error::Corrupt`]); no
/// longer recorded, a writer deleted it after the read began: every step
/// with chunks in it was removed, or compaction moved them
/// ([`Error::ReadInterrupted`]).
pub(crate) fn missing_pack(e: Error, now: &ReadTransaction, dir: &PackDir) -> Result<Error> {
    let Error::Pack(PackError::Io { path, .. }) = &e else {
        return Ok(e);
    };
    let id = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_pack_name);
    let recorded = match (id, now.open_table(PACK_FILES)) {
        (Some(id), Ok(files)) => files
            .get(id)
            .context(|| "reading table pack_files".to_owned())?
            .is_some(),
        _ => false,
    };
    Ok(if recorded {
        let detail = if dir.io.exists(&dir.path) {
            format!("pack file {} is missing", path.display())
        } else {
            format!(
                "pack file {} is missing: the store's pack directory {} is gone \
                 (a store is its file and that directory: copy, move and remove \
                 them together, or use `ckpt cp`)",
                path.display(),
                dir.path.display()
            )
        };
        Error::corrupt(None, detail)
    } else {
        Error::ReadInterrupted {
            detail: format!("pack file {} was deleted while it was read", path.display()),
        }
    })
}
