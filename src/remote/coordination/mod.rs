//! Coordination without conditional PUT: push and collection locks with
//! their grace period (`locks`), the claim of a prefix by one store's
//! run (`owner`), the collection mark (`mark`) and what a remote
//! remembers under it (`known`).

pub(crate) mod known;
pub(crate) mod locks;
pub(crate) mod mark;
pub(crate) mod owner;

use std::sync::Mutex;
use std::time::Duration;

use crate::remote::bucket::Bucket;
use crate::remote::Remote;
use crate::{CheckpointStore, Result};

/// What every part of a [`Remote`] shares of its bucket: the objects, the
/// grace period of its locks, and what it remembers of the packs. The
/// parts' types build on it, each on the one below (a [`Reader`] on this, a
/// [`Writer`] on a reader, the [`Collector`] and the [`Coordinator`] on a
/// writer): each derefs to the one it builds on, so a part can call the
/// parts below it and no part can call one above.
///
/// [`Reader`]: crate::remote::read::Reader
/// [`Writer`]: crate::remote::write::Writer
/// [`Collector`]: crate::remote::gc::Collector
/// [`Coordinator`]: crate::remote::global::Coordinator
#[derive(Clone, Copy)]
pub(crate) struct Shared<'r> {
    /// The objects: every part reads and writes the bucket through it.
    pub(crate) bucket: &'r Bucket,
    /// How long a lock holds without being written again.
    pub(crate) grace: Duration,
    /// Where chunks this remote wrote or read lie in the bucket's packs.
    pub(crate) known: &'r Mutex<known::Known>,
}

impl Remote {
    /// The store (its [`CheckpointStore::store_id`]) whose run this prefix
    /// holds, or `None` if no push has claimed it (a bucket of 0.3, or an
    /// empty one).
    pub fn owner(&self) -> Result<Option<String>> {
        self.shared().owner()
    }

    /// Make this prefix hold `store`'s run from now on, whoever held it: for
    /// a store restored from a backup, or a run continued by a new store.
    /// Pushes from the store that held it are refused from then on.
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Remote};
    /// # let dir = tempfile::tempdir()?;
    /// let remote = Remote::open(&format!("file://{}", dir.path().join("bucket").display()))?;
    /// let first = CheckpointStore::open(dir.path().join("a.ckpt"))?;
    /// first.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// remote.push(&first)?;
    ///
    /// let second = CheckpointStore::open(dir.path().join("b.ckpt"))?;
    /// second.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 2))?;
    /// assert!(remote.push(&second).is_err()); // the prefix holds the first run
    /// remote.adopt(&second)?;
    /// assert_eq!(remote.push(&second)?.steps_pushed, vec![2]);
    /// assert!(remote.push(&first).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn adopt(&self, store: &CheckpointStore) -> Result<()> {
        self.shared().adopt(store)
    }
}
