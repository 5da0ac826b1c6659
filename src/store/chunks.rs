//! Content-addressed chunks: splitting, hashing, and reference counting.
//!
//! Blobs are cut into chunks of [`CHUNK_SIZE`] bytes and a tail of smaller
//! power-of-two-sized pieces ([`chunk_lengths`]), each stored once: its bytes
//! under an id given out in ascending order (`chunk_data`), its BLAKE3 hash
//! in the index (`chunk_index`) with the id and how many manifest entries
//! use it. A chunk is deleted in the transaction that drops its last use.

use std::thread;

use redb::{ReadableTable, Table, WriteTransaction};

use super::manifest::Manifest;
use super::schema::{
    meta_u64, ChunkId, CHUNK_DATA, CHUNK_INDEX, LEGACY_CHUNKS, LEGACY_REFS, META, META_NEXT_CHUNK,
    META_STAGING,
};
use crate::error::StorageContext;
use crate::Result;

/// Bytes redb adds to a value in a leaf page of its own (key, header,
/// offsets); measured at <= 64 with 32-byte keys, doubled for margin.
const LEAF_OVERHEAD: usize = 128;

/// log2 of the run of pages a full chunk fills (1 MiB; 4 MiB measured no
/// faster here).
const CHUNK_BITS: u32 = 20;

/// Largest chunk: just under 1 MiB, so a chunk with its key and leaf header
/// fits a 1 MiB run of pages. redb allocates power-of-two runs, so a value of
/// exactly 1 MiB would take 2 MiB.
pub(crate) const CHUNK_SIZE: usize = (1 << CHUNK_BITS) - LEAF_OVERHEAD;

/// Below this many bytes, hashing on one thread beats starting others.
const PARALLEL_MIN_BYTES: usize = 4 << 20;

/// Smallest power of two a tail is split down to; below it, values share
/// leaf pages with others.
const MIN_SPLIT_BITS: u32 = 12;

/// The lengths of the chunks a blob of `len` bytes is cut into: full chunks,
/// then the tail as pieces of `2^k - LEAF_OVERHEAD` bytes, largest first, so
/// that no piece wastes most of its power-of-two allocation, and a last piece
/// under 4 KiB. A pure function of `len`: reads use it to check the layout.
pub(crate) fn chunk_lengths(len: usize) -> impl Iterator<Item = usize> {
    let full = len / CHUNK_SIZE;
    let mut rem = len % CHUNK_SIZE;
    let mut tail = Vec::new();
    for bits in (MIN_SPLIT_BITS..CHUNK_BITS).rev() {
        let piece = (1usize << bits) - LEAF_OVERHEAD;
        while rem >= piece {
            tail.push(piece);
            rem -= piece;
        }
    }
    if rem > 0 {
        tail.push(rem);
    }
    std::iter::repeat_n(CHUNK_SIZE, full).chain(tail)
}

/// Cut `blob` into chunks as [`chunk_lengths`] says.
pub(crate) fn split(blob: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut at = 0;
    chunk_lengths(blob.len()).map(move |n| {
        let piece = &blob[at..at + n];
        at += n;
        piece
    })
}

/// How a commit hashes its chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hashing {
    /// On a second thread, ahead of the writes, for large inputs: the
    /// fastest commit.
    Pipelined,
    /// Each chunk just before it is written, on the committing thread: a
    /// background commit then uses one core, leaving the other to training.
    Inline,
}

/// Run `f` with an iterator over the hashes of `pieces`, in order. With
/// [`Hashing::Pipelined`] and a large input, a second thread hashes ahead
/// while `f` consumes, so hashing overlaps the caller's writes; it stops
/// when `f` returns.
pub(crate) fn with_hashes<T>(
    pieces: &[&[u8]],
    hashing: Hashing,
    f: impl FnOnce(&mut dyn Iterator<Item = ChunkId>) -> T,
) -> T {
    if hashing == Hashing::Inline {
        return f(&mut pieces.iter().map(|p| *blake3::hash(p).as_bytes()));
    }
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    if total < PARALLEL_MIN_BYTES || pieces.len() < 2 {
        return f(&mut hash_all(pieces).into_iter());
    }
    thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<ChunkId>(256);
        s.spawn(move || {
            for piece in pieces {
                if tx.send(*blake3::hash(piece).as_bytes()).is_err() {
                    break; // the consumer stopped early
                }
            }
        });
        let mut ids = rx.into_iter();
        f(&mut ids)
    })
}

