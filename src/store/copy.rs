//! Copying and removing a store, pack files and all, by the one path a
//! user knows.

use std::path::Path;

use super::CheckpointStore;
use crate::checkpoint::Incoming;
use crate::file::{sync_dir, temp_beside};
use crate::format::packs::pack_dir;
use crate::{Error, Result, StepInfo, StoreOptions};

impl CheckpointStore {
    /// Copy every step (and every pin) into a new store at `to`, with
    /// `options` (pack files and all): the way to copy a store whose chunks
    /// live in its file and its pack directory, and the one that is safe
    /// while other processes write to this store. Returns the steps
    /// copied, ascending.
    ///
    /// Each step is copied whole and hash-checked, a part of its blobs and
    /// tensors in memory at a time (as
    /// [`import_safetensors`](Self::import_safetensors)); a step removed
    /// while the copy runs (by retention in another process) is left out.
    /// The copy is built under a hidden
    /// name beside `to` (`.NAME.copy-*`) and renamed into place when it is
    /// complete, so `to` never names half a copy; a copy killed before that
    /// leaves the hidden files, which may be deleted. The new store has an
    /// identity of its own: to push it to its original's bucket prefix,
    /// take the prefix over (`Remote::adopt`, `ckpt push --adopt`).
    ///
    /// # Errors
    /// [`Error::Io`] if `to` or its pack directory exists; a damaged step
    /// is [`Error::Corrupt`] naming it (nothing is left at `to`).
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, StoreOptions};
    /// # let dir = tempfile::tempdir()?;
    /// let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 3))?;
    /// let copied = store.copy_to(dir.path().join("backup.ckpt"), StoreOptions::new())?;
    /// assert_eq!(copied, [3]);
    /// let backup = CheckpointStore::open_read_only(dir.path().join("backup.ckpt"))?;
    /// assert_eq!(backup.get(3)?, store.get(3)?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy_to(&self, to: impl AsRef<Path>, options: StoreOptions) -> Result<Vec<u64>> {
        let to = &crate::file::real_path(to.as_ref())?;
        for path in [to.to_owned(), pack_dir(to)] {
            if path.exists() {
                let exists = std::io::Error::from(std::io::ErrorKind::AlreadyExists);
                return Err(Error::io("copy the store to", &path, exists));
            }
        }
        let (dir, tmp) = temp_beside(to, "copy");
        let copied = options.open(&tmp).and_then(|copy| {
            let steps = self.copy_steps(&copy)?;
            drop(copy);
            Ok(steps)
        });
        let copied = copied.and_then(|steps| {
            let packs = pack_dir(&tmp);
            if packs.exists() {
                let to_packs = pack_dir(to);
                std::fs::rename(&packs, &to_packs)
                    .map_err(|e| Error::io("rename", &to_packs, e))?;
            }
            std::fs::rename(&tmp, to).map_err(|e| Error::io("rename", to, e))?;
            sync_dir(&dir)?;
            Ok(steps)
        });
        if copied.is_err() {
            // Best effort: the hidden files are the copy's alone.
            let _ = std::fs::remove_file(&tmp);
            let _ = std::fs::remove_dir_all(pack_dir(&tmp));
        }
        copied
    }

    /// Delete the store at `path`: its file and its pack directory
    /// (`PATH.packs`). `Ok(false)` if there is no store there.
    ///
    /// The path is resolved as [`StoreOptions::open`] resolves it (a
    /// link removes the store it points to). The store is opened
    /// read-only, then for writing, first, so that nothing else is
    /// deleted: a file that is not already a store (empty, damaged, or
    /// of another kind) is the open's error, and a store another process
    /// writes is [`Error::Locked`]; nothing is deleted then — remove such
    /// a file by hand. The pack directory goes first: a crash in between
    /// leaves the store file, which `remove_store` removes when run
    /// again.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// let path = dir.path().join("run.ckpt");
    /// CheckpointStore::open(&path)?.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// assert!(CheckpointStore::remove_store(&path)?);
    /// assert!(!path.exists() && !CheckpointStore::remove_store(&path)?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn remove_store(path: impl AsRef<Path>) -> Result<bool> {
        let path = &crate::file::real_path(path.as_ref())?;
        let packs = pack_dir(path);
        if !path.exists() {
            return Ok(false);
        }
        // A store already (read-only: nothing is initialised), and no
        // writer holds it (writable).
        drop(StoreOptions::new().open_read_only(path)?);
        drop(StoreOptions::new().open(path)?);
        if packs.exists() {
            std::fs::remove_dir_all(&packs).map_err(|e| Error::io("remove", &packs, e))?;
        }
        std::fs::remove_file(path).map_err(|e| Error::io("remove", path, e))?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            sync_dir(dir)?;
        }
        Ok(true)
    }

    /// Commit each of this store's steps, and its pins, into `copy`.
    fn copy_steps(&self, copy: &CheckpointStore) -> Result<Vec<u64>> {
        let mut copied = Vec::new();
        for step in self.steps()? {
            let done = self.with_step(step, |ckpt, info, data| {
                let entries = entries(&info);
                let mut read = |entry: &Incoming| {
                    data.read(&entry.name)?.ok_or_else(|| {
                        Error::corrupt(Some(step), format!("{} is not in its step", entry.name))
                    })
                };
                super::commit::put_streamed(&copy.db, ckpt, &entries, &mut read)
            })?;
            if done.is_some() {
                copied.push(step);
            }
        }
        for step in self.pinned()? {
            if copied.binary_search(&step).is_ok() {
                copy.pin(step)?;
            }
        }
        Ok(copied)
    }
}

/// The blobs and tensors of a step, as a streamed commit takes them.
fn entries(info: &StepInfo) -> Vec<Incoming> {
    let blobs = info.blobs.iter().map(|(name, len)| Incoming {
        name: name.clone(),
        len: *len,
        tensor: None,
    });
    let tensors = info.tensors.iter().map(|(name, t)| Incoming {
        name: name.clone(),
        len: t.bytes,
        tensor: Some((t.dtype, t.shape.clone())),
    });
    blobs.chain(tensors).collect()
}
