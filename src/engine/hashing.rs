//! BLAKE3 hashing of a commit's chunks, overlapped with its writes.

use std::thread;

use crate::format::manifest::Hash;

/// Below this many bytes, hashing on one thread beats starting others.
const PARALLEL_MIN_BYTES: usize = 4 << 20;

/// Hashes a second thread may run ahead of the writer.
const PIPELINE_DEPTH: usize = 256;

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
    f: impl FnOnce(&mut dyn Iterator<Item = Hash>) -> T,
) -> T {
    if hashing == Hashing::Inline {
        return f(&mut pieces.iter().map(|p| *blake3::hash(p).as_bytes()));
    }
    let total: usize = pieces.iter().map(|p| p.len()).sum();
    if total < PARALLEL_MIN_BYTES || pieces.len() < 2 {
        return f(&mut pieces.iter().map(|p| *blake3::hash(p).as_bytes()));
    }
    thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Hash>(PIPELINE_DEPTH);
        s.spawn(move || {
            for piece in pieces {
                if tx.send(*blake3::hash(piece).as_bytes()).is_err() {
                    break; // the consumer stopped early
                }
            }
        });
        f(&mut rx.into_iter())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::layout::split;

    #[test]
    fn pipelined_hashes_equal_direct_hashes() {
        let data: Vec<u8> = (0..(9 << 20))
            .map(|i: u32| i.wrapping_mul(2_654_435_761).to_le_bytes()[3])
            .collect();
        let pieces: Vec<&[u8]> = split(&data).collect();
        let direct: Vec<Hash> = pieces.iter().map(|p| *blake3::hash(p).as_bytes()).collect();
        for hashing in [Hashing::Pipelined, Hashing::Inline] {
            let streamed = with_hashes(&pieces, hashing, |ids| ids.collect::<Vec<_>>());
            assert_eq!(direct, streamed, "{hashing:?}");
        }
        // A consumer that stops early does not hang the hasher.
        let first = with_hashes(&pieces, Hashing::Pipelined, |ids| ids.next());
        assert_eq!(first, direct.first().copied());
    }
}
