//! Verified slices: bytes `a..b` of a chunk checked against the chunk's
//! BLAKE3 hash without the rest of the chunk. BLAKE3 is a tree over 1 KiB
//! pieces; a [`slice_proof`] carries what the checker cannot compute from
//! the slice itself: the bytes that round the slice out to whole pieces
//! (at most 1 KiB each side) and the chaining value of every subtree
//! outside it (about two per level). A [`SliceCheck`] hashes the slice as
//! it arrives, in parts of any size, and holds only those chaining values.
//!
//! Proof layout (all of it implied by the chunk's length and the slice,
//! which both ends know): the left padding (`a` rounded down to a piece
//! boundary, up to `a`), the right padding (`b` up to its rounding up, or
//! the chunk's end), then 32 bytes per subtree outside the slice, left to
//! right.

use blake3::hazmat::{left_subtree_len, merge_subtrees_non_root, merge_subtrees_root};
use blake3::hazmat::{ChainingValue, HasherExt, Mode};

use crate::format::manifest::Hash;
use crate::{Error, Result};

/// Where bytes of an entry lie in the chunks that hold it
/// ([`Remote::slices`](crate::Remote::slices),
/// [`CheckpointStore::slices`](crate::CheckpointStore::slices)): bytes
/// `a..b` of a chunk of `len` bytes whose BLAKE3 hash is `hash` (a chunk
/// of the entry, or the packed bytes small entries share). A rank handed
/// those bytes by another checks them against `hash` with a proof
/// ([`slice_proof`], [`SliceCheck`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChunkSlice {
    /// The chunk's hash.
    pub hash: Hash,
    /// The chunk's length.
    pub len: u64,
    /// Where the bytes start in the chunk.
    pub a: u64,
    /// Where they end.
    pub b: u64,
}

impl ChunkSlice {
    /// Whether the slice is the whole chunk (its proof is empty).
    pub fn is_whole(&self) -> bool {
        (self.a, self.b) == (0, self.len)
    }
}

/// BLAKE3's piece ("chunk" in its own words) of the tree.
const PIECE: u64 = blake3::CHUNK_LEN as u64;
const CV: usize = 32;

/// Where a subtree lies against the rounded slice.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Inside,
    Outside,
    Across,
}

/// A slice of a chunk, rounded out to whole pieces.
#[derive(Clone, Copy, Debug)]
struct Rounded {
    len: u64,
    a: u64,
    b: u64,
    from: u64,
    to: u64,
}

impl Rounded {
    fn new(len: u64, a: u64, b: u64) -> Result<Rounded> {
        if a >= b || b > len {
            return Err(Error::InvalidCheckpoint {
                step: 0,
                reason: format!("bytes {a}..{b} are no slice of a chunk of {len} bytes"),
            });
        }
        let from = a - a % PIECE;
        let to = b.div_ceil(PIECE).saturating_mul(PIECE).min(len);
        Ok(Rounded {
            len,
            a,
            b,
            from,
            to,
        })
    }

    fn side(&self, start: u64, size: u64) -> Side {
        if start >= self.from && start + size <= self.to {
            Side::Inside
        } else if start + size <= self.from || start >= self.to {
            Side::Outside
        } else {
            Side::Across
        }
    }

    /// Visit the tree's subtrees that lie wholly inside or outside the
    /// slice, left to right (a subtree across its edges is split).
    fn walk(&self, start: u64, size: u64, visit: &mut dyn FnMut(Side, u64, u64)) {
        match self.side(start, size) {
            Side::Across if size > PIECE => {
                let left = left_subtree_len(size);
                self.walk(start, left, visit);
                self.walk(start + left, size - left, visit);
            }
            // A piece is never across a slice rounded to pieces.
            placed => visit(placed, start, size),
        }
    }

    fn pads(&self) -> usize {
        usize::try_from((self.a - self.from) + (self.to - self.b)).unwrap_or(usize::MAX)
    }
}

/// The length of the proof of bytes `a..b` of a chunk of `len` bytes
/// (an error if that is no slice of it).
///
/// # Errors
/// [`Error::InvalidCheckpoint`] when `a..b` is empty or past `len`.
pub fn slice_proof_len(len: u64, a: u64, b: u64) -> Result<usize> {
    let r = Rounded::new(len, a, b)?;
    let mut outside = 0;
    if r.side(0, len) != Side::Inside {
        r.walk(0, len, &mut |side, _, _| {
            outside += usize::from(side == Side::Outside);
        });
    }
    Ok(r.pads() + CV * outside)
}

