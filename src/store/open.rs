//! Opening a store: the `open` methods of [`StoreOptions`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::CheckpointStore;
use super::StoreOptions;
use crate::db::backend::{DynBackend, Source};
use crate::db::Db;
use crate::{Durability, Error, Result};

impl StoreOptions {
    /// Open the store at `path` for reading and writing, creating it if it
    /// does not exist.
    ///
    /// The store is its real path, resolved once here: absolute, with every
    /// symbolic link followed ([`CheckpointStore::path`] returns it). Its
    /// pack directory is named after that path, so a later `chdir`, or a
    /// link repointed at another run, changes nothing, and two names of
    /// one file are one store. A link to a file not there yet creates its
    /// target; the directory of a new store must exist.
    pub fn open(self, path: impl AsRef<Path>) -> Result<CheckpointStore> {
        let path = crate::file::real_path(path.as_ref())?;
        self.open_source(Source::Path(path))
    }

    /// Open a store kept in a custom redb [`StorageBackend`](redb::StorageBackend)
    /// instead of a file: for fault injection in tests, or storage of your
    /// own. `open` makes a fresh backend each time the store opens its
    /// database: once now, and again after an I/O error (redb refuses all
    /// work after one until it is reopened). `name` stands for the store in
    /// messages.
    ///
    /// ```
    /// use ckptstore::{ComputationGraphStore, GradientCheckpoint, StoreOptions};
    /// use redb::backends::InMemoryBackend;
    ///
    /// let store = StoreOptions::new()
    ///     .shared(false) // an in-memory backend has no locks to share
    ///     .open_with_backend("in-memory", || Ok(InMemoryBackend::new()))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// assert_eq!(store.steps()?, vec![1]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn open_with_backend<B, F>(
        self,
        name: impl Into<PathBuf>,
        open: F,
    ) -> Result<CheckpointStore>
    where
        B: redb::StorageBackend,
        F: Fn() -> std::io::Result<B> + Send + Sync + 'static,
    {
        let factory = move || open().map(|b| DynBackend(Box::new(b)));
        self.open_source(Source::Backend(name.into(), Arc::new(factory), None))
    }

    pub(super) fn open_source(self, source: Source) -> Result<CheckpointStore> {
        self.settings.validate()?;
        if self.settings.shared && self.settings.durability == Durability::Eventual {
            return Err(Error::InvalidOptions(
                "Durability::Eventual needs shared(false): readers in other processes \
                 only see durable commits"
                    .into(),
            ));
        }
        let store = CheckpointStore::from_db(Db::open(source, self.settings)?);
        #[cfg(feature = "remote")]
        let store = store.start_replication(self.replicate_to.as_deref())?;
        Ok(store)
    }

    /// Open an existing store read-only. With a shared writer (the default)
    /// in another process, the reader sees each step that writer commits.
    /// Its path is resolved as [`open`](Self::open)'s is.
    pub fn open_read_only(self, path: impl AsRef<Path>) -> Result<CheckpointStore> {
        self.settings.validate()?;
        let path = crate::file::real_path(path.as_ref())?;
        let db = Db::open_read_only(path, self.settings)?;
        Ok(CheckpointStore::from_db(db))
    }
}
