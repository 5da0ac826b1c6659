//! Reading a step's blobs in pieces: a byte range of one blob (only the
//! chunks that hold it), where a range lies in the chunks and the proofs
//! that let a rank handed it check it, and every blob checked through one
//! bounded buffer.

use std::collections::hash_map::{Entry, HashMap};
use std::collections::BTreeMap;

use super::{blob_chunks, fill_chunks, ChunkAt, StepData};
use crate::engine::slices::{slice_proof, ChunkSlice};
use crate::format::manifest::{BlobRef, Hash, PackedRef, Placement};
use crate::{Error, Result};

/// Where a slice's chunk is: the step's packed small blobs, or a chunk of
/// the blob of `len` bytes starting at byte `from` of it.
#[derive(Clone, Copy)]
enum Source {
    Packed,
    Chunk {
        at: ChunkAt,
        from: usize,
        len: usize,
    },
}

impl StepData<'_> {
    /// Fill `out` with bytes `start..start + out.len()` of blob `name`,
    /// reading and hash-checking only the chunks that hold them (a chunk
    /// inside the range straight into `out`, the one or two at its edges
    /// through a chunk-sized buffer); `false` (and `out` untouched) if the
    /// step has no such blob.
    pub(crate) fn read_range_into(&self, name: &str, start: u64, out: &mut [u8]) -> Result<bool> {
        let Some(blob) = self.blobs.get(name) else {
            return Ok(false);
        };
        let (len, start, end) = self.placing().range(name, blob, start, out.len() as u64)?;
        if out.is_empty() {
            return Ok(true);
        }
        if let Placement::Packed { .. } = blob.at {
            // Under 64 KiB, from the step's packed bytes (read once).
            let mut whole = vec![0u8; len];
            self.fill(name, blob, &mut whole)?;
            out.copy_from_slice(&whole[start..end]);
            return Ok(true);
        }
        let refs = blob_chunks(self.step, name, blob, len)?;
        let mut inside = Vec::new();
        let mut inside_at = None;
        let mut at = 0;
        for r in &refs {
            let (from, to) = (at, at + r.2);
            at = to;
            if to <= start || from >= end {
                continue;
            }
            if from >= start && to <= end {
                inside_at.get_or_insert(from - start);
                inside.push(*r);
                continue;
            }
            // An edge chunk: checked whole, its part in the range copied.
            let mut chunk = vec![0u8; r.2];
            fill_chunks(&self.chunks, self.step, name, &[*r], 1, &mut chunk)?;
            let (lo, hi) = (from.max(start), to.min(end));
            out[lo - start..hi - start].copy_from_slice(&chunk[lo - from..hi - from]);
        }
        if let Some(first) = inside_at {
            let n: usize = inside.iter().map(|r| r.2).sum();
            let threads = self.view.threads;
            fill_chunks(
                &self.chunks,
                self.step,
                name,
                &inside,
                threads,
                &mut out[first..first + n],
            )?;
        }
        Ok(true)
    }
}

/// A step's blobs as its manifest places them (in chunks, or in the
/// step's packed bytes): where a range of one lies.
pub(crate) struct Placing<'a> {
    pub(crate) step: u64,
    pub(crate) blobs: &'a BTreeMap<String, BlobRef>,
    pub(crate) packed: Option<&'a PackedRef>,
}

impl Placing<'_> {
    /// Blob `blob`'s length, and bytes `start..start + n` of it as indices
    /// (an error past its end).
    fn range(
        &self,
        name: &str,
        blob: &BlobRef,
        start: u64,
        n: u64,
    ) -> Result<(usize, usize, usize)> {
        let len = usize::try_from(blob.len).map_err(|_| {
            Error::corrupt(
                Some(self.step),
                format!("blob {name:?} is too long to load"),
            )
        })?;
        let range = usize::try_from(start)
            .ok()
            .and_then(|s| Some((s, s.checked_add(usize::try_from(n).ok()?)?)))
            .filter(|&(_, end)| end <= len);
        let Some((start, end)) = range else {
            return Err(Error::RangeNotStored {
                step: self.step,
                detail: format!(
                    "bytes {start}..{} of {name:?} are beyond its {len} bytes",
                    start.saturating_add(n)
                ),
            });
        };
        Ok((len, start, end))
    }

    /// The slices of bytes `start..start + n` of blob `name`, in order,
    /// each with where its chunk is.
    fn placed(&self, name: &str, start: u64, n: u64) -> Result<Vec<(ChunkSlice, Source)>> {
        let Some(blob) = self.blobs.get(name) else {
            return Err(Error::RangeNotStored {
                step: self.step,
                detail: format!("it stores no entry {name:?}"),
            });
        };
        let (len, start, end) = self.range(name, blob, start, n)?;
        if start == end {
            return Ok(Vec::new());
        }
        if let Placement::Packed { offset } = blob.at {
            let packed = self.packed.ok_or_else(|| {
                Error::corrupt(
                    Some(self.step),
                    format!("blob {name:?} is packed in a step with no packed bytes"),
                )
            })?;
            let slice = ChunkSlice {
                hash: packed.hash,
                len: packed.len,
                a: offset + start as u64,
                b: offset + end as u64,
            };
            return Ok(vec![(slice, Source::Packed)]);
        }
        let mut out = Vec::new();
        let mut from = 0;
        for (hash, at, n) in blob_chunks(self.step, name, blob, len)? {
            let to = from + n;
            if from < end && to > start {
                let slice = ChunkSlice {
                    hash,
                    len: n as u64,
                    a: (start.max(from) - from) as u64,
                    b: (end.min(to) - from) as u64,
                };
                out.push((slice, Source::Chunk { at, from, len: n }));
            }
            from = to;
        }
        Ok(out)
    }

    /// Where bytes `start..start + n` of blob `name` lie in the step's
    /// chunks (or its packed bytes), in order.
    pub(crate) fn slices(&self, name: &str, start: u64, n: u64) -> Result<Vec<ChunkSlice>> {
        Ok(self
            .placed(name, start, n)?
            .into_iter()
            .map(|(s, _)| s)
            .collect())
    }
}

