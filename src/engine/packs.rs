//! Pack files in a transaction: the writer a large commit hands its new
//! chunks to, the tables that record them, and the reader that reads a
//! chunk straight into its place ([`crate::format::packs`] is the layout).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use redb::{
    ReadOnlyTable, ReadTransaction, ReadableTable, Table, TableDefinition, TableHandle,
    WriteTransaction,
};

use super::hashing::read_hashed;
use crate::error::StorageContext;
use crate::format::manifest::{hex, Hash};
use crate::format::packs::{pack_name, parse_pack_name, PackLoc};
use crate::format::tables::{PACK_CHUNKS, PACK_FILES};
use crate::{Error, Result};

/// The pack file a transaction appends its new chunks to: created at the
/// first chunk, fsynced by [`sync`](Self::sync) before the transaction
/// commits, deleted if the transaction ends without reaching that point.
pub(crate) struct PackWriter {
    dir: PathBuf,
    id: u32,
    file: Option<File>,
    len: u64,
    /// Bytes of this pack's chunks not deleted again in the transaction.
    pub(crate) live: u64,
    synced: bool,
    /// Whether this transaction created the pack directory.
    new_dir: bool,
}

impl PackWriter {
    pub(crate) fn new(dir: &Path, id: u32) -> PackWriter {
        PackWriter {
            dir: dir.to_owned(),
            id,
            file: None,
            len: 0,
            live: 0,
            synced: false,
            new_dir: false,
        }
    }

    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    pub(crate) fn path(&self) -> PathBuf {
        self.dir.join(pack_name(self.id))
    }

    /// Bytes written so far.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Append `piece` (chunk `hash`); where it went.
    pub(crate) fn append(&mut self, hash: &Hash, piece: &[u8]) -> Result<PackLoc> {
        let path = self.path();
        let len = u32::try_from(piece.len())
            .map_err(|_| Error::corrupt(None, format!("chunk {} is too long", hex(hash))))?;
        if self.file.is_none() {
            if !self.dir.is_dir() {
                fs::create_dir_all(&self.dir)
                    .map_err(|e| Error::io("create pack directory", &self.dir, e))?;
                self.new_dir = true;
            }
            // A file of this id is what a transaction that never committed
            // left: it is overwritten.
            let f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .map_err(|e| Error::io("create pack file", &path, e))?;
            self.file = Some(f);
        }
        let Some(file) = &self.file else {
            return Err(Error::corrupt(None, "a pack file did not open"));
        };
        #[cfg(test)]
        faults::strike(faults::Fault::Write, "write pack file", &path)?;
        file.write_all_at(piece, self.len)
            .map_err(|e| Error::io("write pack file", &path, e))?;
        let loc = PackLoc {
            pack: self.id,
            offset: self.len,
            len,
            hash: *hash,
        };
        self.len += u64::from(len);
        self.live += u64::from(len);
        Ok(loc)
    }

    /// Make what was written durable (file and directory entry): the last
    /// step before the transaction that records it commits.
    pub(crate) fn sync(&mut self) -> Result<()> {
        if let Some(file) = &self.file {
            #[cfg(test)]
            faults::strike(faults::Fault::Sync, "fsync pack file", &self.path())?;
            file.sync_data()
                .map_err(|e| Error::io("fsync pack file", self.path(), e))?;
            #[cfg(test)]
            faults::strike(faults::Fault::SyncDir, "fsync directory", &self.dir)?;
            crate::file::sync_dir(&self.dir)?;
            if self.new_dir {
                // The directory's own entry, beside the store.
                let parent = match self.dir.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p,
                    _ => Path::new("."),
                };
                crate::file::sync_dir(parent)?;
            }
        }
        self.synced = true;
        Ok(())
    }
}

impl Drop for PackWriter {
    fn drop(&mut self) {
        // A transaction that failed before its commit: nothing records
        // this file. (After `sync` the commit may have landed: a file no
        // record names is deleted at the next writable open.)
        if self.file.is_some() && !self.synced {
            let _ = fs::remove_file(self.path());
        }
    }
}

/// The pack tables of a write transaction, opened when first needed (a
/// store that never packed has none), and the files it made dead.
pub(crate) struct PackTables<'txn> {
    txn: &'txn WriteTransaction,
    /// The store's pack directory; `None` for a store with no path.
    pub(crate) dir: Option<PathBuf>,
    /// Set for a transaction whose new chunks go to a pack file.
    pub(crate) writer: Option<PackWriter>,
    chunks: Option<Table<'txn, u64, &'static [u8]>>,
    files: Option<Table<'txn, u32, (u64, u64)>>,
    /// Pack files with no live chunk left, deleted after the commit.
    pub(crate) dead: Vec<PathBuf>,
}

