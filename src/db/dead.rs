//! Pack files that commits made dead: deleted once no crash can bring
//! back a record that names them.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::engine::packs::PackDir;

/// The dead pack files of commits that are not durable yet
/// (`Durability::Eventual`, the parts of a staged change on an exclusive
/// store): a crash before the next durable commit takes such a commit
/// back, and with it the removal of the records that name the files.
#[derive(Default)]
pub(crate) struct DeadFiles {
    pending: Mutex<Vec<PathBuf>>,
}

impl DeadFiles {
    fn pending(&self) -> MutexGuard<'_, Vec<PathBuf>> {
        // A list of paths: nothing a panic can leave half-changed.
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A commit made `dead` dead: delete them now if it was `durable`
    /// (with those of earlier commits that were not), else keep them for
    /// the next durable commit. Best effort: a file left here is deleted
    /// at the next writable open, which finds no record of it.
    pub(crate) fn committed(&self, dir: Option<&PackDir>, dead: Vec<PathBuf>, durable: bool) {
        let mut pending = self.pending();
        pending.extend(dead);
        if durable {
            remove(dir, pending.drain(..));
        }
    }

    /// The store closes: delete what waits if its last commit is now
    /// `durable`; else leave it to the next writable open (which deletes
    /// what no record names, and keeps what a crash brought back).
    pub(crate) fn closing(&self, dir: Option<&PackDir>, durable: bool) {
        let dead = std::mem::take(&mut *self.pending());
        if durable {
            remove(dir, dead.into_iter());
        }
    }

    /// Whether files wait for a durable commit.
    pub(crate) fn waiting(&self) -> bool {
        !self.pending().is_empty()
    }

    /// Whether `path` waits to be deleted.
    pub(crate) fn contains(&self, path: &Path) -> bool {
        self.pending().iter().any(|p| p == path)
    }
}

fn remove(dir: Option<&PackDir>, paths: impl Iterator<Item = PathBuf>) {
    if let Some(dir) = dir {
        for path in paths {
            let _ = dir.io.remove_file(&path);
        }
    }
}