/// The proof of bytes `a..b` of `chunk` ([`slice_proof_len`] bytes).
///
/// # Errors
/// As [`slice_proof_len`].
pub fn slice_proof(chunk: &[u8], a: u64, b: u64) -> Result<Vec<u8>> {
    let len = chunk.len() as u64;
    let r = Rounded::new(len, a, b)?;
    let at = |x: u64| usize::try_from(x).unwrap_or(usize::MAX);
    let mut proof = Vec::with_capacity(slice_proof_len(len, a, b)?);
    proof.extend_from_slice(&chunk[at(r.from)..at(a)]);
    proof.extend_from_slice(&chunk[at(b)..at(r.to)]);
    if r.side(0, len) != Side::Inside {
        r.walk(0, len, &mut |side, start, size| {
            if side == Side::Outside {
                let bytes = &chunk[at(start)..at(start + size)];
                proof.extend_from_slice(&chaining_value(start, bytes));
            }
        });
    }
    Ok(proof)
}

fn chaining_value(start: u64, bytes: &[u8]) -> ChainingValue {
    blake3::Hasher::new()
        .set_input_offset(start)
        .update(bytes)
        .finalize_non_root()
}

/// A check of bytes `a..b` of a chunk of known hash and length, fed the
/// slice's bytes in order ([`update`](Self::update)) and judged at the end
/// ([`finish`](Self::finish)).
///
/// ```
/// use ckptstore::{slice_proof, SliceCheck};
/// let chunk: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
/// let hash = *blake3::hash(&chunk).as_bytes();
/// let proof = slice_proof(&chunk, 1500, 3100)?;
/// let mut check = SliceCheck::new(hash, 5000, 1500, 3100, &proof)?;
/// check.update(&chunk[1500..2000]);
/// check.update(&chunk[2000..3100]);
/// assert!(check.finish());
/// # Ok::<(), ckptstore::Error>(())
/// ```
pub struct SliceCheck {
    hash: Hash,
    rounded: Rounded,
    /// The right padding and the chaining values outside the slice.
    right: Vec<u8>,
    outside: Vec<ChainingValue>,
    /// The subtrees inside the slice (start, size), left to right, and
    /// the chaining value of each one hashed so far.
    inside: Vec<(u64, u64)>,
    done: Vec<ChainingValue>,
    hasher: blake3::Hasher,
    /// The offset of the next byte in the chunk.
    at: u64,
}

impl SliceCheck {
    /// A check of bytes `a..b` of a chunk of `len` bytes hashing to
    /// `hash`, with the slice's `proof` ([`slice_proof`]).
    ///
    /// # Errors
    /// [`Error::InvalidCheckpoint`] when `a..b` is no slice of the chunk or
    /// the proof is not of the length it implies.
    pub fn new(hash: Hash, len: u64, a: u64, b: u64, proof: &[u8]) -> Result<SliceCheck> {
        let r = Rounded::new(len, a, b)?;
        if proof.len() != slice_proof_len(len, a, b)? {
            return Err(Error::InvalidCheckpoint {
                step: 0,
                reason: format!("a proof of {} bytes for bytes {a}..{b}", proof.len()),
            });
        }
        let left = usize::try_from(a - r.from).unwrap_or(usize::MAX);
        let right = usize::try_from(r.to - b).unwrap_or(usize::MAX);
        let mut inside = Vec::new();
        if r.side(0, len) == Side::Inside {
            inside.push((0, len));
        } else {
            r.walk(0, len, &mut |side, start, size| {
                if side == Side::Inside {
                    inside.push((start, size));
                }
            });
        }
        let outside = proof[left + right..]
            .chunks_exact(CV)
            .map(|cv| cv.try_into().unwrap_or([0; CV]))
            .collect();
        let mut check = SliceCheck {
            hash,
            rounded: r,
            right: proof[left..left + right].to_vec(),
            outside,
            inside,
            done: Vec::new(),
            hasher: blake3::Hasher::new(),
            at: r.from,
        };
        check.start_subtree();
        check.feed(&proof[..left]);
        Ok(check)
    }

    /// The next bytes of the slice.
    pub fn update(&mut self, bytes: &[u8]) {
        self.feed(bytes);
    }

    /// Whether the bytes fed were exactly the slice, and hash with the
    /// proof to the chunk's hash.
    pub fn finish(mut self) -> bool {
        let right = std::mem::take(&mut self.right);
        self.feed(&right);
        if self.at != self.rounded.to || self.done.len() != self.inside.len() {
            return false;
        }
        let r = self.rounded;
        if self.inside == [(0, r.len)] {
            return self.done[0] == self.hash;
        }
        let (mut inside, mut outside) = (self.done.iter(), self.outside.iter());
        let mut next = |side: Side| match side {
            Side::Inside => inside.next().copied(),
            _ => outside.next().copied(),
        };
        let Some((left, right)) = root_children(&r, &mut next) else {
            return false;
        };
        *merge_subtrees_root(&left, &right, Mode::Hash).as_bytes() == self.hash
    }

