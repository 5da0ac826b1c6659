//! `Remote::verify`: every step in the bucket read back and hash-checked.

use std::collections::HashSet;

use crate::format::manifest::Hash;
use crate::remote::format::manifest::RemoteManifest;
use crate::remote::read::restore::{blob_chunks, tail};
use crate::remote::read::Reader;
use crate::{Error, Result, VerifyReport};

/// Chunks of a step fetched (and dropped) at once while verifying.
const VERIFY_BATCH_BYTES: usize = 32 << 20;

impl Reader<'_> {
    /// Does the work of [`Remote::verify`](crate::Remote::verify).
    pub(crate) fn verify(&self) -> Result<VerifyReport> {
        self.verify_with(&mut |_, _| {})
    }

    /// Does the work of [`Remote::verify_with`](crate::Remote::verify_with).
    pub(crate) fn verify_with(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<VerifyReport> {
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
