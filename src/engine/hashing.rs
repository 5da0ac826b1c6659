//! Work on a step's chunks spread over threads: BLAKE3 hashes streamed in
//! order ahead of a commit's writes, and chunk-by-chunk reads into place.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::thread;

use crate::format::layout::{chunk_count, chunk_lengths, split, PACK_BELOW};
use crate::format::manifest::Hash;
use crate::{ChunkHashes, Error, Result};

/// Bytes read and hashed at a time by [`read_hashed`]: within a core's L2
/// cache, and a multiple of BLAKE3's 1 KiB chunks.
const READ_SLICE: usize = 256 << 10;

/// Fill `out` by `read(slice, offset of the slice in out)`, a slice at a
/// time, hashing each slice while it is still in the CPU's cache; returns
/// the BLAKE3 hash of what was read. On an error `out` is zeroed: bytes
/// that were not checked never stay.
pub(crate) fn read_hashed(
    out: &mut [u8],
    read: &mut dyn FnMut(&mut [u8], u64) -> std::io::Result<()>,
) -> std::io::Result<Hash> {
    let mut hasher = blake3::Hasher::new();
    let mut at = 0u64;
    let mut whole = Ok(());
    for slice in out.chunks_mut(READ_SLICE) {
        whole = read(slice, at);
        if whole.is_err() {
            break;
        }
        hasher.update(slice);
        at += slice.len() as u64;
    }
    if let Err(e) = whole {
        out.fill(0);
        return Err(e);
    }
    Ok(*hasher.finalize().as_bytes())
}

/// Below this many bytes, one thread beats starting others.
const PARALLEL_MIN_BYTES: usize = 4 << 20;

/// Hashes the hashing threads may run ahead of the writer, in all.
const PIPELINE_DEPTH: usize = 256;

/// Run `f` with an iterator over the hashes of `pieces`, in order.
pub(crate) fn with_hashes<T>(
    pieces: &[&[u8]],
    threads: usize,
    f: impl FnOnce(&mut dyn Iterator<Item = Hash>) -> T,
) -> T {
    with_known_hashes(pieces, &[], threads, f)
}

/// [`with_hashes`], where `known[i]`, when there is one, is the hash of
/// piece `i` already (taken as it was copied): it is not hashed again.
///
/// With `threads` above 1 and a large input, `threads - 1` other threads
/// hash ahead (piece `i` on thread `i % (threads - 1)`) while `f`
/// consumes on this one, so hashing overlaps the caller's writes and runs
/// on every core it is given; they stop when `f` returns.
pub(crate) fn with_known_hashes<T>(
    pieces: &[&[u8]],
    known: &[Option<Hash>],
    threads: usize,
    f: impl FnOnce(&mut dyn Iterator<Item = Hash>) -> T,
) -> T {
    let hash = |i: usize, piece: &[u8]| match known.get(i).copied().flatten() {
        Some(h) => h,
        None => *blake3::hash(piece).as_bytes(),
    };
    let unknown: usize = (0..pieces.len())
        .filter(|&i| known.get(i).copied().flatten().is_none())
        .map(|i| pieces[i].len())
        .sum();
    let hashers = threads.saturating_sub(1).min(pieces.len());
    if hashers == 0 || unknown < PARALLEL_MIN_BYTES || pieces.len() < 2 {
        return f(&mut pieces.iter().enumerate().map(|(i, p)| hash(i, p)));
    }
    thread::scope(|s| {
        let depth = (PIPELINE_DEPTH / hashers).max(2);
        let hash = &hash;
        let receivers: Vec<Receiver<Hash>> = (0..hashers)
            .map(|w| {
                let (tx, rx) = sync_channel::<Hash>(depth);
                s.spawn(move || {
                    for (i, piece) in pieces.iter().enumerate().skip(w).step_by(hashers) {
                        if tx.send(hash(i, piece)).is_err() {
                            break; // the consumer stopped early
                        }
                    }
                });
                rx
            })
            .collect();
        // Piece i's hash is the next on channel i % hashers; dropping the
        // receivers when `f` returns ends the hashers.
        let mut ordered = (0..pieces.len()).map_while(|i| receivers[i % hashers].recv().ok());
        f(&mut ordered)
    })
}

/// One piece of a [`ChunkHashes::copy_all`]: its source, its destination,
/// and where its hash goes (none for bytes that are packed).
type CopyJob<'a> = (&'a [u8], &'a mut [u8], Option<&'a mut Hash>);

