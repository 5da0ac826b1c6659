//! Content-addressed chunks in one write transaction: add, stage, release.
//!
//! A chunk's bytes are stored under an id given out in ascending order
//! (`chunk_data`); its BLAKE3 hash is indexed (`chunk_index`) with the id
//! and how many manifest entries use it. A chunk is deleted in the
//! transaction that drops its last use. A chunk with no use is *staged*: a
//! large commit writes its new chunks in transactions of their own first
//! (see `store/commit.rs`), and deletes them if it does not finish.
//! A transaction may put its new chunks' bytes in a pack file instead of
//! `chunk_data` ([`PackTables`]); the index is the same for both.

use redb::{ReadableTable, Table, WriteTransaction};

use super::packs::PackTables;

use crate::error::StorageContext;
use crate::format::layout::chunk_lengths;
use crate::format::manifest::{hex, ChunkRef, ChunkUse, Hash};
use crate::format::tables::{CHUNK_DATA, CHUNK_INDEX, LEGACY_CHUNKS, LEGACY_REFS};
use crate::Result;

/// What adding chunks to the store cost.
#[derive(Default)]
pub(crate) struct Added {
    pub(crate) bytes_written: u64,
    pub(crate) bytes_reused: u64,
    pub(crate) chunks_written: u64,
    pub(crate) chunks_reused: u64,
    /// Chunks written again because the pack file that held them was
    /// missing or not whole (counted among the written too).
    pub(crate) chunks_healed: u64,
    /// Their bytes.
    pub(crate) bytes_healed: u64,
    /// The stored chunk of each piece, in order.
    pub(crate) refs: Vec<ChunkRef>,
}

impl Added {
    /// Count one piece of `len` bytes, written now or reused.
    fn record(&mut self, len: u64, written: bool) {
        if written {
            self.bytes_written += len;
            self.chunks_written += 1;
        } else {
            self.bytes_reused += len;
            self.chunks_reused += 1;
        }
    }
}

/// Bytes and chunks a transaction freed.
#[derive(Clone, Copy, Default)]
pub(crate) struct Freed {
    pub(crate) bytes: u64,
    pub(crate) chunks: u64,
}

/// The chunk tables of one write transaction.
pub(crate) struct ChunkTables<'txn> {
    txn: &'txn WriteTransaction,
    data: Table<'txn, u64, &'static [u8]>,
    index: Table<'txn, &'static [u8; 32], (u64, u64)>,
    /// Format 1's tables, opened when a format 1 chunk is released.
    legacy: Option<LegacyTables<'txn>>,
    /// The next chunk id to give out.
    pub(crate) next_id: u64,
    /// Chunks in pack files, and the pack file this transaction writes.
    pub(crate) packs: PackTables<'txn>,
}

struct LegacyTables<'txn> {
    chunks: Table<'txn, &'static [u8; 32], &'static [u8]>,
    refs: Table<'txn, &'static [u8; 32], u64>,
}

impl<'txn> ChunkTables<'txn> {
    pub(crate) fn open(
        txn: &'txn WriteTransaction,
        next_id: u64,
        pack_dir: Option<super::packs::PackDir>,
        owner: crate::format::packs::OwnerTag,
    ) -> Result<Self> {
        let ctx = || "opening the chunk tables".to_owned();
        Ok(ChunkTables {
            data: txn.open_table(CHUNK_DATA).context(ctx)?,
            index: txn.open_table(CHUNK_INDEX).context(ctx)?,
            txn,
            legacy: None,
            next_id,
            packs: PackTables::new(txn, pack_dir, owner),
        })
    }

