//! The pack file a transaction writes: created with its header at the
//! first chunk, appended to from the caller's memory, fsynced with its
//! directory before the transaction commits, deleted if it never gets
//! there.

use std::path::{Path, PathBuf};

use super::io::{PackDir, PackFile};
use crate::format::manifest::{hex, Hash};
use crate::format::packs::{OwnerTag, PackHeader, PackLoc, PACK_HEADER_BYTES};
use crate::{Error, PackError, PackOp, Result};

#[cfg(test)]
use super::faults;

/// Ids a writer skips at most past files that are not its store's.
const MAX_ID_SKIPS: usize = 1024;

/// The pack file a transaction appends its new chunks to: created at the
/// first chunk, fsynced by [`sync`](Self::sync) before the transaction
/// commits, deleted if the transaction ends without reaching that point.
pub(crate) struct PackWriter {
    dir: PackDir,
    id: u32,
    /// The tag of the store, written in the file's header.
    owner: OwnerTag,
    file: Option<Box<dyn PackFile>>,
    len: u64,
    /// Bytes of this pack's chunks not deleted again in the transaction.
    pub(crate) live: u64,
    synced: bool,
    /// Whether this transaction created the pack directory.
    new_dir: bool,
}

impl PackWriter {
    /// A writer of the pack file `id` (or, if a file of that id is there
    /// and not this store's, the next free id) of the store tagged `owner`.
    pub(crate) fn new(dir: &PackDir, id: u32, owner: OwnerTag) -> PackWriter {
        PackWriter {
            dir: dir.clone(),
            id,
            owner,
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
        self.dir.file(self.id)
    }

    /// Bytes written so far.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Append `piece` (chunk `hash`); where it went.
    pub(crate) fn append(&mut self, hash: &Hash, piece: &[u8]) -> Result<PackLoc> {
        let len = u32::try_from(piece.len())
            .map_err(|_| Error::corrupt(None, format!("chunk {} is too long", hex(hash))))?;
        if self.file.is_none() {
            self.create()?;
        }
        let Some(file) = &self.file else {
            return Err(Error::corrupt(None, "a pack file did not open"));
        };
        let path = self.path();
        #[cfg(test)]
        faults::strike(faults::Fault::Write, PackOp::Write, &path)?;
        file.write_at(piece, self.len)
            .map_err(|e| PackError::io(PackOp::Write, &path, e))?;
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

    /// Create the file (and the directory, if missing) and write its
    /// header. A file of this id is never overwritten unless its header
    /// says this store wrote it (a transaction of this store that never
    /// committed: ids at or above the next one are recorded nowhere);
    /// another store's file, or one without a header, makes the writer
    /// take the next id.
    fn create(&mut self) -> Result<()> {
        let (dir, io) = (&self.dir.path, &self.dir.io);
        if !io.is_dir(dir) {
            io.create_dir(dir)
                .map_err(|e| PackError::io(PackOp::CreateDirectory, dir, e))?;
            self.new_dir = true;
        }
        for _ in 0..MAX_ID_SKIPS {
            let path = self.dir.file(self.id);
            let file = match io.create_new(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if self
                        .dir
                        .header_of(&path)
                        .is_some_and(|h| h.owner == self.owner)
                    {
                        io.open_truncated(&path)
                            .map_err(|e| PackError::io(PackOp::Create, &path, e))?
                    } else {
                        self.id = self
                            .id
                            .checked_add(1)
                            .ok_or_else(|| Error::corrupt(None, "pack file ids are used up"))?;
                        continue;
                    }
                }
                Err(e) => return Err(PackError::io(PackOp::Create, &path, e).into()),
            };
            let header = PackHeader {
                pack: self.id,
                owner: self.owner,
            };
            // Kept even if this fails: its drop deletes the file.
            self.file = Some(file);
            if let Some(file) = &self.file {
                file.write_at(&header.encode(), 0)
                    .map_err(|e| PackError::io(PackOp::Write, &path, e))?;
            }
            self.len = PACK_HEADER_BYTES as u64;
            return Ok(());
        }
        let e = std::io::Error::from(std::io::ErrorKind::AlreadyExists);
        Err(PackError::io(PackOp::CreateAmongOthers, dir, e).into())
    }

    /// Make what was written durable (file and directory entry): the last
    /// step before the transaction that records it commits.
    pub(crate) fn sync(&mut self) -> Result<()> {
        if let Some(file) = &self.file {
            #[cfg(test)]
            faults::strike(faults::Fault::Sync, PackOp::Sync, &self.path())?;
            file.sync_data()
                .map_err(|e| PackError::io(PackOp::Sync, self.path(), e))?;
            let (dir, io) = (&self.dir.path, &self.dir.io);
            #[cfg(test)]
            faults::strike(faults::Fault::SyncDir, PackOp::SyncDirectory, dir)?;
            io.sync_dir(dir)
                .map_err(|e| PackError::io(PackOp::SyncDirectory, dir, e))?;
            if self.new_dir {
                // The directory's own entry, beside the store.
                let parent = match dir.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p,
                    _ => Path::new("."),
                };
                io.sync_dir(parent)
                    .map_err(|e| PackError::io(PackOp::SyncDirectory, parent, e))?;
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
        if self.file.take().is_some() && !self.synced {
            let _ = self.dir.io.remove_file(&self.path());
        }
        if self.new_dir && !self.synced {
            // Only if empty: the directory this transaction made for it.
            let _ = self.dir.io.remove_dir(&self.dir.path);
        }
    }
}
