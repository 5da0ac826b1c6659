//! The extension point background replication plugs into: the store holds
//! a [`Replication`] (set by `StoreOptions::replicate_to`, in the remote
//! layer), starts it when it opens for writing, and calls it through the
//! database's after-write hook, `flush` and `replication_status`. The
//! store never names the remote layer.

use super::CheckpointStore;
use crate::{ReplicationStatus, Result};

/// Where a store replicates to: starts a [`Replica`] over the store.
pub(crate) trait Replication: Send + Sync + std::fmt::Debug {
    /// Start replicating `store` (a handle of its own on the store's
    /// database, without background threads) in the background.
    fn start(&self, store: CheckpointStore) -> Result<Box<dyn Replica>>;
}

/// A running replication; dropping it stops it.
pub(crate) trait Replica: Send + Sync {
    /// What the database calls after each write transaction commits.
    fn on_write(&self) -> Box<dyn Fn() + Send + Sync>;

    /// Where replication stands.
    fn status(&self, store: &CheckpointStore) -> Result<ReplicationStatus>;

    /// Wait until every write so far is replicated, or report why not.
    fn flush(&self, store: &CheckpointStore) -> Result<()>;
}