/// BLAKE3 hashes of `pieces`, in order, on every core when there is enough
/// to hash.
pub(crate) fn hash_all(pieces: &[&[u8]]) -> Vec<ChunkId> {
    let mut out = vec![[0u8; 32]; pieces.len()];
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    let threads = if total < PARALLEL_MIN_BYTES {
        1
    } else {
        thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(pieces.len())
    };
    if threads <= 1 {
        hash_into(pieces, &mut out);
    } else {
        let per = pieces.len().div_ceil(threads);
        thread::scope(|s| {
            for (ins, outs) in pieces.chunks(per).zip(out.chunks_mut(per)) {
                s.spawn(move || hash_into(ins, outs));
            }
        });
    }
    out
}

fn hash_into(pieces: &[&[u8]], out: &mut [ChunkId]) {
    for (piece, slot) in pieces.iter().zip(out) {
        *slot = *blake3::hash(piece).as_bytes();
    }
}

/// Lowercase hex of a chunk id, for messages.
pub(crate) fn hex(id: &ChunkId) -> String {
    blake3::Hash::from_bytes(*id).to_hex().to_string()
}

/// What adding chunks to the store cost.
#[derive(Default)]
pub(crate) struct Added {
    pub(crate) bytes_written: u64,
    pub(crate) bytes_reused: u64,
    pub(crate) chunks_written: u64,
    pub(crate) chunks_reused: u64,
}

/// The chunk tables of one write transaction.
pub(crate) struct ChunkTables<'txn> {
    /// What the transaction is doing, for error messages ("committing step 3").
    op: String,
    txn: &'txn WriteTransaction,
    data: Table<'txn, u64, &'static [u8]>,
    index: Table<'txn, &'static [u8; 32], (u64, u64)>,
    /// Format 1's tables, opened when a format 1 blob is released.
    legacy: Option<LegacyTables<'txn>>,
    /// The next chunk id to give out, and whether `meta` must learn it.
    next_id: u64,
    next_id_moved: bool,
}

struct LegacyTables<'txn> {
    chunks: Table<'txn, &'static [u8; 32], &'static [u8]>,
    refs: Table<'txn, &'static [u8; 32], u64>,
}

impl<'txn> ChunkTables<'txn> {
    /// Open the chunk tables of `txn`, which is doing `op`.
    pub(crate) fn open(txn: &'txn WriteTransaction, op: String) -> Result<Self> {
        let next_id = {
            let meta = txn.open_table(META).context(|| op.clone())?;
            meta_u64(&meta, META_NEXT_CHUNK)?
        };
        Ok(ChunkTables {
            data: txn.open_table(CHUNK_DATA).context(|| op.clone())?,
            index: txn.open_table(CHUNK_INDEX).context(|| op.clone())?,
            op,
            txn,
            legacy: None,
            next_id,
            next_id_moved: false,
        })
    }

    /// Reference each piece: store the ones not yet stored, count one more
    /// use of each. `hashes` yields each piece's hash in order. Returns
    /// what it cost and each piece's hash and id.
    pub(crate) fn add(
        &mut self,
        pieces: &[&[u8]],
        hashes: &mut dyn Iterator<Item = ChunkId>,
    ) -> Result<(Added, Vec<ChunkId>, Vec<u64>)> {
        let mut added = Added::default();
        let mut all = Vec::with_capacity(pieces.len());
        let mut ids = Vec::with_capacity(pieces.len());
        for piece in pieces {
            let hash = next_hash(hashes)?;
            let len = piece.len() as u64;
            let id = match self.lookup(&hash)? {
                // Staged by this commit (see `stage`): written now in effect.
                Some((id, 0)) => {
                    added.bytes_written += len;
                    added.chunks_written += 1;
                    self.set_index(&hash, id, 1)?;
                    id
                }
                Some((id, uses)) => {
                    added.bytes_reused += len;
                    added.chunks_reused += 1;
                    self.set_index(&hash, id, uses + 1)?;
                    id
                }
                None => {
                    added.bytes_written += len;
                    added.chunks_written += 1;
                    self.insert_new(&hash, piece, 1)?
                }
            };
            all.push(hash);
            ids.push(id);
        }
        self.save_next_id()?;
        Ok((added, all, ids))
    }