    /// Reference each piece: store the ones not yet stored, count one more
    /// use of each. `hashes` yields each piece's hash in order.
    pub(crate) fn add(
        &mut self,
        pieces: &[&[u8]],
        hashes: &mut dyn Iterator<Item = Hash>,
    ) -> Result<Added> {
        let mut added = Added {
            refs: Vec::with_capacity(pieces.len()),
            ..Added::default()
        };
        for piece in pieces {
            let hash = next_hash(hashes)?;
            let len = piece.len() as u64;
            let (id, written) = match self.lookup(&hash)? {
                Some((id, uses)) => {
                    let healed = self.heal(&hash, id, piece)?;
                    if healed && uses > 0 {
                        // Stored (and counted) before: written again only.
                        added.chunks_healed += 1;
                        added.bytes_healed += len;
                    }
                    self.set_index(&hash, id, uses + 1)?;
                    // Staged by this commit (no use yet): written now, in
                    // effect.
                    (id, uses == 0 || healed)
                }
                None => (self.insert_new(&hash, piece, 1)?, true),
            };
            added.record(len, written);
            added.refs.push(ChunkRef { hash, id });
        }
        Ok(added)
    }

    /// Reference the chunks of a blob staged earlier (`hashes`, for a blob
    /// of `len` bytes): one more use of each, counted into `added`.
    pub(crate) fn add_staged(
        &mut self,
        len: u64,
        hashes: &[Hash],
        added: &mut Added,
    ) -> Result<Vec<ChunkRef>> {
        let lens = usize::try_from(len)
            .map(chunk_lengths)
            .map_err(|_| crate::Error::corrupt(None, "a streamed blob is too long"))?;
        let mut refs = Vec::with_capacity(hashes.len());
        for (hash, piece_len) in hashes.iter().zip(lens) {
            let piece_len = piece_len as u64;
            let (id, uses) = self.lookup(hash)?.ok_or_else(|| {
                crate::Error::corrupt(None, format!("staged chunk {} is gone", hex(hash)))
            })?;
            self.set_index(hash, id, uses + 1)?;
            // A chunk with no use was staged by this commit: written now.
            added.record(piece_len, uses == 0);
            refs.push(ChunkRef { hash: *hash, id });
        }
        Ok(refs)
    }

    /// Write the chunks among `pieces` that are not stored yet (or whose
    /// pack file is lost: written again, see [`heal`](Self::heal)), with
    /// no use (staged), for a later transaction's [`add`](Self::add) to
    /// reference; push each piece's hash to `staged`. Returns the chunks
    /// healed.
    pub(crate) fn stage(
        &mut self,
        pieces: &[&[u8]],
        hashes: &mut dyn Iterator<Item = Hash>,
        staged: &mut Vec<Hash>,
    ) -> Result<u64> {
        let mut healed = 0;
        for piece in pieces {
            let hash = next_hash(hashes)?;
            match self.lookup(&hash)? {
                Some((id, _)) => healed += u64::from(self.heal(&hash, id, piece)?),
                None => {
                    self.insert_new(&hash, piece, 0)?;
                }
            }
            staged.push(hash);
        }
        Ok(healed)
    }

    /// Before chunk `hash` (stored as `id`) is referenced again: if the pack
    /// file holding it is missing or not whole, write `piece` (its bytes,
    /// from the caller) again under the same id, in this transaction's
    /// pack file or `chunk_data`, so that this commit, and every step
    /// that already uses the chunk, reads it from there. Returns whether
    /// it did.
    fn heal(&mut self, hash: &Hash, id: u64, piece: &[u8]) -> Result<bool> {
        if self.packs.holds(id)? {
            return Ok(false);
        }
        self.packs.remove(id)?;
        self.put_bytes(id, hash, piece)?;
        Ok(true)
    }

