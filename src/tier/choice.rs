//! Pure functions of what a tier's ranks hold: which saves the job can
//! restore whole, the one to restore, who serves each shard, and which
//! steps a rank keeps. No I/O: unit-tested at 10,000 simulated ranks.

use std::collections::{BTreeSet, HashMap};

use super::names::{StoreKind, StoreName};
use super::record::{Record, SaveKey};
use crate::ContentDigest;

/// A store step held by a rank of the loading job: `store`'s step `step`,
/// of content `digest`, in the directory of rank `holder`'s node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holding {
    /// The rank that holds it (and would serve it).
    pub holder: u32,
    /// Which store: a rank's own shards or copies of them.
    pub store: StoreName,
    /// The step.
    pub step: u64,
    /// Its content digest.
    pub digest: ContentDigest,
}

/// Where a save stands against what the job holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evaluation {
    /// The save.
    pub key: SaveKey,
    /// Its place in the order of saves ([`Record::order`]).
    pub order: (u64, u64, u64),
    /// The ranks of the save whose shard no rank holds with the recorded
    /// digest (empty: the save can be restored whole).
    pub missing: Vec<u32>,
}

/// The holdings of a job indexed by (step, source rank).
pub struct Held<'a> {
    by_shard: HashMap<(u64, u32), Vec<&'a Holding>>,
}

impl<'a> Held<'a> {
    /// Index `holdings`.
    pub fn new(holdings: &'a [Holding]) -> Self {
        let mut by_shard: HashMap<(u64, u32), Vec<&Holding>> = HashMap::new();
        for h in holdings {
            by_shard.entry((h.step, h.store.rank)).or_default().push(h);
        }
        Self { by_shard }
    }

    /// The ranks holding rank `src`'s shard of the save `record`: those
    /// with it in their own store first, then those with a copy, each by
    /// rank, each once.
    pub fn holders(&self, record: &Record, src: u32) -> Vec<u32> {
        let Some(digest) = record.digests.get(src as usize) else {
            return Vec::new();
        };
        let mut found: Vec<(bool, u32)> = self
            .by_shard
            .get(&(record.step, src))
            .into_iter()
            .flatten()
            .filter(|h| h.digest == *digest)
            .map(|h| (h.store.kind != StoreKind::Own, h.holder))
            .collect();
        found.sort_unstable();
        let mut seen = BTreeSet::new();
        found
            .into_iter()
            .filter_map(|(_, r)| seen.insert(r).then_some(r))
            .collect()
    }

    /// For each rank of the save `record`, the ranks holding its shard.
    pub fn all_holders(&self, record: &Record) -> Vec<Vec<u32>> {
        (0..record.world_size())
            .map(|src| self.holders(record, src))
            .collect()
    }

    /// Whether the save `record` can be restored whole, and which ranks'
    /// shards are missing if not.
    pub fn evaluate(&self, record: &Record) -> Evaluation {
        let missing = (0..record.world_size())
            .filter(|&src| {
                let digest = &record.digests[src as usize];
                !self
                    .by_shard
                    .get(&(record.step, src))
                    .is_some_and(|hs| hs.iter().any(|h| h.digest == *digest))
            })
            .collect();
        Evaluation {
            key: record.key(),
            order: record.order(),
            missing,
        }
    }
}

/// The save to restore among `evaluations` (the records of every rank's
/// directory, evaluated; duplicates allowed): the one made last that can
/// be restored whole (of step `step` only, if given); and the saves made
/// after it that cannot, the last made first, once each.
pub fn pick(
    evaluations: &[Evaluation],
    step: Option<u64>,
) -> (Option<Evaluation>, Vec<Evaluation>) {
    let wanted = |e: &&Evaluation| step.is_none_or(|s| e.key.0 == s);
    let best = evaluations
        .iter()
        .filter(wanted)
        .filter(|e| e.missing.is_empty())
        .max_by_key(|e| e.order)
        .cloned();
    let mut newer: Vec<Evaluation> = evaluations
        .iter()
        .filter(wanted)
        .filter(|e| !e.missing.is_empty())
        .filter(|e| best.as_ref().is_none_or(|b| e.order > b.order))
        .cloned()
        .collect();
    newer.sort_by(|a, b| b.order.cmp(&a.order).then(a.missing.cmp(&b.missing)));
    newer.dedup_by(|a, b| a.key == b.key);
    (best, newer)
}

/// The steps a rank keeps after a save: those of its `keep` records made
/// last (in the order of saves: the save just recorded is always among
/// them), and of every record due for the bucket and not there yet
/// (`in_bucket` says). Every other step goes from the rank's stores.
pub fn retain<'r>(
    records: impl IntoIterator<Item = &'r Record>,
    keep: usize,
    in_bucket: impl Fn(&Record) -> bool,
) -> BTreeSet<u64> {
    let mut all: Vec<&Record> = records.into_iter().collect();
    all.sort_by_key(|r| r.order());
    let last = all.len().saturating_sub(keep);
    let mut out: BTreeSet<u64> = all[last..].iter().map(|r| r.step).collect();
    out.extend(
        all.iter()
            .filter(|r| r.upload && !in_bucket(r))
            .map(|r| r.step),
    );
    out
}
