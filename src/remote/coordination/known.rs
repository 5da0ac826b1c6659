//! What a [`Remote`](crate::Remote) remembers of its bucket's packs: where the chunks it
//! wrote or read lie, under the collection mark of the time
//! ([`mark`](super::mark)); a new mark makes it forget. Writers
//! deduplicate against it, readers add what they read to it. A writer
//! relies only on packs this remote wrote or confirmed present and whole
//! itself (`confirmed`): what a reader learned of another writer's pack is
//! checked once (a HEAD) before any save points at it.

use std::collections::{HashMap, HashSet};

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
    learned: HashSet<(u64, Hash)>,
    /// The packs this remote uploaded, or found present and whole, under
    /// `mark`.
    confirmed: HashSet<Hash>,
}

impl Known {
    /// The memory, emptied if the bucket's mark is no longer `mark`.
    pub(crate) fn under(&mut self, mark: &[u8]) -> &mut HashMap<Hash, Location> {
        if self.mark.as_deref() != Some(mark) {
            self.clear();
            self.mark = Some(mark.to_vec());
        }
        &mut self.at
    }

    /// The packs (name, length) holding chunks among `chunks` that this
    /// remote knows of but has not confirmed (under `mark`): what a save
    /// deduplicating against them must check first.
    pub(crate) fn unconfirmed(
        &mut self,
        mark: &[u8],
        chunks: impl Iterator<Item = Hash>,
    ) -> Vec<(Hash, u64)> {
        self.under(mark);
        let mut packs: HashMap<Hash, u64> = HashMap::new();
        for chunk in chunks {
            if let Some(l) = self.at.get(&chunk) {
                if !self.confirmed.contains(&l.pack) {
                    packs.insert(l.pack, l.pack_len);
                }
            }
        }
        let mut packs: Vec<(Hash, u64)> = packs.into_iter().collect();
        packs.sort_unstable();
        packs
    }

    /// Note that `packs` are in the bucket whole (uploaded by this remote,
    /// or checked), while the mark is `mark`.
    pub(crate) fn confirm(&mut self, mark: &[u8], packs: impl Iterator<Item = Hash>) {
        self.under(mark);
        self.confirmed.extend(packs);
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
        self.confirmed.clear();
    }

    /// Forget every chunk of the packs `gone` (and which manifests were
    /// learned: one of them named a pack that is gone).
    pub(crate) fn forget(&mut self, gone: &[Hash]) {
        self.at.retain(|_, loc| !gone.contains(&loc.pack));
        self.confirmed.retain(|p| !gone.contains(p));
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
