//! What a push knows of the bucket before it uploads anything, in one of
//! two ways:
//!
//! - **Remembered**: while the bucket's collection mark is the one the
//!   store remembers (no garbage collection deleted anything since the
//!   store last listed the bucket), the push trusts what the store
//!   remembers and lists nothing: a step it knows the bucket holds whole
//!   is skipped unread, any other is pushed.
//! - **Listed**: otherwise (or for a repair) the push lists the bucket's
//!   commits, deletion markers, manifests, chunks and packs, and judges
//!   each step from that and from what the store remembered under the
//!   older mark.

use std::collections::{BTreeMap, HashSet};

use crate::engine::{Pushed, Remembered};
use crate::format::manifest::Hash;
use crate::remote::read::Reader;
use crate::remote::Commit;
use crate::Result;

/// What a push knows of the bucket.
pub(crate) enum Knowledge {
    /// What the store remembers: the bucket's newest commit of each step
    /// it knows of, and whether it holds the store's version whole.
    Remembered(BTreeMap<u64, Pushed>),
    /// A listing of the bucket.
    Listed(Box<Listing>),
}

/// The bucket as listed, and what the store remembered of it before.
pub(crate) struct Listing {
    /// The newest commit of each step.
    newest: BTreeMap<u64, Commit>,
    /// Steps (and manifests) retention deleted: not pushed again.
    deleted: HashSet<(u64, Hash)>,
    manifests: HashSet<(u64, Hash)>,
    /// Chunk objects (steps pushed before bucket format 3).
    chunks: HashSet<Hash>,
    packs: HashSet<Hash>,
    /// What the store remembered, under an older mark.
    remembered: BTreeMap<u64, Pushed>,
    /// Trust nothing the store remembers: check every step.
    repair: bool,
}

/// What to do with a step, once its content is known.
pub(crate) enum Verdict {
    /// The bucket holds it whole under this commit (or retention deleted
    /// it there).
    Present(Commit),
    /// Push it; the bucket's newest commit of the step, if it has one.
    Push(Option<Commit>),
}

impl Knowledge {
    /// What the push knows: the store's memory `remembered` if it was
    /// made under the bucket's mark `mark` (and this is no repair), else a
    /// listing.
    pub(crate) fn of(
        remote: &Reader<'_>,
        remembered: Option<Remembered>,
        mark: &[u8],
        repair: bool,
    ) -> Result<Knowledge> {
        match remembered {
            Some(known) if known.mark == mark && !repair => Ok(Knowledge::Remembered(known.steps)),
            other => Ok(Knowledge::Listed(Box::new(Listing {
                // Ascending: the last commit of a step is its newest.
                newest: remote.commits()?.into_iter().map(|c| (c.step, c)).collect(),
                deleted: remote.bucket.deleted()?.into_iter().collect(),
                manifests: remote.bucket.manifest_names()?,
                chunks: remote.bucket.chunk_hashes()?,
                packs: remote.bucket.pack_names()?,
                remembered: other.map(|k| k.steps).unwrap_or_default(),
                repair,
            }))),
        }
    }

    /// Whether it comes from a listing (the store then remembers the
    /// bucket afresh).
    pub(crate) fn is_listed(&self) -> bool {
        matches!(self, Knowledge::Listed(_))
    }

    /// After a listing, what the store remembers to start with: the
    /// bucket's newest commit of each step, not known whole.
    pub(crate) fn bucket_commits(&self) -> BTreeMap<u64, Pushed> {
        let Knowledge::Listed(l) = self else {
            return BTreeMap::new();
        };
        let not_whole = |c: &Commit| Pushed {
            generation: c.generation,
            hash: c.hash,
            whole: false,
        };
        l.newest.iter().map(|(&s, c)| (s, not_whole(c))).collect()
    }

    /// The commit under which the bucket holds the store's version of
    /// `step` whole, if that is known without reading the step: the store
    /// remembers pushing it, and (after a listing) that commit is still
    /// the newest and its manifest is there, or retention deleted it.
    pub(crate) fn whole_unread(&self, step: u64) -> Option<Pushed> {
        match self {
            Knowledge::Remembered(steps) => steps.get(&step).filter(|p| p.whole).copied(),
            Knowledge::Listed(l) => {
                let p = *l.remembered.get(&step).filter(|p| p.whole)?;
                if l.deleted.contains(&(step, p.hash)) {
                    return Some(p);
                }
                let newest = l.newest.get(&step)?;
                let current = (newest.generation, newest.hash) == (p.generation, p.hash);
                let there = l.manifests.contains(&(step, p.hash));
                (current && there && !l.repair).then_some(p)
            }
        }
    }