    /// Write the chunks among `pieces` that are not stored yet, unused
    /// (`uses` 0: staged), for a later transaction's [`add`](Self::add) to
    /// reference; push each piece's hash to `all`.
    ///
    /// A staged chunk belongs to no step: readers never reach it, and if the
    /// commit that staged it does not finish, it is deleted by
    /// [`unstage`](Self::unstage) or, after a crash, when the store is next
    /// opened for writing ([`sweep_staged`]).
    pub(crate) fn stage(
        &mut self,
        pieces: &[&[u8]],
        hashes: &mut dyn Iterator<Item = ChunkId>,
        all: &mut Vec<ChunkId>,
    ) -> Result<()> {
        for piece in pieces {
            let hash = next_hash(hashes)?;
            if self.lookup(&hash)?.is_none() {
                self.insert_new(&hash, piece, 0)?;
            }
            all.push(hash);
        }
        self.save_next_id()
    }

    /// Delete the chunks among `hashes` that are still staged (unused).
    pub(crate) fn unstage(&mut self, hashes: &[ChunkId]) -> Result<()> {
        for hash in hashes {
            if let Some((id, 0)) = self.lookup(hash)? {
                self.delete(hash, id)?;
            }
        }
        Ok(())
    }

    /// The id and uses of chunk `hash`, if it is stored.
    fn lookup(&self, hash: &ChunkId) -> Result<Option<(u64, u64)>> {
        let op = &self.op;
        Ok(self
            .index
            .get(hash)
            .context(|| format!("{op}: reading table chunk_index for chunk {}", hex(hash)))?
            .map(|g| g.value()))
    }

