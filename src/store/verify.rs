//! Verification: every hash, every reference count, every counter.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use super::CheckpointStore;
use crate::engine::packs::{is_missing_pack, missing_pack, recorded_packs};
use crate::engine::Checked;
use crate::{Error, Result, VerifyReport};

impl CheckpointStore {
    /// Read every step and check every hash. Damage is reported per step in
    /// the [`VerifyReport`]; `Err` means the store could not be read at all.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// let report = store.verify()?;
    /// assert!(report.is_ok());
    /// assert_eq!(report.steps_ok, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn verify(&self) -> Result<VerifyReport> {
        self.verify_with(&mut |_, _| {})
    }

    /// Check the checksum of every redb page of the store file at `path`
    /// (a check [`verify`](Self::verify) cannot make: it reads through
    /// redb). Returns `Ok(false)` if a page is damaged.
    ///
    /// The file is never changed: it is read through a layer that keeps
    /// redb's writes in memory, so this works on a store opened by a
    /// training process, on a store whose writer died, and on files you may
    /// only read. It reads the whole file.
    ///
    /// # Errors
    /// [`Error::StoreChanged`](crate::Error::StoreChanged) when a commit
    /// landed while the check ran (a live writer): what was read is no one
    /// state of the file, so nothing is claimed. Damage is reported only
    /// when the file stayed unchanged through the check and a second after.
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let path = dir.path().join("run.ckpt");
    /// let store = CheckpointStore::open(&path)?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// assert!(CheckpointStore::check_pages(&path)?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check_pages(path: impl AsRef<std::path::Path>) -> Result<bool> {
        crate::db::check_pages(path.as_ref(), &crate::options::Settings::default())
    }

    /// [`verify`](Self::verify), calling `progress(step, blob_bytes)` after
    /// each step is checked (for progress bars). A panic in `progress` is
    /// the caller's: it stops the verification and goes on unwinding.
    pub fn verify_with(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<VerifyReport> {
        let what = || "verifying".to_owned();
        let mut caller_panic = None;
        // Run again from the start, with a new report, if the view itself
        // went stale (a recovered view whose file a writer changed).
        let outcome = self.db.read_retrying(&what, |view| {
            let mut report = VerifyReport::default();
            view.verify(&mut report, &mut |step, checked| {
                let bytes = match checked {
                    Checked::Ok(bytes) => *bytes,
                    Checked::Damaged(_) => 0,
                };
                // Keep the caller's panic out of the store's panic boundary.
                match catch_unwind(AssertUnwindSafe(|| progress(step, bytes))) {
                    Ok(()) => true,
                    Err(payload) => {
                        caller_panic = Some(payload);
                        false
                    }
                }
            })?;
            Ok(report)
        });
        if let Some(payload) = caller_panic {
            resume_unwind(payload);
        }
        let mut report = outcome?;
        self.settle_missing_packs(&mut report)?;
        Ok(report)
    }

    /// What a writer did while verification ran, told from damage. A
    /// damaged step whose pack file was missing: damage if the store
    /// still records the file, else a writer removed the step (or moved
    /// its chunks) meanwhile ([`VerifyReport::steps_gone`]). The same for
    /// a recorded pack file the accounting did not find. A stray file
    /// that is gone now, or that a commit of this handle made dead and
    /// deletes once durable, is not reported.
    fn settle_missing_packs(&self, report: &mut VerifyReport) -> Result<()> {
        let Some(dir) = self.db.pack_dir() else {
            return Ok(());
        };
        let what = || "verifying".to_owned();
        self.db.read(&what, |view| {
            for (step, e) in std::mem::take(&mut report.damaged) {
                let e = if is_missing_pack(&e, &dir.path) {
                    missing_pack(e, &view.txn, &dir)?
                } else {
                    e
                };
                match e {
                    Error::ReadInterrupted { .. } => report.steps_gone.push(step),
                    e => report.damaged.push((step, e)),
                }
            }
            let recorded = recorded_packs(&view.txn)?;
            for (pack, problem) in std::mem::take(&mut report.missing_packs) {
                if recorded.contains(&pack) && !dir.io.exists(&dir.file(pack)) {
                    report.accounting.push(problem);
                }
            }
            Ok(())
        })?;
        report
            .stray_packs
            .retain(|p| dir.io.exists(p) && !self.db.is_dead_pending(p));
        report.stray_pack_files = report.stray_packs.len() as u64;
        Ok(())
    }
}