    /// What to do with `step`, whose manifest in formats 1 and 2 (chunks
    /// as objects) hashes to `plain` and whose chunks are `chunks` (hash,
    /// length).
    pub(crate) fn verdict(&self, step: u64, plain: &Hash, chunks: &[(Hash, u64)]) -> Verdict {
        let l = match self {
            Knowledge::Remembered(steps) => {
                return Verdict::Push(steps.get(&step).map(|p| commit_of(step, p)))
            }
            Knowledge::Listed(l) => l,
        };
        let newest = l.newest.get(&step).copied();
        if l.deleted.contains(&(step, *plain)) {
            let generation = newest.map_or(0, |c| c.generation);
            let hash = *plain;
            return Verdict::Present(Commit {
                step,
                generation,
                hash,
            });
        }
        // Pushed before bucket format 3: whole if its manifest and every
        // chunk object are there.
        if let Some(c) = newest.filter(|c| c.hash == *plain) {
            let chunks_there = chunks.iter().all(|(h, _)| l.chunks.contains(h));
            if l.manifests.contains(&(step, c.hash)) && chunks_there {
                return Verdict::Present(c);
            }
        }
        Verdict::Push(newest)
    }

    /// The bucket's newest commit of the newest step below `step`.
    pub(crate) fn newest_below(&self, step: u64) -> Option<Commit> {
        match self {
            Knowledge::Remembered(steps) => {
                let (&s, p) = steps.range(..step).next_back()?;
                Some(commit_of(s, p))
            }
            Knowledge::Listed(l) => l.newest.range(..step).next_back().map(|(_, c)| *c),
        }
    }

    /// Whether the manifest of `step` of hash `hash` is known to be in the
    /// bucket.
    pub(crate) fn has_manifest(&self, step: u64, hash: &Hash) -> bool {
        match self {
            Knowledge::Remembered(_) => false,
            Knowledge::Listed(l) => l.manifests.contains(&(step, *hash)),
        }
    }

    /// Whether pack `pack`, named by a manifest of the bucket, may be
    /// taken as there: after a listing, if the listing found it; else as
    /// long as the mark holds.
    pub(crate) fn pack_is_there(&self, pack: &Hash) -> bool {
        match self {
            Knowledge::Remembered(_) => true,
            Knowledge::Listed(l) => l.packs.contains(pack),
        }
    }
}

fn commit_of(step: u64, p: &Pushed) -> Commit {
    Commit {
        step,
        generation: p.generation,
        hash: p.hash,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn commit(step: u64, generation: u64, hash: u8) -> Commit {
        Commit {
            step,
            generation,
            hash: [hash; 32],
        }
    }

    /// A listing of a bucket whose newest commits are `newest`.
    fn listed(newest: &[Commit]) -> Listing {
        Listing {
            newest: newest.iter().map(|c| (c.step, *c)).collect(),
            deleted: HashSet::new(),
            manifests: newest.iter().map(|c| (c.step, c.hash)).collect(),
            chunks: HashSet::new(),
            packs: HashSet::new(),
            remembered: BTreeMap::new(),
            repair: false,
        }
    }

    fn present(v: &Verdict) -> Option<Commit> {
        match v {
            Verdict::Present(c) => Some(*c),
            Verdict::Push(_) => None,
        }
    }

    #[test]
    fn a_step_retention_deleted_is_present_by_its_marker() {
        let mut l = listed(&[]);
        l.deleted.insert((3, [7; 32]));
        let k = Knowledge::Listed(Box::new(l));
        assert_eq!(present(&k.verdict(3, &[7; 32], &[])), Some(commit(3, 0, 7)));
        // Other content at that step (a rollback and redo) is pushed.
        assert!(present(&k.verdict(3, &[8; 32], &[])).is_none());
        assert!(present(&k.verdict(4, &[7; 32], &[])).is_none());
    }

    #[test]
    fn a_step_of_chunk_objects_is_present_when_its_manifest_and_chunks_are() {
        let newest = commit(5, 2, 9);
        let mut l = listed(&[newest]);
        let chunks = [([1; 32], 10), ([2; 32], 20)];
        l.chunks.insert([1; 32]);
        let k = Knowledge::Listed(Box::new(l));
        // A chunk missing: pushed again, after the newest commit.
        match k.verdict(5, &[9; 32], &chunks) {
            Verdict::Push(after) => assert_eq!(after, Some(newest)),
            Verdict::Present(c) => panic!("present as {c:?}"),
        }
        let Knowledge::Listed(mut l) = k else {
            unreachable!()
        };
        l.chunks.insert([2; 32]);
        let k = Knowledge::Listed(l);
        assert_eq!(present(&k.verdict(5, &[9; 32], &chunks)), Some(newest));
        // Another manifest than the newest commit's: pushed.
        assert!(present(&k.verdict(5, &[1; 32], &chunks)).is_none());
    }

    #[test]
    fn what_a_store_remembers_is_pushed_unless_known_whole() {
        let pushed = |whole| Pushed {
            generation: 1,
            hash: [4; 32],
            whole,
        };
        let k = Knowledge::Remembered([(2, pushed(true)), (3, pushed(false))].into());
        assert_eq!(k.whole_unread(2).map(|p| p.hash), Some([4; 32]));
        assert!(k.whole_unread(3).is_none() && k.whole_unread(4).is_none());
        match k.verdict(3, &[4; 32], &[]) {
            Verdict::Push(after) => assert_eq!(after, Some(commit(3, 1, 4))),
            Verdict::Present(c) => panic!("present as {c:?}"),
        }
        assert_eq!(k.newest_below(3), Some(commit(2, 1, 4)));
    }
}
