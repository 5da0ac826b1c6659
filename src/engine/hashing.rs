//! Work on a step's chunks spread over threads: BLAKE3 hashes streamed in
//! order ahead of a commit's writes, and chunk-by-chunk reads into place.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::thread;

use crate::format::manifest::Hash;
use crate::Result;

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
///
/// With `threads` above 1 and a large input, `threads - 1` other threads
/// hash ahead (piece `i` on thread `i % (threads - 1)`) while `f`
/// consumes on this one, so hashing overlaps the caller's writes and runs
/// on every core it is given; they stop when `f` returns.
pub(crate) fn with_hashes<T>(
    pieces: &[&[u8]],
    threads: usize,
    f: impl FnOnce(&mut dyn Iterator<Item = Hash>) -> T,
) -> T {
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    let hashers = threads.saturating_sub(1).min(pieces.len());
    if hashers == 0 || total < PARALLEL_MIN_BYTES || pieces.len() < 2 {
        return f(&mut pieces.iter().map(|p| *blake3::hash(p).as_bytes()));
    }
    thread::scope(|s| {
        let depth = (PIPELINE_DEPTH / hashers).max(2);
        let receivers: Vec<Receiver<Hash>> = (0..hashers)
            .map(|w| {
                let (tx, rx) = sync_channel::<Hash>(depth);
                s.spawn(move || {
                    for piece in pieces.iter().skip(w).step_by(hashers) {
                        if tx.send(*blake3::hash(piece).as_bytes()).is_err() {
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
    use crate::format::layout::split;
    use crate::Error;

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
