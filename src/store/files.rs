//! A step of files in a store (`crate::files`): a directory committed as
//! one step, and written back.

use std::path::Path;

use crate::files::{step_of_dir, write_dir};
use crate::{CheckpointStore, CommitInfo, Error, GradientCheckpoint, Result};

impl CheckpointStore {
    /// Commit directory `dir` as step `step`, in one write transaction:
    /// each regular file under it an entry (`files/` and its path),
    /// unchanged chunks of earlier steps referenced, not written again.
    /// A framework's own checkpoint directory (`DeepSpeed`'s, Accelerate's)
    /// becomes a step like any other: verify, retention, push and pull
    /// take it. [`load_dir`](Self::load_dir) writes it back.
    ///
    /// ```
    /// # let dir = tempfile::tempdir()?;
    /// # let store = ckptstore::CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let saved = dir.path().join("saved");
    /// std::fs::create_dir_all(saved.join("zero"))?;
    /// std::fs::write(saved.join("zero/rank0.pt"), b"state")?;
    /// store.save_dir(100, &saved)?;
    /// let back = dir.path().join("back");
    /// assert_eq!(store.load_dir(100, &back)?, vec!["zero/rank0.pt"]);
    /// assert_eq!(std::fs::read(back.join("zero/rank0.pt"))?, b"state");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// As [`commit`](Self::commit) (a step already stored:
    /// [`Error::StepExists`]); [`Error::Io`] naming a file that could not
    /// be read; [`Error::InvalidCheckpoint`] for a link or a special file
    /// under `dir`.
    pub fn save_dir(&self, step: u64, dir: &Path) -> Result<CommitInfo> {
        self.commit(&GradientCheckpoint::from(step_of_dir(step, dir)?))
    }

    /// Write step `step`, a step of files, into directory `dir` (which
    /// must not exist, or be empty), whole or not at all: the paths
    /// written. Every byte is checked against its hash as it is read.
    ///
    /// # Errors
    /// [`Error::StepNotFound`]; [`Error::InvalidCheckpoint`] for a step
    /// that [`save_dir`](Self::save_dir) did not write; [`Error::Io`]
    /// naming what could not be written (`dir` itself when it holds
    /// files).
    pub fn load_dir(&self, step: u64, dir: &Path) -> Result<Vec<String>> {
        let found = self.get(step)?.ok_or(Error::StepNotFound { step })?;
        write_dir(&found.into_step(), dir)
    }
}
