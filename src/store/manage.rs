//! Changing what is stored: remove, roll back, retention, pins, compaction.

use super::CheckpointStore;
use crate::db::TxnKind;
use crate::{Error, Result, Retention};

impl CheckpointStore {
    /// Remove `step` and free the chunks no other step uses, in one write
    /// transaction. Returns whether the step was stored.
    ///
    /// # Errors
    /// [`Error::StepPinned`] if the step is pinned.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// assert!(store.remove(1)?);
    /// assert!(!store.remove(1)?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn remove(&self, step: u64) -> Result<bool> {
        let what = || format!("removing step {step}");
        let removed = self.db.write("remove", &what, TxnKind::Whole, |engine| {
            if engine.pinned()?.contains(&step) {
                return Err(Error::StepPinned {
                    step,
                    op: "removing it",
                });
            }
            Ok(engine.remove_steps(&[step])?.0)
        })?;
        Ok(!removed.is_empty())
    }

    /// Remove every step of `steps` in one write transaction: all of them,
    /// or (on any error) none.
    ///
    /// # Errors
    /// [`Error::StepsNotFound`] naming every step that is not stored;
    /// [`Error::StepPinned`] if one is pinned.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, Error, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for step in [1, 2, 3] {
    ///     store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), step))?;
    /// }
    /// let e = store.remove_all(&[1, 99, 2, 98]).expect_err("99 and 98 are missing");
    /// assert!(matches!(e, Error::StepsNotFound { ref steps } if steps == &[98, 99]));
    /// assert_eq!(store.steps()?, vec![1, 2, 3]);
    /// store.remove_all(&[1, 2])?;
    /// assert_eq!(store.steps()?, vec![3]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn remove_all(&self, steps: &[u64]) -> Result<()> {
        let what = || format!("removing steps {steps:?}");
        self.db.write("remove", &what, TxnKind::Whole, |engine| {
            let pinned = engine.pinned()?;
            let mut missing = Vec::new();
            for &step in steps {
                if pinned.contains(&step) {
                    return Err(Error::StepPinned {
                        step,
                        op: "removing it",
                    });
                }
                if !engine.has_step(step)? {
                    missing.push(step);
                }
            }
            if !missing.is_empty() {
                missing.sort_unstable();
                missing.dedup();
                return Err(Error::StepsNotFound { steps: missing });
            }
            engine.remove_steps(steps).map(drop)
        })
    }

    /// Discard every step after `step` in one write transaction (a run that
    /// restarts from an earlier step). Returns the steps removed, ascending.
    ///
    /// # Errors
    /// [`Error::StepPinned`] if a step after `step` is pinned (nothing is
    /// removed).
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for step in [10, 20, 30, 40] {
    ///     store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), step))?;
    /// }
    /// assert_eq!(store.rollback_to(20)?, vec![30, 40]);
    /// assert_eq!(store.latest_step()?, Some(20));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn rollback_to(&self, step: u64) -> Result<Vec<u64>> {
        let what = || format!("rolling back to step {step}");
        let Some(after) = step.checked_add(1) else {
            return Ok(Vec::new());
        };
        self.db.write("rollback", &what, TxnKind::Whole, |engine| {
            if let Some(&pinned) = engine.pinned()?.range(after..).next() {
                return Err(Error::StepPinned {
                    step: pinned,
                    op: "rolling back past it",
                });
            }
            let doomed = engine.steps_in(after..)?;
            Ok(engine.remove_steps(&doomed)?.0)
        })
    }

    /// Apply `policy` now, in one write transaction: delete every step no
    /// rule keeps (pinned steps are kept). Returns the steps deleted.
    ///
    /// # Errors
    /// [`Error::InvalidOptions`] for a policy that would delete every
    /// unpinned step (`keep_last(0)`, `keep_every(0)`, nothing else) and
    /// so is most likely a mistake; say [`Retention::allow_deleting_all`]
    /// to mean it.
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Retention};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for step in 0..10 {
    ///     store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), step))?;
    /// }
    /// store.pin(2)?;
    /// let removed = store.apply_retention(&Retention::new().keep_last(3))?;
    /// assert_eq!(removed, vec![0, 1, 3, 4, 5, 6]);
    /// assert_eq!(store.steps()?, vec![2, 7, 8, 9]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn apply_retention(&self, policy: &Retention) -> Result<Vec<u64>> {
        policy.check_keeps_something()?;
        let what = || "applying a retention policy".to_owned();
        self.db.write("retention", &what, TxnKind::Whole, |engine| {
            let doomed = engine.retention_doomed(policy)?;
            Ok(engine.remove_steps(&doomed)?.0)
        })
    }

    /// Pin `step`: retention never deletes it, and `remove` and
    /// `rollback_to` refuse to. Returns whether it was newly pinned.
    ///
    /// # Errors
    /// [`Error::StepNotFound`] if the step is not stored.
    pub fn pin(&self, step: u64) -> Result<bool> {
        let what = || format!("pinning step {step}");
        self.db.write("pin", &what, TxnKind::Whole, |engine| {
            engine.set_pin(step, true)
        })
    }

    /// Unpin `step`. Returns whether it was pinned.
    pub fn unpin(&self, step: u64) -> Result<bool> {
        let what = || format!("unpinning step {step}");
        self.db.write("unpin", &what, TxnKind::Whole, |engine| {
            engine.set_pin(step, false)
        })
    }

    /// Take the run identity `id` of a bucket this empty store is being
    /// filled from; a store with steps keeps its own (returns false).
    #[cfg(feature = "remote")]
    pub(crate) fn join_run(&self, id: &str) -> Result<bool> {
        let what = || format!("taking the store id {id}");
        self.db.write("pull", &what, TxnKind::Whole, |engine| {
            if !engine.steps_in(..)?.is_empty() {
                return Ok(false);
            }
            engine.set_store_id(id)?;
            Ok(true)
        })
    }

    /// Hand the file's free space back to the filesystem (redb compaction),
    /// after rewriting the pack files that are at least half dead (their
    /// live chunks move to a new pack file, each hash-checked, in one
    /// transaction; the old files are deleted after it commits). Returns
    /// whether anything was compacted.
    ///
    /// # Errors
    /// [`Error::Corrupt`] if a chunk to move fails its hash check (nothing
    /// is moved);
    /// [`Error::Busy`] while a read is in progress, in this process or in
    /// another one that has the store open read-only (a `ckpt` command, an
    /// evaluation job): redb can only move pages that no reader can see.
    /// Try again when the readers are done (`ckpt compact --wait SECS` does).
    pub fn compact(&self) -> Result<bool> {
        let what = || format!("compacting the pack files of {}", self.path().display());
        // The method path is not general over the transaction's lifetime.
        #[allow(clippy::redundant_closure_for_method_calls)]
        let (packs, _) = self
            .db
            .write("compact", &what, TxnKind::Whole, |e| e.compact_packs())?;
        Ok(self.db.compact()? || packs > 0)
    }
}
