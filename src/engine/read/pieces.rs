//! Reading a step's blobs in pieces: a byte range of one blob (only the
//! chunks that hold it), and every blob checked through one bounded
//! buffer.

use super::{blob_chunks, fill_chunks, StepData};
use crate::format::manifest::Placement;
use crate::{Error, Result};

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
        let len = self.blob_len(name, blob)?;
        let range = usize::try_from(start)
            .ok()
            .and_then(|s| Some((s, s.checked_add(out.len())?)))
            .filter(|&(_, end)| end <= len);
        let Some((start, end)) = range else {
            return Err(Error::RangeNotStored {
                step: self.step,
                detail: format!(
                    "bytes {start}..{} of {name:?} are beyond its {len} bytes",
                    start.saturating_add(out.len() as u64)
                ),
            });
        };
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
