//! How blob bytes are cut into the values redb stores.
//!
//! Blobs of [`PACK_BELOW`] bytes or more are cut into chunks of
//! [`CHUNK_SIZE`] bytes and a tail of smaller pieces ([`chunk_lengths`]),
//! each stored once by content. Smaller blobs are concatenated per step
//! ("packed") and stored under the step, cut the same way.

/// Bytes redb adds to a value in a leaf page of its own (key, header,
/// offsets); measured at <= 64 with 32-byte keys, doubled for margin.
pub(crate) const LEAF_OVERHEAD: usize = 128;

/// log2 of the run of pages a full chunk fills (1 MiB).
const CHUNK_BITS: u32 = 20;

/// Largest chunk: just under 1 MiB, so a chunk with its key and leaf header
/// fits a 1 MiB run of pages. redb allocates power-of-two runs, so a value of
/// exactly 1 MiB would take 2 MiB.
pub(crate) const CHUNK_SIZE: usize = (1 << CHUNK_BITS) - LEAF_OVERHEAD;

/// Smallest power of two a tail is split down to; below it, values share
/// leaf pages with others.
const MIN_SPLIT_BITS: u32 = 12;

/// Blobs below this size are packed per step instead of chunked: one
/// sequential write instead of a content-addressed insert per small blob.
pub(crate) const PACK_BELOW: usize = 64 << 10;

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

/// How many chunks [`chunk_lengths`] cuts a blob of `len` bytes into,
/// without walking them (a bucket's manifest may claim any length).
pub(crate) fn chunk_count(len: usize) -> usize {
    let rem = len % CHUNK_SIZE;
    len / CHUNK_SIZE + chunk_lengths(rem).count()
}

/// The small end of a blob of `len` bytes cut as [`chunk_lengths`] says:
/// how many of its last pieces are under [`PACK_BELOW`] bytes, and their
/// bytes. A bucket's shard packs them with the small blobs instead of
/// storing each as an object (most tensors of a power-of-two size end in
/// one such piece of a few hundred bytes).
#[cfg_attr(not(feature = "remote"), allow(dead_code))]
pub(crate) fn small_tail(len: usize) -> (usize, usize) {
    chunk_lengths(len % CHUNK_SIZE)
        .filter(|&n| n < PACK_BELOW)
        .fold((0, 0), |(count, bytes), n| (count + 1, bytes + n))
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

/// The `len` bytes at `offset` of a step's packed small blobs, if they lie
/// inside them.
pub(crate) fn packed_slice(packed: &[u8], offset: u64, len: u64) -> Option<&[u8]> {
    let from = usize::try_from(offset).ok()?;
    let to = usize::try_from(offset.checked_add(len)?).ok()?;
    packed.get(from..to)
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
            1 << 20,
            4 << 20,
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
            assert_eq!(chunk_count(len), lens.len(), "len {len}");
            // The small tail is the run of pieces under PACK_BELOW at the end.
            let (count, bytes) = small_tail(len);
            let small = &lens[lens.len() - count..];
            assert!(small.iter().all(|&n| n < PACK_BELOW), "len {len}");
            assert!(lens[..lens.len() - count].iter().all(|&n| n >= PACK_BELOW));
            assert_eq!(small.iter().sum::<usize>(), bytes, "len {len}");
            let blob = vec![0u8; len];
            assert_eq!(split(&blob).map(<[u8]>::len).collect::<Vec<_>>(), lens);
        }
    }
}
