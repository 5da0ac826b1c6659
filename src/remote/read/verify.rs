//! `Remote::verify`: every step in the bucket read back and hash-checked.

use std::collections::HashSet;

use crate::format::manifest::Hash;
use crate::remote::format::manifest::RemoteManifest;
use crate::remote::read::restore::{blob_chunks, tail};
use crate::remote::Remote;
use crate::{Error, Result, VerifyReport};

/// Chunks of a step fetched (and dropped) at once while verifying.
const VERIFY_BATCH_BYTES: usize = 32 << 20;

impl Remote {
    /// Read every step in the bucket and check every hash, as readers get
    /// it: each step's newest commit that checks out (its manifest there,
    /// hashing right and consistent: lengths, counts, names, see the caps
    /// in the crate docs; every object it names there), and each chunk it
    /// names. Older commits of a step (superseded by a save again) are not
    /// judged: readers never take them. A step none of whose commits
    /// checks out, or whose chunks fail their hash, is reported in
    /// [`VerifyReport::damaged`] with the object at fault; `Err` means the
    /// bucket could not be read at all. Reads every chunk once per step, a
    /// batch of chunks in memory at a time.
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Remote};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// # let remote = Remote::open(&format!("file://{}", dir.path().join("bucket").display()))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// remote.push(&store)?;
    /// let report = remote.verify()?;
    /// assert!(report.is_ok());
    /// assert_eq!(report.steps_ok, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn verify(&self) -> Result<VerifyReport> {
        self.verify_with(&mut |_, _| {})
    }

    /// [`verify`](Self::verify), calling `progress(step, bytes)` after each
    /// step is checked.
    pub fn verify_with(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<VerifyReport> {
        let mut report = VerifyReport::default();
        let commits = self.commits()?;
        if commits.is_empty() {
            return Ok(report);
        }
        let objects = self.bucket.objects()?;
        // Commits come sorted by step: one group per step.
        for of_step in commits.chunk_by(|a, b| a.step == b.step) {
            let step = of_step[0].step;
            let checked = match self.newest_or_why(of_step, &objects)? {
                Ok((_, m)) => m.parts().iter().try_fold(0u64, |n, part| {
                    Ok(n.saturating_add(self.check_chunks(part)?))
                }),
                Err(why) => Err(Error::corrupt(
                    Some(step),
                    format!("{}: {why}", self.bucket.url),
                )),
            };
            match checked {
                Ok(bytes) => {
                    report.steps_ok += 1;
                    report.bytes_checked = report.bytes_checked.saturating_add(bytes);
                    progress(step, bytes);
                }
                Err(e @ Error::Corrupt { .. }) => {
                    report.damaged.push((step, e));
                    progress(step, 0);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(report)
    }

    /// Fetch and check every chunk `m` (checked) names, each once, a batch
    /// at a time, and each blob tail against its hash; its logical bytes.
    fn check_chunks(&self, m: &RemoteManifest) -> Result<u64> {
        let step = m.step;
        let packed = self.fetch_packed(m, &mut |_| {})?;
        for (name, blob) in &m.blobs {
            tail(step, name, blob, &packed)?;
        }
        let mut seen: HashSet<Hash> = HashSet::new();
        let mut batch = Vec::new();
        let mut batch_bytes = 0;
        for (name, blob) in &m.blobs {
            for want in blob_chunks(m, name, blob)? {
                if !seen.insert(want.hash) {
                    continue;
                }
                batch_bytes += want.len;
                batch.push(want);
                if batch_bytes >= VERIFY_BATCH_BYTES {
                    self.fetch(step, &batch, &mut |_| {})?;
                    batch.clear();
                    batch_bytes = 0;
                }
            }
        }
        self.fetch(step, &batch, &mut |_| {})?;
        Ok(m.blobs.values().fold(0, |n, b| n.saturating_add(b.len)))
    }
}