impl ChunkHashes {
    /// Copy each `(source, destination)` pair (of equal lengths) on up to
    /// `threads` threads, hashing each chunk of each destination in the
    /// same pass, a cache-sized slice at a time right after it is copied:
    /// the hashes of the bytes as they now lie in the destinations.
    ///
    /// ```
    /// use ckptstore::ChunkHashes;
    /// let state = vec![7u8; 3 << 20];
    /// let mut staged = vec![0u8; state.len()];
    /// let hashes = ChunkHashes::copy_all(vec![(&state[..], &mut staged[..])], 2)?;
    /// assert!(staged == state);
    /// assert_eq!(hashes[0], ChunkHashes::of(&state));
    /// # Ok::<(), ckptstore::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidTensor`] when a pair's lengths differ (nothing is
    /// copied).
    pub fn copy_all(pairs: Vec<(&[u8], &mut [u8])>, threads: usize) -> Result<Vec<ChunkHashes>> {
        if let Some((s, d)) = pairs.iter().find(|(s, d)| s.len() != d.len()) {
            return Err(Error::InvalidTensor {
                name: None,
                reason: format!("a copy of {} bytes into {}", s.len(), d.len()),
            });
        }
        let mut out: Vec<ChunkHashes> = pairs
            .iter()
            .map(|(s, _)| ChunkHashes {
                len: s.len() as u64,
                hashes: vec![[0; 32]; hashed_chunks(s.len())],
            })
            .collect();
        let mut jobs: Vec<CopyJob<'_>> = Vec::new();
        for ((src, dst), hashes) in pairs.into_iter().zip(out.iter_mut()) {
            if hashes.hashes.is_empty() {
                jobs.push((src, dst, None));
                continue;
            }
            let (mut src, mut dst) = (src, dst);
            for (n, slot) in chunk_lengths(src.len()).zip(hashes.hashes.iter_mut()) {
                let (s, rest_s) = src.split_at(n);
                let (d, rest_d) = std::mem::take(&mut dst).split_at_mut(n);
                jobs.push((s, d, Some(slot)));
                (src, dst) = (rest_s, rest_d);
            }
        }
        let total: usize = jobs.iter().map(|(s, _, _)| s.len()).sum();
        let threads = if total < PARALLEL_MIN_BYTES {
            1
        } else {
            threads
        };
        run_parallel(jobs, threads, &|_, (src, dst, slot)| {
            copy_hashed(src, dst, slot);
            Ok(())
        })?;
        Ok(out)
    }

    /// The hashes of `data`'s chunks, on this thread.
    pub fn of(data: &[u8]) -> ChunkHashes {
        let hashes = if hashed_chunks(data.len()) == 0 {
            Vec::new()
        } else {
            split(data).map(|p| *blake3::hash(p).as_bytes()).collect()
        };
        ChunkHashes {
            len: data.len() as u64,
            hashes,
        }
    }

    /// Hashes of `len` bytes as [`to_bytes`](Self::to_bytes) gave them
    /// (sent to another process with the bytes they are of).
    ///
    /// # Errors
    /// [`Error::InvalidTensor`] when `bytes` is not one hash per chunk of
    /// `len` bytes.
    pub fn from_bytes(len: u64, bytes: &[u8]) -> Result<ChunkHashes> {
        let want = usize::try_from(len).map_or(usize::MAX, hashed_chunks);
        if bytes.len() != want.saturating_mul(32) {
            return Err(Error::InvalidTensor {
                name: None,
                reason: format!(
                    "{} bytes of chunk hashes for {len} bytes, which have {want}",
                    bytes.len()
                ),
            });
        }
        let hashes = bytes
            .chunks_exact(32)
            .map(|h| h.try_into().unwrap_or([0; 32]))
            .collect();
        Ok(ChunkHashes { len, hashes })
    }

    /// The hashes, 32 bytes each, in order.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.hashes.concat()
    }

    /// How many bytes were hashed.
    pub fn bytes(&self) -> u64 {
        self.len
    }
}

/// The chunk hashes of `len` bytes taken a piece at a time, in order, as
/// the pieces become ready (a copy from a device lands a piece after
/// another): each piece but the last a whole number of chunks, so that
/// the chunks are those of the whole.
///
/// ```
/// use ckptstore::{ChunkHasher, ChunkHashes};
/// let state = vec![7u8; 3 << 20];
/// let mut hasher = ChunkHasher::new(state.len() as u64);
/// let (first, rest) = state.split_at(ChunkHasher::PIECE_ALIGN);
/// hasher.update(first, 2)?;
/// hasher.update(rest, 2)?;
/// assert_eq!(hasher.finish()?, ChunkHashes::of(&state));
/// # Ok::<(), ckptstore::Error>(())
/// ```
#[derive(Debug)]
pub struct ChunkHasher {
    len: u64,
    at: u64,
    hashes: Vec<Hash>,
}