impl<'txn> PackTables<'txn> {
    pub(crate) fn new(txn: &'txn WriteTransaction, dir: Option<PathBuf>) -> Self {
        PackTables {
            txn,
            dir,
            writer: None,
            chunks: None,
            files: None,
            dead: Vec::new(),
        }
    }

    fn chunks(&mut self) -> Result<&mut Table<'txn, u64, &'static [u8]>> {
        opened(self.txn, &mut self.chunks, PACK_CHUNKS)
    }

    fn files(&mut self) -> Result<&mut Table<'txn, u32, (u64, u64)>> {
        opened(self.txn, &mut self.files, PACK_FILES)
    }

    /// Whether this store has pack tables at all (without creating them).
    fn exist(&self) -> Result<bool> {
        if self.chunks.is_some() {
            return Ok(true);
        }
        let ctx = || "listing tables".to_owned();
        Ok(self
            .txn
            .list_tables()
            .context(ctx)?
            .any(|t| redb::TableHandle::name(&t) == "pack_chunks"))
    }

    /// Write chunk `id` (`hash`) to this transaction's pack file, if it
    /// packs; `false` if the chunk belongs in `chunk_data`.
    pub(crate) fn insert(&mut self, id: u64, hash: &Hash, piece: &[u8]) -> Result<bool> {
        let Some(writer) = &mut self.writer else {
            return Ok(false);
        };
        let loc = writer.append(hash, piece)?;
        self.chunks()?
            .insert(id, loc.encode().as_slice())
            .context(|| format!("writing table pack_chunks for chunk {}", hex(hash)))?;
        Ok(true)
    }

    /// Delete the record of chunk `id` if it is in a pack file; the bytes
    /// it held. A pack file left with no live bytes is deleted after the
    /// commit.
    pub(crate) fn remove(&mut self, id: u64) -> Result<Option<u64>> {
        if !self.exist()? {
            return Ok(None);
        }
        let ctx = || format!("writing table pack_chunks for chunk id {id}");
        let Some(bytes) = self.chunks()?.remove(id).context(ctx)? else {
            return Ok(None);
        };
        let loc = PackLoc::decode(id, bytes.value())?;
        drop(bytes);
        let len = u64::from(loc.len);
        if let Some(w) = self.writer.as_mut().filter(|w| w.id() == loc.pack) {
            w.live = w.live.saturating_sub(len);
            return Ok(Some(len));
        }
        let ctx = || format!("writing table pack_files for pack file {}", loc.pack);
        let files = self.files()?;
        let (file_len, live) = files
            .get(loc.pack)
            .context(ctx)?
            .map_or((0, 0), |g| g.value());
        let live = live.saturating_sub(len);
        if live == 0 {
            files.remove(loc.pack).context(ctx)?;
            if let Some(dir) = &self.dir {
                self.dead.push(dir.join(pack_name(loc.pack)));
            }
        } else {
            files.insert(loc.pack, (file_len, live)).context(ctx)?;
        }
        Ok(Some(len))
    }

    /// Make this transaction's pack file durable and record it; the pack
    /// ids used (so the next transaction takes a new one), if any.
    pub(crate) fn finish(&mut self) -> Result<Option<u32>> {
        let Some(mut writer) = self.writer.take() else {
            return Ok(None);
        };
        if writer.len() == 0 {
            return Ok(None);
        }
        writer.sync()?;
        let id = writer.id();
        if writer.live == 0 {
            self.dead.push(writer.path());
        } else {
            let (len, live) = (writer.len(), writer.live);
            self.files()?
                .insert(id, (len, live))
                .context(|| format!("writing table pack_files for pack file {id}"))?;
        }
        Ok(Some(id))
    }
}

