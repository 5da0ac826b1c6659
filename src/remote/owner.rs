//! Which store's run a prefix holds: `owner/<store uuid>`, written by the
//! first push into the prefix. A push from another store is refused, so two
//! runs never mix their steps in one prefix; global steps' shards are the
//! one case of several writers, by design, and claim nothing.
//!
//! No conditional PUT is assumed: two stores pushing first at once both
//! write their claim and then list the claims; the earliest written (ties
//! broken by name) holds the prefix, every claimant sees the same one, and
//! the others withdraw theirs.

use super::layout::OWNER;
use super::locks::lock_body;
use super::Remote;
use crate::{CheckpointStore, Error, Result};

impl Remote {
    /// The store (its [`CheckpointStore::store_id`]) whose run this prefix
    /// holds, or `None` if no push has claimed it (a bucket of 0.3, or an
    /// empty one).
    pub fn owner(&self) -> Result<Option<String>> {
        let mut claims = self.list_under(&self.layout.folder(OWNER), 1)?;
        claims.sort_by(|(a, ma), (b, mb)| (ma.last_modified, a).cmp(&(mb.last_modified, b)));
        Ok(claims
            .into_iter()
            .next()
            .map(|(mut name, _)| name.remove(0)))
    }

    /// Claim the prefix for the store `id` unless it holds another run.
    ///
    /// # Errors
    /// [`Error::PrefixOwned`] when another store's run is there.
    pub(crate) fn claim(&self, id: &str) -> Result<()> {
        let (owner, claimed) = if let Some(owner) = self.owner()? {
            (owner, false)
        } else {
            self.put(&self.layout.owner(id), lock_body())?;
            (self.owner()?.unwrap_or_else(|| id.to_owned()), true)
        };
        if owner == id {
            return Ok(());
        }
        if claimed {
            self.delete(&self.layout.owner(id))?;
        }
        Err(Error::PrefixOwned {
            url: self.url.clone(),
            owner,
            ours: id.to_owned(),
        })
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
    /// first.push(&remote)?;
    ///
    /// let second = CheckpointStore::open(dir.path().join("b.ckpt"))?;
    /// second.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 2))?;
    /// assert!(second.push(&remote).is_err()); // the prefix holds the first run
    /// remote.adopt(&second)?;
    /// assert_eq!(second.push(&remote)?.steps_pushed, vec![2]);
    /// assert!(first.push(&remote).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn adopt(&self, store: &CheckpointStore) -> Result<()> {
        let id = store.store_id()?;
        self.put(&self.layout.owner(&id), lock_body())?;
        for (name, _) in self.list_under(&self.layout.folder(OWNER), 1)? {
            if name[0] != id {
                self.delete(&self.layout.folder(OWNER).join(name[0].as_str()))?;
            }
        }
        Ok(())
    }
}