impl ChunkHasher {
    /// What the length of every piece but the last is a multiple of (the
    /// store's whole chunks).
    pub const PIECE_ALIGN: usize = crate::format::layout::CHUNK_SIZE;

    /// Hashes of `len` bytes, none taken yet.
    pub fn new(len: u64) -> ChunkHasher {
        ChunkHasher {
            len,
            at: 0,
            hashes: Vec::new(),
        }
    }

    /// Hash the next piece, on up to `threads` threads.
    ///
    /// # Errors
    /// [`Error::InvalidTensor`] when the piece runs past `len`, or is not
    /// the last and not whole chunks (nothing is hashed).
    pub fn update(&mut self, piece: &[u8], threads: usize) -> Result<()> {
        let end = self.at + piece.len() as u64;
        if end > self.len || (end < self.len && piece.len() % Self::PIECE_ALIGN != 0) {
            return Err(Error::InvalidTensor {
                name: None,
                reason: format!(
                    "a piece of {} bytes at {} of {} bytes hashed by chunks",
                    piece.len(),
                    self.at,
                    self.len
                ),
            });
        }
        let first = self.hashes.len();
        let chunks: Vec<&[u8]> = split(piece).collect();
        self.hashes.resize(first + chunks.len(), [0; 32]);
        let jobs: Vec<(&[u8], &mut Hash)> =
            chunks.into_iter().zip(&mut self.hashes[first..]).collect();
        let threads = if piece.len() < PARALLEL_MIN_BYTES {
            1
        } else {
            threads
        };
        run_parallel(jobs, threads, &|_, (chunk, slot)| {
            *slot = *blake3::hash(chunk).as_bytes();
            Ok(())
        })?;
        self.at = end;
        Ok(())
    }

    /// The hashes of the whole (none for bytes that are packed).
    ///
    /// # Errors
    /// [`Error::InvalidTensor`] when pieces of fewer than `len` bytes were
    /// hashed.
    pub fn finish(self) -> Result<ChunkHashes> {
        if self.at != self.len {
            return Err(Error::InvalidTensor {
                name: None,
                reason: format!("{} bytes of {} hashed by chunks", self.at, self.len),
            });
        }
        let hashes = if hashed_chunks(usize::try_from(self.len).unwrap_or(usize::MAX)) == 0 {
            Vec::new()
        } else {
            self.hashes
        };
        Ok(ChunkHashes {
            len: self.len,
            hashes,
        })
    }
}

/// How many chunk hashes bytes of `len` have: none when they are packed.
fn hashed_chunks(len: usize) -> usize {
    if len < PACK_BELOW {
        0
    } else {
        chunk_count(len)
    }
}

/// Copy `src` into `dst` a slice at a time, hashing each slice of `dst`
/// while it is in the cache, into `slot` when there is one.
fn copy_hashed(src: &[u8], dst: &mut [u8], slot: Option<&mut Hash>) {
    let Some(slot) = slot else {
        dst.copy_from_slice(src);
        return;
    };
    let mut hasher = blake3::Hasher::new();
    for (s, d) in src.chunks(READ_SLICE).zip(dst.chunks_mut(READ_SLICE)) {
        d.copy_from_slice(s);
        hasher.update(d);
    }
    *slot = *hasher.finalize().as_bytes();
}

/// Run `each(i, piece)` for every `(i, piece)` of `pieces` (a partition of
/// one destination buffer), on up to `threads` threads (piece `i` on
/// thread `i % threads`, this one among them). Stops at the first error,
/// and returns the error of the lowest-numbered piece that failed, so
/// that the outcome does not depend on timing.
pub(crate) fn fill_parallel(
    pieces: Vec<&mut [u8]>,
    threads: usize,
    each: &(dyn Fn(usize, &mut [u8]) -> Result<()> + Sync),
) -> Result<()> {
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    let threads = if total < PARALLEL_MIN_BYTES {
        1
    } else {
        threads
    };
    run_parallel(pieces, threads, each)
}