    /// Hash `bytes` into the subtrees they fall in, finishing each one
    /// whose last byte they hold.
    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let Some(&(start, size)) = self.inside.get(self.done.len()) else {
                self.at = u64::MAX; // more than the slice: fails at finish
                return;
            };
            let room = usize::try_from(start + size - self.at).unwrap_or(usize::MAX);
            let (now, rest) = bytes.split_at(room.min(bytes.len()));
            self.hasher.update(now);
            self.at += now.len() as u64;
            bytes = rest;
            if self.at == start + size {
                let whole = self.inside.len() == 1 && (start, size) == (0, self.rounded.len);
                self.done.push(if whole {
                    *self.hasher.finalize().as_bytes()
                } else {
                    self.hasher.finalize_non_root()
                });
                self.start_subtree();
            }
        }
    }

    fn start_subtree(&mut self) {
        self.hasher = blake3::Hasher::new();
        if let Some(&(start, _)) = self.inside.get(self.done.len()) {
            if start > 0 {
                self.hasher.set_input_offset(start);
            }
        }
    }
}

/// The chaining values of the root's two children, merged up from the
/// subtrees `next` gives left to right (inside or outside the slice).
fn root_children(
    r: &Rounded,
    next: &mut dyn FnMut(Side) -> Option<ChainingValue>,
) -> Option<(ChainingValue, ChainingValue)> {
    let left = left_subtree_len(r.len);
    let l = subtree(r, 0, left, next)?;
    let right = subtree(r, left, r.len - left, next)?;
    Some((l, right))
}

fn subtree(
    r: &Rounded,
    start: u64,
    size: u64,
    next: &mut dyn FnMut(Side) -> Option<ChainingValue>,
) -> Option<ChainingValue> {
    match r.side(start, size) {
        Side::Across if size > PIECE => {
            let left = left_subtree_len(size);
            let l = subtree(r, start, left, next)?;
            let right = subtree(r, start + left, size - left, next)?;
            Some(merge_subtrees_non_root(&l, &right, Mode::Hash))
        }
        placed => next(placed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: u64, seed: u64) -> Vec<u8> {
        (0..n)
            .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed).to_le_bytes()[1])
            .collect()
    }

    fn u(x: u64) -> usize {
        usize::try_from(x).expect("fits")
    }

    /// Check `chunk[a..b]` fed in parts of `step` bytes.
    fn check(chunk: &[u8], a: u64, b: u64, step: usize, proof: &[u8]) -> bool {
        let hash = *blake3::hash(chunk).as_bytes();
        let Ok(mut c) = SliceCheck::new(hash, chunk.len() as u64, a, b, proof) else {
            return false;
        };
        for part in chunk[u(a)..u(b)].chunks(step) {
            c.update(part);
        }
        c.finish()
    }

    #[test]
    fn every_slice_of_chunks_of_many_lengths_checks_out_and_a_flipped_byte_fails() {
        let mut rng = 0x9e37_79b9_u64;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        for len in [
            1, 1000, 1024, 1025, 2048, 3000, 4096, 5121, 65_536, 1_048_448,
        ] {
            let chunk = bytes(len, len);
            for _ in 0..12 {
                let a = next(len);
                let b = a + 1 + next(len - a);
                let proof = slice_proof(&chunk, a, b).expect("proof");
                assert_eq!(proof.len(), slice_proof_len(len, a, b).expect("len"));
                let step = 1 + u(next(70_000));
                assert!(check(&chunk, a, b, step, &proof), "{len} {a}..{b}");
                // A flipped byte in the slice, its padding or its proof.
                let mut bad = chunk.clone();
                bad[u(a + next(b - a))] ^= 1;
                let hash = *blake3::hash(&chunk).as_bytes();
                let mut c = SliceCheck::new(hash, len, a, b, &proof).expect("check");
                c.update(&bad[u(a)..u(b)]);
                assert!(!c.finish(), "{len} {a}..{b}: a flipped byte passed");
                if !proof.is_empty() {
                    let mut wrong = proof.clone();
                    wrong[u(next(proof.len() as u64))] ^= 1;
                    assert!(!check(&chunk, a, b, step, &wrong), "{len} {a}..{b}: proof");
                }
            }
        }
    }

    #[test]
    fn too_few_or_too_many_bytes_fail_and_a_proof_of_the_wrong_length_is_refused() {
        let chunk = bytes(10_000, 3);
        let hash = *blake3::hash(&chunk).as_bytes();
        let proof = slice_proof(&chunk, 2000, 7000).expect("proof");
        let mut short = SliceCheck::new(hash, 10_000, 2000, 7000, &proof).expect("check");
        short.update(&chunk[2000..6999]);
        assert!(!short.finish());
        let mut long = SliceCheck::new(hash, 10_000, 2000, 7000, &proof).expect("check");
        long.update(&chunk[2000..7001]);
        assert!(!long.finish());
        assert!(SliceCheck::new(hash, 10_000, 2000, 7000, &proof[1..]).is_err());
        assert!(SliceCheck::new(hash, 10_000, 7000, 7000, &[]).is_err());
        assert!(slice_proof_len(10_000, 0, 10_001).is_err());
        // The whole chunk needs no proof; a slice of one piece needs little.
        assert_eq!(slice_proof_len(10_000, 0, 10_000).ok(), Some(0));
        assert!(slice_proof_len(1 << 20, 4096, 5120).expect("len") < 32 * 2 * 11);
    }
}