    /// Store `piece` as chunk `hash` under a new id, with `uses` uses.
    fn insert_new(&mut self, hash: &ChunkId, piece: &[u8], uses: u64) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        self.next_id_moved = true;
        let op = &self.op;
        self.data
            .insert(id, piece)
            .context(|| format!("{op}: writing table chunk_data for chunk {}", hex(hash)))?;
        self.set_index(hash, id, uses)?;
        Ok(id)
    }

    fn save_next_id(&mut self) -> Result<()> {
        if self.next_id_moved {
            let op = &self.op;
            self.txn
                .open_table(META)
                .context(|| op.clone())?
                .insert(META_NEXT_CHUNK, self.next_id.to_le_bytes().as_slice())
                .context(|| format!("{op}: writing table meta"))?;
            self.next_id_moved = false;
        }
        Ok(())
    }

    /// Drop one use of every chunk `manifest` references, deleting chunks
    /// that no manifest uses any more. Returns the bytes and chunks freed.
    pub(crate) fn release(&mut self, manifest: &Manifest) -> Result<(u64, u64)> {
        let (mut bytes, mut chunks) = (0, 0);
        for (hash, id) in manifest.chunk_refs() {
            let freed = match id {
                Some(_) => self.release_one(hash)?,
                None => self.release_legacy(hash)?,
            };
            if let Some(len) = freed {
                bytes += len;
                chunks += 1;
            }
        }
        Ok((bytes, chunks))
    }

    /// Drop one use of chunk `hash`; the bytes freed if that was the last.
    fn release_one(&mut self, hash: &ChunkId) -> Result<Option<u64>> {
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
    fn delete(&mut self, hash: &ChunkId, id: u64) -> Result<Option<u64>> {
        let op = &self.op;
        let ctx = |table: &str| format!("{op}: writing table {table} for chunk {}", hex(hash));
        self.index.remove(hash).context(|| ctx("chunk_index"))?;
        let old = self.data.remove(id).context(|| ctx("chunk_data"))?;
        Ok(old.map(|v| v.value().len() as u64))
    }

    /// Drop one use of format 1 chunk `hash`.
    fn release_legacy(&mut self, hash: &ChunkId) -> Result<Option<u64>> {
        let op = &self.op;
        let ctx = |table: &str| format!("{op}: writing table {table} for chunk {}", hex(hash));
        let legacy = match &mut self.legacy {
            Some(l) => l,
            None => self.legacy.insert(LegacyTables {
                chunks: self.txn.open_table(LEGACY_CHUNKS).context(|| op.clone())?,
                refs: self.txn.open_table(LEGACY_REFS).context(|| op.clone())?,
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

    fn set_index(&mut self, hash: &ChunkId, id: u64, uses: u64) -> Result<()> {
        let op = &self.op;
        self.index
            .insert(hash, (id, uses))
            .context(|| format!("{op}: writing table chunk_index for chunk {}", hex(hash)))?;
        Ok(())
    }
}

/// The next hash from a chunk hasher.
fn next_hash(hashes: &mut dyn Iterator<Item = ChunkId>) -> Result<ChunkId> {
    hashes
        .next()
        .ok_or_else(|| crate::Error::corrupt(None, "chunk hasher stopped early"))
}

/// Delete the chunks a commit staged and did not finish (a crash, or an
/// error whose clean-up failed), if the store says a staging was under
/// way. Returns how many were deleted.
pub(crate) fn sweep_staged(txn: &WriteTransaction, op: String) -> Result<usize> {
    {
        let meta = txn.open_table(META).context(|| op.clone())?;
        if meta.get(META_STAGING).context(|| op.clone())?.is_none() {
            return Ok(0);
        }
    }
    let staged: Vec<ChunkId> = {
        let index = txn.open_table(CHUNK_INDEX).context(|| op.clone())?;
        let mut staged = Vec::new();
        for entry in index.range::<&[u8; 32]>(..).context(|| op.clone())? {
            let (hash, value) = entry.context(|| op.clone())?;
            if value.value().1 == 0 {
                staged.push(*hash.value());
            }
        }
        staged
    };
    ChunkTables::open(txn, op.clone())?.unstage(&staged)?;
    txn.open_table(META)
        .context(|| op.clone())?
        .remove(META_STAGING)
        .context(|| op.clone())?;
    Ok(staged.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_lengths_cover_the_blob_and_fit_their_allocations() {
        for len in [
            0,
            1,
            3967,
            3968,
            4096,
            65_536,
            838_861,
            CHUNK_SIZE - 1,
            CHUNK_SIZE,
            CHUNK_SIZE + 1,
            5 * CHUNK_SIZE + 777_777,
        ] {
            let lens: Vec<usize> = chunk_lengths(len).collect();
            assert_eq!(lens.iter().sum::<usize>(), len, "len {len}");
            assert!(lens.iter().all(|&n| n > 0 && n <= CHUNK_SIZE), "len {len}");
            // Every piece but a final small one is 2^k - LEAF_OVERHEAD, and
            // lengths never grow after the first.
            for (i, &n) in lens.iter().enumerate() {
                let last = i + 1 == lens.len();
                assert!(
                    (n + LEAF_OVERHEAD).is_power_of_two() || (last && n < 4096),
                    "len {len}: piece {n}"
                );
            }
            assert!(lens.windows(2).all(|w| w[0] >= w[1]), "len {len}");
            assert!(lens.len() <= len / CHUNK_SIZE + 16, "len {len}: {lens:?}");
            let blob = vec![0u8; len];
            assert_eq!(split(&blob).map(<[u8]>::len).collect::<Vec<_>>(), lens);
        }
    }

    #[test]
    fn pipelined_hashes_equal_direct_hashes() {
        let data: Vec<u8> = (0..(9 << 20))
            .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        let pieces: Vec<&[u8]> = split(&data).collect();
        let direct = hash_all(&pieces);
        for hashing in [Hashing::Pipelined, Hashing::Inline] {
            let streamed = with_hashes(&pieces, hashing, |ids| ids.collect::<Vec<_>>());
            assert_eq!(direct, streamed, "{hashing:?}");
        }
        // A consumer that stops early does not hang the hasher.
        let first = with_hashes(&pieces, Hashing::Pipelined, |ids| ids.next());
        assert_eq!(first, direct.first().copied());
    }
}
