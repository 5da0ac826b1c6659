//! What a [`Remote`](crate::Remote) remembers of its bucket's packs: where the chunks it
//! wrote or read lie, under the collection mark of the time
//! ([`mark`](super::mark)); a new mark makes it forget. Writers
//! deduplicate against it, readers add what they read to it.

use std::collections::HashMap;

use crate::format::manifest::Hash;
use crate::remote::coordination::Shared;
use crate::remote::format::manifest::RemoteManifest;
use crate::remote::format::pack_format::Location;
use crate::{Error, Result};

/// What a [`Remote`](crate::Remote) knows is in its bucket: where chunks lie, while the
/// bucket's collection mark is `mark`.
#[derive(Debug, Default)]
pub(crate) struct Known {
    mark: Option<Vec<u8>>,
    at: HashMap<Hash, Location>,
    /// The manifests (step, hash) whose chunks `at` has learned.
    learned: std::collections::HashSet<(u64, Hash)>,
}

impl Known {
    /// The memory, emptied if the bucket's mark is no longer `mark`.
    pub(crate) fn under(&mut self, mark: &[u8]) -> &mut HashMap<Hash, Location> {
        if self.mark.as_deref() != Some(mark) {
            self.at.clear();
            self.learned.clear();
            self.mark = Some(mark.to_vec());
        }
        &mut self.at
    }

    /// Note that the chunks of the manifest of `step` of hash `hash` are
    /// known (while the mark is `mark`).
    pub(crate) fn learned(&mut self, mark: &[u8], step: u64, hash: Hash) {
        self.under(mark);
        self.learned.insert((step, hash));
    }

    /// Whether the chunks of that manifest are known.
    pub(crate) fn has_learned(&mut self, mark: &[u8], step: u64, hash: Hash) -> bool {
        self.under(mark);
        self.learned.contains(&(step, hash))
    }

    /// Forget everything (a repair trusts nothing it did not list).
    pub(crate) fn clear(&mut self) {
        self.at.clear();
        self.learned.clear();
    }

    /// Forget every chunk of the packs `gone` (and which manifests were
    /// learned: one of them named a pack that is gone).
    pub(crate) fn forget(&mut self, gone: &[Hash]) {
        self.at.retain(|_, loc| !gone.contains(&loc.pack));
        self.learned.clear();
    }
}

impl Shared<'_> {
    /// What this remote knows of its bucket's packs.
    pub(crate) fn known(&self) -> Result<std::sync::MutexGuard<'_, Known>> {
        self.known
            .lock()
            .map_err(|_| Error::corrupt(None, "a thread panicked while it held the pack memory"))
    }

    /// Learn where the chunks of `manifests` (of a complete step just
    /// opened, while the bucket's collection mark was `mark`) lie: a save
    /// after a load deduplicates against what it loaded.
    pub(crate) fn learn(&self, manifests: &[RemoteManifest], mark: &[u8]) -> Result<()> {
        for m in manifests {
            self.learn_where(m, mark, &|_| true)?;
        }
        Ok(())
    }

    /// Learn where the chunks of `m` lie that lie in packs `there` keeps.
    pub(crate) fn learn_where(
        &self,
        m: &RemoteManifest,
        mark: &[u8],
        there: &dyn Fn(&Hash) -> bool,
    ) -> Result<()> {
        let mut known = self.known()?;
        let known = known.under(mark);
        known.extend(m.locations().into_iter().filter(|(_, l)| there(&l.pack)));
        Ok(())
    }
}