impl PackTables<'_> {
    /// Move the live chunks of every pack file at least half dead into this
    /// transaction's pack file (each chunk hash-checked on the way), and
    /// mark the old files dead; returns the files and the bytes freed. The
    /// caller has set a writer ([`PackTables::writer`]).
    pub(crate) fn compact(&mut self) -> Result<(u64, u64)> {
        let (Some(dir), true, true) = (self.dir.clone(), self.writer.is_some(), self.exist()?)
        else {
            return Ok((0, 0));
        };
        let ctx = || "reading table pack_files".to_owned();
        let mut sparse = HashMap::new();
        for entry in self.files()?.range::<u32>(..).context(ctx)? {
            let (id, value) = entry.context(ctx)?;
            let (len, live) = value.value();
            if live.saturating_mul(2) <= len {
                sparse.insert(id.value(), (len, live));
            }
        }
        if sparse.is_empty() {
            return Ok((0, 0));
        }
        let ctx = || "reading table pack_chunks".to_owned();
        let mut moving = Vec::new();
        for entry in self.chunks()?.range::<u64>(..).context(ctx)? {
            let (id, value) = entry.context(ctx)?;
            let loc = PackLoc::decode(id.value(), value.value())?;
            if sparse.contains_key(&loc.pack) {
                moving.push((id.value(), loc));
            }
        }
        let files = PackFiles::new(dir.clone());
        let mut buf = Vec::new();
        for (id, loc) in moving {
            buf.resize(loc.len as usize, 0);
            if let Err(what) = files.read(&loc, &mut buf)? {
                return Err(Error::corrupt(
                    None,
                    format!("chunk {} {what}; compaction stopped", hex(&loc.hash)),
                ));
            }
            self.insert(id, &loc.hash, &buf)?;
        }
        let mut freed = 0;
        for (id, (len, live)) in &sparse {
            self.files()?
                .remove(*id)
                .context(|| format!("writing table pack_files for pack file {id}"))?;
            self.dead.push(dir.join(pack_name(*id)));
            freed += len - live;
        }
        Ok((sparse.len() as u64, freed))
    }
}

/// The table `slot` holds, opened in `txn` the first time it is needed.
fn opened<'s, 'txn, K: redb::Key + 'static, V: redb::Value + 'static>(
    txn: &'txn WriteTransaction,
    slot: &'s mut Option<Table<'txn, K, V>>,
    table: TableDefinition<K, V>,
) -> Result<&'s mut Table<'txn, K, V>> {
    if slot.is_none() {
        let name = table.name().to_owned();
        *slot = Some(
            txn.open_table(table)
                .context(|| format!("opening table {name}"))?,
        );
    }
    slot.as_mut()
        .ok_or_else(|| Error::corrupt(None, "a pack table did not open"))
}

/// The ids of the pack files the store records.
pub(crate) fn recorded_packs(txn: &ReadTransaction) -> Result<Vec<u32>> {
    let ctx = || "reading table pack_files".to_owned();
    let files = match txn.open_table(PACK_FILES) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(e).context(ctx),
    };
    files
        .range::<u32>(..)
        .context(ctx)?
        .map(|r| r.map(|(k, _)| k.value()))
        .collect::<Result<Vec<_>, _>>()
        .context(ctx)
}

/// The pack files in `dir` that `recorded` does not name: left by
/// transactions that never committed, or made dead by one whose process
/// died before deleting them.
pub(crate) fn unrecorded(dir: &Path, recorded: &[u32]) -> Result<Vec<PathBuf>> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("list pack directory", dir, e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("list pack directory", dir, e))?;
        let name = entry.file_name();
        if let Some(id) = name.to_str().and_then(parse_pack_name) {
            if !recorded.contains(&id) {
                found.push(entry.path());
            }
        }
    }
    Ok(found)
}

/// Delete the [`unrecorded`] pack files of `dir`; returns how many.
pub(crate) fn sweep_unrecorded(dir: &Path, recorded: &[u32]) -> Result<usize> {
    let found = unrecorded(dir, recorded)?;
    for path in &found {
        fs::remove_file(path).map_err(|e| Error::io("remove pack file", path, e))?;
    }
    Ok(found.len())
}

/// Pack files one reader keeps open at most.
const MAX_OPEN_PACKS: usize = 64;

/// The pack files of a store's directory, each opened on first use.
pub(crate) struct PackFiles {
    dir: PathBuf,
    open: Mutex<HashMap<u32, Arc<File>>>,
}

impl PackFiles {
    pub(crate) fn new(dir: PathBuf) -> Self {
        PackFiles {
            dir,
            open: Mutex::new(HashMap::new()),
        }
    }

