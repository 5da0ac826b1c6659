//! What the store remembers of the buckets it replicates to: read and
//! written by pushes (the remote layer), in the store's own transactions.

use super::CheckpointStore;
use crate::db::TxnKind;
use crate::engine::{Pushed, Remembered};
use crate::Result;

impl CheckpointStore {
    /// What the store remembers of the bucket at `url`, if anything.
    pub(crate) fn remembered(&self, url: &str) -> Result<Option<Remembered>> {
        let what = || format!("reading what the store remembers of {url}");
        self.db.read(&what, |view| view.remembered(url))
    }

    /// Remember `steps` of the bucket at `url` as of its
    /// collection `mark` (with `fresh`, instead of what was remembered).
    /// A read-only store remembers nothing: what it remembers is only a
    /// shortcut, and its pushes list the bucket instead.
    pub(crate) fn remember(
        &self,
        url: &str,
        mark: &[u8],
        fresh: bool,
        steps: &[(u64, Pushed)],
    ) -> Result<()> {
        if self.is_read_only() {
            return Ok(());
        }
        let what = || format!("remembering what the bucket {url} holds");
        self.db.write("push", &what, TxnKind::Memo, |engine| {
            engine.remember(url, mark, fresh, steps)
        })
    }
}
