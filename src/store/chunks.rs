//! Content-addressed chunks: splitting, hashing, and reference counting.
//!
//! Blobs are cut into chunks of [`CHUNK_SIZE`] bytes (the last one shorter),
//! each stored once under its BLAKE3 hash. `refs` counts how many manifest
//! entries use a chunk; a chunk is deleted in the transaction that drops its
//! last reference.

use std::thread;

use redb::{ReadableTable, Table};

use super::schema::{ChunkId, Manifest};
use crate::error::StorageContext;
use crate::Result;

/// Chunk size: just under 1 MiB, so a chunk with its key and the leaf page
/// header fits a 1 MiB run of pages (redb allocates power-of-two runs; a
/// value of exactly 1 MiB would take 2 MiB).
pub(crate) const CHUNK_SIZE: usize = (1 << 20) - 4096;

/// Below this many bytes, hashing on one thread beats starting others.
const PARALLEL_MIN_BYTES: usize = 4 << 20;

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

/// The `chunks` and `refs` tables of one write transaction.
pub(crate) struct ChunkTables<'txn> {
    pub(crate) chunks: Table<'txn, &'static [u8; 32], &'static [u8]>,
    pub(crate) refs: Table<'txn, &'static [u8; 32], u64>,
}

impl ChunkTables<'_> {
    /// Reference each piece: store the ones not yet stored, count one more
    /// use of each.
    pub(crate) fn add(&mut self, pieces: &[&[u8]], ids: &[ChunkId]) -> Result<Added> {
        let mut added = Added::default();
        for (piece, id) in pieces.iter().zip(ids) {
            let count = self
                .refs
                .get(id)
                .context(|| format!("reading table refs for chunk {}", hex(id)))?
                .map(|g| g.value());
            let len = piece.len() as u64;
            match count {
                Some(n) => {
                    added.bytes_reused += len;
                    added.chunks_reused += 1;
                    self.set_refs(id, n + 1)?;
                }
                None => {
                    added.bytes_written += len;
                    added.chunks_written += 1;
                    self.chunks
                        .insert(id, *piece)
                        .context(|| format!("writing table chunks for chunk {}", hex(id)))?;
                    self.set_refs(id, 1)?;
                }
            }
        }
        Ok(added)
    }

    /// Drop one use of every chunk `manifest` references, deleting chunks
    /// that no manifest uses any more. Returns the bytes freed.
    pub(crate) fn release(&mut self, manifest: &Manifest) -> Result<u64> {
        let mut freed = 0;
        for id in manifest.chunk_refs() {
            let count = self
                .refs
                .get(id)
                .context(|| format!("reading table refs for chunk {}", hex(id)))?
                .map(|g| g.value())
                .unwrap_or(0);
            if count > 1 {
                self.set_refs(id, count - 1)?;
            } else {
                self.refs
                    .remove(id)
                    .context(|| format!("writing table refs for chunk {}", hex(id)))?;
                if let Some(old) = self
                    .chunks
                    .remove(id)
                    .context(|| format!("writing table chunks for chunk {}", hex(id)))?
                {
                    freed += old.value().len() as u64;
                }
            }
        }
        Ok(freed)
    }

    fn set_refs(&mut self, id: &ChunkId, n: u64) -> Result<()> {
        self.refs
            .insert(id, n)
            .context(|| format!("writing table refs for chunk {}", hex(id)))?;
        Ok(())
    }
}