    fn file(&self, pack: u32) -> Result<Arc<File>> {
        let mut open = self
            .open
            .lock()
            .map_err(|_| Error::corrupt(None, "a pack file reader panicked"))?;
        if let Some(f) = open.get(&pack) {
            return Ok(f.clone());
        }
        let path = self.dir.join(pack_name(pack));
        let file = Arc::new(File::open(&path).map_err(|e| Error::io("open pack file", &path, e))?);
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
    /// `Ok(Err(what))` when it fails the check or lies past the end of its
    /// file (`out` is then zeroed: wrong bytes never stay), `Err` for an
    /// I/O error.
    pub(crate) fn read(
        &self,
        loc: &PackLoc,
        out: &mut [u8],
    ) -> Result<std::result::Result<(), String>> {
        let file = self.file(loc.pack)?;
        let name = pack_name(loc.pack);
        match read_hashed(out, &mut |slice, at| {
            file.read_exact_at(slice, loc.offset + at)
        }) {
            Ok(hash) if hash == loc.hash => Ok(Ok(())),
            Ok(_) => {
                out.fill(0);
                Ok(Err(format!(
                    "fails its hash check in pack file {name} at offset {}",
                    loc.offset
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(Err(format!(
                "is past the end of pack file {name} (bytes {}..{})",
                loc.offset,
                loc.end()
            ))),
            Err(e) => Err(Error::io("read pack file", self.dir.join(name), e)),
        }
    }
}

/// Reads chunks from a read transaction's pack files.
pub(crate) struct PackReader {
    table: ReadOnlyTable<u64, &'static [u8]>,
    files: PackFiles,
    /// Set when a pack file fails a check ([`View::pack_fault`]).
    ///
    /// [`View::pack_fault`]: super::View
    faulted: Arc<AtomicBool>,
}

impl PackReader {
    pub(crate) fn new(
        dir: PathBuf,
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
        self.files.read(loc, out)?.map_err(|what| {
            self.faulted.store(true, Ordering::Relaxed);
            fault(what)
        })
    }
}

/// Whether `e` is a pack file of `dir` that was not there: deleted by a
/// writer after this reader's transaction began (the read is retried in a
/// new one), or lost.
pub(crate) fn is_missing_pack(e: &Error, dir: &Path) -> bool {
    matches!(e, Error::Io { op: "open pack file", path, source }
        if source.kind() == std::io::ErrorKind::NotFound && path.starts_with(dir))
}

/// The error for pack file `e` ([`is_missing_pack`]) given the store as it
/// is now (`now`): still recorded, it was lost ([`Error::Corrupt`]); no
/// longer recorded, a writer deleted it after the read began: every step
/// with chunks in it was removed, or compaction moved them
/// ([`Error::ReadInterrupted`]).
pub(crate) fn missing_pack(e: Error, now: &ReadTransaction) -> Result<Error> {
    let Error::Io { path, .. } = &e else {
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
        let dir = path.parent().unwrap_or(path);
        let detail = if dir.exists() {
            format!("pack file {} is missing", path.display())
        } else {
            format!(
                "pack file {} is missing: the store's pack directory {} is gone \
                 (a store is its file and that directory: copy, move and remove \
                 them together, or use `ckpt cp`)",
                path.display(),
                dir.display()
            )
        };
        Error::corrupt(None, detail)
    } else {
        Error::ReadInterrupted {
            detail: format!("pack file {} was deleted while it was read", path.display()),
        }
    })
}

/// Faults injected into pack file writes, for the tests of what a failed
/// write or fsync leaves (`store::pack_faults`).
#[cfg(test)]
pub(crate) mod faults {
    use std::cell::Cell;
    use std::path::Path;

    use crate::{Error, Result};

    /// Which call fails.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum Fault {
        Write,
        Sync,
        /// The fsync of the pack directory (the new file's entry).
        SyncDir,
    }

    thread_local! {
        static NEXT: Cell<Option<Fault>> = const { Cell::new(None) };
    }

    /// Make the next `fault` call of this thread fail.
    pub(crate) fn arm(fault: Fault) {
        NEXT.with(|n| n.set(Some(fault)));
    }

    /// Fail here if this is the armed call.
    pub(crate) fn strike(fault: Fault, op: &'static str, path: &Path) -> Result<()> {
        if NEXT.with(Cell::get) == Some(fault) {
            NEXT.with(|n| n.set(None));
            return Err(Error::io(op, path, std::io::Error::other("injected fault")));
        }
        Ok(())
    }
}