impl StepData<'_> {
    fn placing(&self) -> Placing<'_> {
        Placing {
            step: self.step,
            blobs: &self.blobs,
            packed: self.packed_ref.as_ref(),
        }
    }

    /// Where bytes `start..start + n` of blob `name` lie in the step's
    /// chunks (or its packed bytes), in order.
    pub(crate) fn slices(&self, name: &str, start: u64, n: u64) -> Result<Vec<ChunkSlice>> {
        self.placing().slices(name, start, n)
    }

    /// For each `(name, start, n)` of `ranges`, the proofs of its
    /// [`slices`](Self::slices) back to back (a whole chunk's is empty),
    /// made from checked bytes: a chunk `have` holds whole (bytes of
    /// blobs already read and checked, as `(name, start, bytes)`), else
    /// the chunk read and checked here, once for all the ranges.
    pub(crate) fn proofs(
        &self,
        ranges: &[(&str, u64, u64)],
        have: &[(&str, u64, &[u8])],
    ) -> Result<Vec<Vec<u8>>> {
        let mut read: HashMap<Hash, Vec<u8>> = HashMap::new();
        let mut out = Vec::with_capacity(ranges.len());
        for &(name, start, n) in ranges {
            let mut proof = Vec::new();
            for (slice, source) in self.placing().placed(name, start, n)? {
                if slice.is_whole() {
                    continue;
                }
                let chunk: &[u8] = match source {
                    Source::Packed => self.packed()?,
                    Source::Chunk { at, from, len } => {
                        if let Some(bytes) = held(have, name, from, len) {
                            bytes
                        } else {
                            if let Entry::Vacant(e) = read.entry(slice.hash) {
                                let mut chunk = vec![0u8; len];
                                let one = [(slice.hash, at, len)];
                                fill_chunks(&self.chunks, self.step, name, &one, 1, &mut chunk)?;
                                e.insert(chunk);
                            }
                            &read[&slice.hash]
                        }
                    }
                };
                proof.extend(slice_proof(chunk, slice.a, slice.b)?);
            }
            out.push(proof);
        }
        Ok(out)
    }
}

/// Bytes `from..from + len` of blob `name`, if one of `have` holds them
/// all.
fn held<'a>(
    have: &[(&str, u64, &'a [u8])],
    name: &str,
    from: usize,
    len: usize,
) -> Option<&'a [u8]> {
    have.iter().find_map(|&(n, start, bytes)| {
        let at = from.checked_sub(usize::try_from(start).ok()?)?;
        (n == name && at + len <= bytes.len()).then(|| &bytes[at..at + len])
    })
}

/// Chunks a verification holds in memory per thread.
const CHECK_WINDOW_PER_THREAD: usize = 4;

impl StepData<'_> {
    /// Check every blob of the step against its hashes, reading at most
    /// [`CHECK_WINDOW_PER_THREAD`] chunks per thread into one buffer
    /// reused for the whole step (a step larger than memory can be
    /// verified); returns the bytes checked.
    pub(crate) fn check_all(&self) -> Result<u64> {
        let threads = self.view.threads.max(1);
        let window = threads * CHECK_WINDOW_PER_THREAD;
        let mut buf = Vec::new();
        let mut total = 0;
        for (name, blob) in &self.blobs {
            let len = self.blob_len(name, blob)?;
            if let Placement::Packed { .. } = blob.at {
                // Under 64 KiB, from the step's packed bytes (read once).
                buf.resize(len, 0);
                self.fill(name, blob, &mut buf)?;
            } else {
                let refs = blob_chunks(self.step, name, blob, len)?;
                for group in refs.chunks(window) {
                    let bytes = group.iter().map(|r| r.2).sum();
                    buf.resize(bytes, 0);
                    fill_chunks(&self.chunks, self.step, name, group, threads, &mut buf)?;
                }
            }
            total += blob.len;
        }
        Ok(total)
    }
}
