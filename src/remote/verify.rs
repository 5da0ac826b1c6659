//! `Remote::verify`: every step in the bucket read back and hash-checked.

use super::Remote;
use crate::{Error, Result, VerifyReport};

impl Remote {
    /// Read every step in the bucket and check every hash: each commit's
    /// manifest, and each chunk it names. A step whose manifest is missing
    /// or damaged, or whose chunks are missing or fail their hash, is
    /// reported in [`VerifyReport::damaged`]; `Err` means the bucket could
    /// not be read at all. Reads every byte of every step, one step in
    /// memory at a time.
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Remote};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// # let remote = Remote::open(&format!("file://{}", dir.path().join("bucket").display()))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// store.push(&remote)?;
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
        for c in self.commits()? {
            let checked = match self.checked_manifest(c, None)? {
                None => Err(Error::corrupt(
                    Some(c.step),
                    format!(
                        "the manifest its commit names is missing or damaged in {}",
                        self.url
                    ),
                )),
                Some(m) => m
                    .parts()
                    .iter()
                    .map(|part| Ok(self.assemble(part.clone(), &mut |_| {})?.logical_bytes()))
                    .sum::<Result<u64>>(),
            };
            match checked {
                Ok(bytes) => {
                    report.steps_ok += 1;
                    report.bytes_checked += bytes;
                    progress(c.step, bytes);
                }
                Err(e @ Error::Corrupt { .. }) => {
                    report.damaged.push((c.step, e));
                    progress(c.step, 0);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(report)
    }
}