/// Run `each(i, job)` for every job of `jobs` on up to `threads` threads
/// (job `i` on thread `i % threads`, this one among them), as
/// [`fill_parallel`] does for the pieces of one buffer: the error of the
/// lowest-numbered job that failed, whatever the timing.
pub(crate) fn run_parallel<T: Send>(
    jobs: Vec<T>,
    threads: usize,
    each: &(dyn Fn(usize, T) -> Result<()> + Sync),
) -> Result<()> {
    let threads = threads.clamp(1, jobs.len().max(1));
    if threads == 1 {
        return jobs
            .into_iter()
            .enumerate()
            .try_for_each(|(i, p)| each(i, p));
    }
    let mut lanes: Vec<Vec<(usize, T)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, job) in jobs.into_iter().enumerate() {
        lanes[i % threads].push((i, job));
    }
    // The lowest job that failed so far: lanes skip the jobs above it, but
    // every job below it still runs, so the lowest failure is always found.
    let first_failed = AtomicUsize::new(usize::MAX);
    let run = |lane: Vec<(usize, T)>| -> Option<(usize, crate::Error)> {
        for (i, job) in lane {
            if i > first_failed.load(Ordering::Relaxed) {
                return None;
            }
            if let Err(e) = each(i, job) {
                first_failed.fetch_min(i, Ordering::Relaxed);
                return Some((i, e));
            }
        }
        None
    };
    let mut lanes = lanes.into_iter();
    let mine = lanes.next().unwrap_or_default();
    let mut errors: Vec<(usize, crate::Error)> = thread::scope(|s| {
        let others: Vec<_> = lanes.map(|lane| s.spawn(|| run(lane))).collect();
        let mut errors: Vec<_> = run(mine).into_iter().collect();
        for handle in others {
            // A panic in `each` is re-raised here, where the caller's
            // panic boundary turns it into an error.
            match handle.join() {
                Ok(e) => errors.extend(e),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        errors
    });
    errors.sort_by_key(|(i, _)| *i);
    match errors.into_iter().next() {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_taken_a_piece_at_a_time_are_those_of_the_whole() -> Result<()> {
        let align = ChunkHasher::PIECE_ALIGN;
        for len in [0, 100, PACK_BELOW, 3 * align, 5 * align + 70_000] {
            let bytes = data(len);
            for per in [1, 2, 3] {
                let mut hasher = ChunkHasher::new(len as u64);
                for piece in bytes.chunks(per * align) {
                    hasher.update(piece, 2)?;
                }
                assert_eq!(hasher.finish()?, ChunkHashes::of(&bytes), "{len} {per}");
            }
        }
        Ok(())
    }

    #[test]
    fn a_piece_off_the_chunks_or_too_few_bytes_is_refused() -> Result<()> {
        let align = ChunkHasher::PIECE_ALIGN;
        let bytes = data(3 * align);
        let mut hasher = ChunkHasher::new(bytes.len() as u64);
        assert!(hasher.update(&bytes[..=align], 1).is_err());
        hasher.update(&bytes[..align], 1)?;
        assert!(hasher.update(&bytes[..3 * align], 1).is_err()); // past the end
        assert!(ChunkHasher::new(10).finish().is_err());
        assert!(hasher.finish().is_err());
        Ok(())
    }

    fn data(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| {
                u32::try_from(i)
                    .unwrap_or(0)
                    .wrapping_mul(2_654_435_761)
                    .to_le_bytes()[3]
            })
            .collect()
    }

    #[test]
    fn streamed_hashes_equal_direct_hashes_on_any_thread_count() {
        let data = data(9 << 20);
        let pieces: Vec<&[u8]> = split(&data).collect();
        let direct: Vec<Hash> = pieces.iter().map(|p| *blake3::hash(p).as_bytes()).collect();
        for threads in [1, 2, 3, 8, 64] {
            let streamed = with_hashes(&pieces, threads, |ids| ids.collect::<Vec<_>>());
            assert_eq!(direct, streamed, "{threads} threads");
            // A consumer that stops early does not hang the hashers.
            let first = with_hashes(&pieces, threads, |ids| ids.next());
            assert_eq!(first, direct.first().copied());
        }
    }

    #[test]
    fn fill_parallel_fills_every_piece_and_reports_the_first_failure() {
        let source = data(9 << 20);
        for threads in [1, 2, 3, 16] {
            let mut out = vec![0u8; source.len()];
            let pieces: Vec<&mut [u8]> = out.chunks_mut(1 << 20).collect();
            let copy = |i: usize, piece: &mut [u8]| {
                let from = &source[i << 20..];
                piece.copy_from_slice(&from[..piece.len()]);
                Ok(())
            };
            fill_parallel(pieces, threads, &copy).expect("fill");
            assert!(out == source, "{threads} threads");

            let pieces: Vec<&mut [u8]> = out.chunks_mut(1 << 20).collect();
            let fail = |i: usize, _: &mut [u8]| {
                if i == 3 || i == 7 {
                    Err(Error::corrupt(Some(1), format!("piece {i}")))
                } else {
                    Ok(())
                }
            };
            let err = fill_parallel(pieces, threads, &fail).expect_err("fails");
            assert!(err.to_string().contains("piece 3"), "{threads}: {err}");
        }
    }
}
