//! The pack tables of a write transaction (`pack_chunks`, `pack_files`):
//! recording a transaction's chunks, releasing them, compaction; and what
//! the directory holds that no record names.

use std::collections::HashMap;
use std::path::PathBuf;

use redb::{ReadTransaction, ReadableTable, Table, TableDefinition, TableHandle, WriteTransaction};

use super::io::PackDir;
use super::read::PackFiles;
use super::writer::PackWriter;
use crate::error::StorageContext;
use crate::format::manifest::{hex, Hash};
use crate::format::packs::{parse_pack_name, OwnerTag, PackLoc, PACK_HEADER_BYTES};
use crate::format::tables::{PACK_CHUNKS, PACK_FILES};
use crate::{Error, PackError, PackOp, Result};

/// The pack tables of a write transaction, opened when first needed (a
/// store that never packed has none), and the files it made dead.
pub(crate) struct PackTables<'txn> {
    txn: &'txn WriteTransaction,
    /// The store's pack directory; `None` for a store with no path.
    pub(crate) dir: Option<PackDir>,
    /// Set for a transaction whose new chunks go to a pack file.
    pub(crate) writer: Option<PackWriter>,
    chunks: Option<Table<'txn, u64, &'static [u8]>>,
    files: Option<Table<'txn, u32, (u64, u64)>>,
    /// Pack files with no live chunk left, deleted after the commit.
    pub(crate) dead: Vec<PathBuf>,
    /// Set when a pack file read in this transaction fails its check: the
    /// damage is in that file, not in the redb file.
    pub(crate) faulted: bool,
    /// Whether `pack_chunks` was there when first looked up (`exist`).
    listed: Option<bool>,
    /// Pack files this transaction checked before reusing a chunk in them
    /// (see [`PackTables::holds`]): whether each was present and whole.
    confirmed: HashMap<u32, bool>,
    /// The tag this store's pack files carry in their headers (read from
    /// `meta` once per transaction): a file of the right name and length
    /// under another store's tag is not ours.
    pub(crate) owner: OwnerTag,
}

impl<'txn> PackTables<'txn> {
    pub(crate) fn new(txn: &'txn WriteTransaction, dir: Option<PackDir>, owner: OwnerTag) -> Self {
        PackTables {
            txn,
            dir,
            writer: None,
            chunks: None,
            files: None,
            dead: Vec::new(),
            faulted: false,
            listed: None,
            confirmed: HashMap::new(),
            owner,
        }
    }

    fn chunks(&mut self) -> Result<&mut Table<'txn, u64, &'static [u8]>> {
        opened(self.txn, &mut self.chunks, PACK_CHUNKS)
    }

    fn files(&mut self) -> Result<&mut Table<'txn, u32, (u64, u64)>> {
        opened(self.txn, &mut self.files, PACK_FILES)
    }

    /// Whether this store has pack tables at all (without creating them;
    /// looked up once per transaction until this one creates them).
    fn exist(&mut self) -> Result<bool> {
        if self.chunks.is_some() {
            return Ok(true);
        }
        if let Some(found) = self.listed {
            return Ok(found);
        }
        let ctx = || "listing tables".to_owned();
        let found = self
            .txn
            .list_tables()
            .context(ctx)?
            .any(|t| redb::TableHandle::name(&t) == "pack_chunks");
        self.listed = Some(found);
        Ok(found)
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

    /// Whether chunk `id` may be referenced as stored: it is in `chunk_data`
    /// or in this transaction's pack file, or its pack file is present and
    /// whole (there, of the recorded length, under a header naming it and
    /// this store as its writer).
    /// Each pack file is checked once per transaction; a commit that reuses
    /// a chunk never points at bytes that are gone (a file deleted by hand,
    /// cut short, or replaced).
    pub(crate) fn holds(&mut self, id: u64) -> Result<bool> {
        if self.dir.is_none() || !self.exist()? {
            return Ok(true);
        }
        let ctx = || format!("reading table pack_chunks for chunk id {id}");
        let Some(bytes) = self.chunks()?.get(id).context(ctx)? else {
            return Ok(true);
        };
        let loc = PackLoc::decode(id, bytes.value())?;
        drop(bytes);
        if self.writer.as_ref().is_some_and(|w| w.id() == loc.pack) {
            return Ok(true);
        }
        if let Some(&whole) = self.confirmed.get(&loc.pack) {
            return Ok(whole);
        }
        let ctx = || format!("reading table pack_files for pack file {}", loc.pack);
        let recorded = self
            .files()?
            .get(loc.pack)
            .context(ctx)?
            .map(|g| g.value().0);
        let whole = match (&self.dir, recorded) {
            (Some(dir), Some(len)) => {
                let path = dir.file(loc.pack);
                dir.io.len(&path).is_ok_and(|n| n == len)
                    && dir
                        .header_of(&path)
                        .is_some_and(|h| h.pack == loc.pack && h.owner == self.owner)
            }
            _ => false,
        };
        self.confirmed.insert(loc.pack, whole);
        Ok(whole)
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
                self.dead.push(dir.file(loc.pack));
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
            match files.read(&loc, &mut buf) {
                Ok(()) => {}
                Err(PackError::Damaged { what, .. }) => {
                    self.faulted = true;
                    return Err(Error::corrupt(
                        None,
                        format!("chunk {} {what}; compaction stopped", hex(&loc.hash)),
                    ));
                }
                Err(e) => return Err(e.into()),
            }
            self.insert(id, &loc.hash, &buf)?;
        }
        let mut freed = 0;
        for (id, (len, live)) in &sparse {
            self.files()?
                .remove(*id)
                .context(|| format!("writing table pack_files for pack file {id}"))?;
            self.dead.push(dir.file(*id));
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

/// The pack files in `dir` that `recorded` does not name, with their ids:
/// left by transactions that never committed, or made dead by one whose
/// process died before deleting them.
pub(crate) fn unrecorded(dir: &PackDir, recorded: &[u32]) -> Result<Vec<(u32, PathBuf)>> {
    let entries = match dir.io.list(&dir.path) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(PackError::io(PackOp::ListDirectory, &dir.path, e).into()),
    };
    let mut found: Vec<(u32, PathBuf)> = entries
        .into_iter()
        .filter_map(|path| {
            let id = path.file_name()?.to_str().and_then(parse_pack_name)?;
            (!recorded.contains(&id)).then_some((id, path))
        })
        .collect();
    found.sort();
    Ok(found)
}

/// Delete the [`unrecorded`] pack files of `dir` whose header says the
/// store tagged `owner` wrote them, and those too short to hold a header
/// (a writer killed between creating its file and writing the header:
/// such a file holds no chunk of any store); returns how many. Other
/// files without a header, or another store's, are left where they are
/// (`verify` reports them).
pub(crate) fn sweep_unrecorded(dir: &PackDir, recorded: &[u32], owner: &OwnerTag) -> Result<usize> {
    let mut swept = 0;
    for (_, path) in unrecorded(dir, recorded)? {
        let ours = dir.header_of(&path).is_some_and(|h| h.owner == *owner);
        let empty = dir
            .io
            .len(&path)
            .is_ok_and(|n| n < PACK_HEADER_BYTES as u64);
        if ours || empty {
            dir.io
                .remove_file(&path)
                .map_err(|e| PackError::io(PackOp::Remove, &path, e))?;
            swept += 1;
        }
    }
    Ok(swept)
}