    /// Delete the chunks among `hashes` that are still staged (unused).
    pub(crate) fn unstage(&mut self, hashes: &[Hash]) -> Result<usize> {
        let mut deleted = 0;
        for hash in hashes {
            if let Some((id, 0)) = self.lookup(hash)? {
                self.delete(hash, id)?;
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    /// Every staged chunk's hash.
    pub(crate) fn staged(&self) -> Result<Vec<Hash>> {
        let ctx = || "reading table chunk_index".to_owned();
        let mut staged = Vec::new();
        for entry in self.index.range::<&[u8; 32]>(..).context(ctx)? {
            let (hash, value) = entry.context(ctx)?;
            if value.value().1 == 0 {
                staged.push(*hash.value());
            }
        }
        Ok(staged)
    }

    /// Drop one use of each chunk in `uses`, deleting chunks no manifest
    /// uses any more.
    pub(crate) fn release<'m>(
        &mut self,
        uses: impl Iterator<Item = ChunkUse<'m>>,
    ) -> Result<Freed> {
        let mut freed = Freed::default();
        for chunk in uses {
            let bytes = match chunk {
                ChunkUse::Current(c) => self.release_one(&c.hash)?,
                ChunkUse::Format1(hash) => self.release_legacy(hash)?,
            };
            if let Some(len) = bytes {
                freed.bytes += len;
                freed.chunks += 1;
            }
        }
        Ok(freed)
    }

    /// The id and uses of chunk `hash`, if it is stored.
    fn lookup(&self, hash: &Hash) -> Result<Option<(u64, u64)>> {
        Ok(self
            .index
            .get(hash)
            .context(|| format!("reading table chunk_index for chunk {}", hex(hash)))?
            .map(|g| g.value()))
    }

    /// Store `piece` as chunk `hash` under a new id, with `uses` uses.
    fn insert_new(&mut self, hash: &Hash, piece: &[u8], uses: u64) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        self.put_bytes(id, hash, piece)?;
        self.set_index(hash, id, uses)?;
        Ok(id)
    }

    /// Write `piece` (chunk `hash`) as chunk `id`: to this transaction's
    /// pack file if it packs, else to `chunk_data`.
    fn put_bytes(&mut self, id: u64, hash: &Hash, piece: &[u8]) -> Result<()> {
        if !self.packs.insert(id, hash, piece)? {
            self.data
                .insert(id, piece)
                .context(|| format!("writing table chunk_data for chunk {}", hex(hash)))?;
        }
        Ok(())
    }

    fn set_index(&mut self, hash: &Hash, id: u64, uses: u64) -> Result<()> {
        self.index
            .insert(hash, (id, uses))
            .context(|| format!("writing table chunk_index for chunk {}", hex(hash)))?;
        Ok(())
    }

    /// Drop one use of chunk `hash`; the bytes freed if that was the last.
    fn release_one(&mut self, hash: &Hash) -> Result<Option<u64>> {
        match self.lookup(hash)? {
            Some((id, uses)) if uses > 1 => {
                self.set_index(hash, id, uses - 1)?;
                Ok(None)
            }
            Some((id, _)) => self.delete(hash, id),
            None => Ok(None),
        }
    }

    /// Delete chunk `hash`, stored as `id`; the bytes freed.
    fn delete(&mut self, hash: &Hash, id: u64) -> Result<Option<u64>> {
        let ctx = |table: &str| format!("writing table {table} for chunk {}", hex(hash));
        self.index.remove(hash).context(|| ctx("chunk_index"))?;
        let old = self.data.remove(id).context(|| ctx("chunk_data"))?;
        match old {
            Some(v) => Ok(Some(v.value().len() as u64)),
            None => self.packs.remove(id),
        }
    }

    /// Drop one use of format 1 chunk `hash`.
    fn release_legacy(&mut self, hash: &Hash) -> Result<Option<u64>> {
        let ctx = |table: &str| format!("writing table {table} for chunk {}", hex(hash));
        let legacy = match &mut self.legacy {
            Some(l) => l,
            None => self.legacy.insert(LegacyTables {
                chunks: self
                    .txn
                    .open_table(LEGACY_CHUNKS)
                    .context(|| ctx("chunks"))?,
                refs: self.txn.open_table(LEGACY_REFS).context(|| ctx("refs"))?,
            }),
        };
        let uses = legacy
            .refs
            .get(hash)
            .context(|| ctx("refs"))?
            .map_or(0, |g| g.value());
        if uses > 1 {
            legacy.refs.insert(hash, uses - 1).context(|| ctx("refs"))?;
            return Ok(None);
        }
        legacy.refs.remove(hash).context(|| ctx("refs"))?;
        let old = legacy.chunks.remove(hash).context(|| ctx("chunks"))?;
        Ok(old.map(|v| v.value().len() as u64))
    }
}

/// The next hash from a chunk hasher.
fn next_hash(hashes: &mut dyn Iterator<Item = Hash>) -> Result<Hash> {
    hashes
        .next()
        .ok_or_else(|| crate::Error::corrupt(None, "chunk hasher stopped early"))
}
