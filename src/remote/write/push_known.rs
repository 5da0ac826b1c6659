//! A push that costs what changed: while the bucket's collection mark is
//! the one the store remembers (no garbage collection deleted anything
//! since the store last listed the bucket), the push trusts what the store
//! remembers and lists nothing.
//!
//! Per store step: a step the store knows the bucket holds whole is
//! skipped unread; any other is read, and of its chunks only those the
//! store does not know to be there are asked about (HEAD) and uploaded if
//! missing; then its manifest and commit, and the store remembers the step
//! and its chunks (one small transaction). A step whose newest commit in
//! the bucket names the same content is checked (its chunks and manifest)
//! and repaired rather than pushed again.

use object_store::ObjectStoreExt;

use crate::engine::Remembered;
use crate::format::manifest::Hash;
use crate::remote::coordination::locks::Lock;
use crate::remote::write::push::{encoded, step_chunks, Done, Landing, PushReport, StepChunk};
use crate::remote::{Commit, Remote};
use crate::{CheckpointStore, Result};

impl Remote {
    /// Push with what the store remembers of the bucket as of `mark`.
    pub(crate) fn push_known(
        &self,
        store: &CheckpointStore,
        known: &Remembered,
        lock: &mut Lock,
        progress: &mut dyn FnMut(u64, u64) -> bool,
    ) -> Result<PushReport> {
        let mut report = PushReport::default();
        for step in store.steps()? {
            let remembered = known.steps.get(&step).copied();
            if remembered.is_some_and(|p| p.whole) {
                report.steps_present += 1;
                continue;
            }
            self.refresh(lock)?;
            let done = store.with_step_once(step, |ckpt, info, data| {
                let (bytes, hash) = encoded(step, &ckpt, &info, data)?;
                let chunks = step_chunks(data)?;
                let hashes: Vec<Hash> = chunks.iter().map(|c| c.hash).collect();
                let mut there = data.known_chunks(&self.url, &hashes)?;
                let unknown: Vec<Hash> = hashes
                    .iter()
                    .filter(|h| !there.contains(*h))
                    .copied()
                    .collect();
                there.extend(self.present(unknown.into_iter())?);
                let missing: Vec<&StepChunk> =
                    chunks.iter().filter(|c| !there.contains(&c.hash)).collect();
                let same = remembered.filter(|p| p.hash == hash);
                if let Some(p) = same.filter(|_| missing.is_empty()) {
                    if self.has_manifest(step, &hash)? {
                        return Ok(Done::present(p.generation, hash, hashes));
                    }
                }
                let generation = match (same, remembered) {
                    (Some(p), _) => p.generation,
                    (None, Some(p)) => p.generation + 1,
                    (None, None) => 1,
                };
                let before = report.bytes_uploaded;
                for c in &chunks {
                    if there.contains(&c.hash) {
                        report.bytes_skipped += c.len as u64;
                    } else {
                        report.bytes_uploaded += c.len as u64;
                        report.chunks_uploaded += 1;
                    }
                }
                let commit = Commit {
                    step,
                    generation,
                    hash,
                };
                let landing = Landing {
                    commit,
                    bytes,
                    chunks: &chunks,
                    missing: &missing,
                };
                self.land(data, landing, lock, before, progress)?;
                Ok(Done::pushed(generation, hash, hashes))
            })?;
            let Some(done) = done else { continue }; // removed since listed
            store.remember(
                &self.url,
                &known.mark,
                false,
                &[(step, done.remember)],
                &done.chunks,
            )?;
            if done.pushed {
                report.steps_pushed.push(step);
            } else {
                report.steps_present += 1;
            }
            if !progress(step, report.bytes_uploaded) {
                break;
            }
        }
        Ok(report)
    }

    /// Whether step `step`'s manifest of hash `hash` is in the bucket.
    fn has_manifest(&self, step: u64, hash: &Hash) -> Result<bool> {
        let key = self.layout.manifest(step, hash);
        let found = self.run(self.store.head(&key))?;
        match found {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.error("looking for", &key, e)),
        }
    }
}
