//! Packs that are mostly dead, rewritten by a garbage collection.
//!
//! A pack holds the chunks one writer added at one step; once retention
//! deleted that step, the pack stays whole while any kept step needs one
//! of its chunks (a frozen tensor's, say), and the rest is dead space. A
//! collection rewrites a pack more than half of whose bytes are dead (and
//! at least [`MIN_DEAD_BYTES`] of them): the chunks kept steps need are
//! read (each checked against its hash) and packed again, and each step
//! that needs them gets a commit of the next generation whose manifests
//! say where they lie now; its old commit is superseded like a redone
//! step's, so readers that opened it keep reading until the next
//! collection deletes it, and then the old pack. The collection runs under
//! its lock with no push in flight and a new collection mark written, so
//! no writer relies on the old locations.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::format::manifest::{hex, Hash};
use crate::remote::format::layout::{encode, GlobalManifest, ShardName};
use crate::remote::format::manifest::RemoteManifest;
use crate::remote::format::pack_format::Location;
use crate::remote::format::stored::{Stored, Width};
use crate::remote::gc::Collector;
use crate::remote::read::restore::Want;
use crate::remote::read::step::StepManifest;
use crate::remote::write::packs::{format_of, index_of, place_pieces};
use crate::remote::Commit;
use crate::Result;

/// The fewest dead bytes a rewritten pack had.
pub(crate) const MIN_DEAD_BYTES: u64 = 1 << 20;

/// What a repack did.
#[derive(Default)]
pub(crate) struct Repacked {
    pub(crate) packs: u64,
    pub(crate) bytes: u64,
    /// The steps committed again, with what they stand for now.
    pub(crate) steps: Vec<(Commit, StepManifest)>,
}

impl Collector<'_> {
    /// Rewrite the mostly dead packs of the `current` steps (with `young`
    /// shards' manifests, which count as live and are not rewritten).
    pub(crate) fn repack(
        &self,
        current: &[(Commit, StepManifest)],
        young: &[RemoteManifest],
    ) -> Result<Repacked> {
        let all: Vec<&RemoteManifest> = current
            .iter()
            .flat_map(|(_, m)| m.parts())
            .chain(young)
            .collect();
        let doomed = mostly_dead(&all);
        let mut done = Repacked::default();
        if doomed.is_empty() {
            return Ok(done);
        }
        let moved = self.move_live_chunks(&all, &doomed, &mut done)?;
        for (c, m) in current {
            if m.parts().iter().any(|p| names_any(p, &doomed)) {
                done.steps.push(self.recommit(*c, m, &moved)?);
            }
        }
        Ok(done)
    }

    /// Copy the chunks the manifests `all` need from the packs `doomed`
    /// into new packs, one doomed pack at a time (its live chunks read in
    /// coalesced ranged GETs, each checked); where they lie now.
    fn move_live_chunks(
        &self,
        all: &[&RemoteManifest],
        doomed: &HashSet<Hash>,
        done: &mut Repacked,
    ) -> Result<HashMap<Hash, Location>> {
        let mut moved = HashMap::new();
        for pack in doomed {
            let mut live: BTreeMap<Hash, (Location, u64, u64)> = BTreeMap::new();
            for m in all {
                for (hash, len, loc) in chunk_places(m) {
                    if loc.pack == *pack {
                        live.insert(hash, (loc, len, m.step));
                    }
                }
            }
            let what = format!("repacking pack {}", hex(pack));
            let wants: Vec<Want<'_>> = live
                .iter()
                .map(|(hash, &(loc, len, _))| Want {
                    what: &what,
                    object: crate::remote::format::pack_format::Object::Pack(*pack),
                    at: Some(loc.at),
                    len: usize::try_from(len).unwrap_or(usize::MAX),
                    hash: *hash,
                    stored: loc.stored,
                })
                .collect();
            let step = live.values().next().map_or(0, |&(_, _, s)| s);
            let bytes = self.fetch(step, &wants, &mut |_| {})?;
            let pieces: Vec<(Hash, u64)> = live.iter().map(|(h, &(_, n, _))| (*h, n)).collect();
            let packs = place_pieces(&pieces, |_| false, self.pack_bytes);
            done.packs += packs.len() as u64;
            // Each chunk stored again in the form it was found in: a
            // collection never makes a step unreadable to a reader that
            // read it before (a format-3 step stays format 3).
            let found: HashMap<Hash, Width> = live
                .iter()
                .filter_map(|(h, (loc, _, _))| match loc.stored {
                    Stored::Zstd { width, .. } => Some((*h, width)),
                    Stored::Raw => None,
                })
                .collect();
            let placed = self.upload_packs(
                &pieces,
                packs,
                &|h| found.get(h).copied(),
                &mut |i| Ok(bytes[i].clone()),
                &mut |n| {
                    done.bytes += n;
                    Ok(())
                },
            )?;
            moved.extend(placed.into_iter().map(|(h, _, l)| (h, l)));
        }
        Ok(moved)
    }

    /// Commit `c`'s step again with its chunks where `moved` says: new
    /// manifests (and shard manifests) under a commit of the next
    /// generation. The latest-step hint is left as it is (an older step
    /// committed again is not the newest).
    fn recommit(
        &self,
        c: Commit,
        m: &StepManifest,
        moved: &HashMap<Hash, Location>,
    ) -> Result<(Commit, StepManifest)> {
        let step = c.step;
        let (bytes, hash, now) = match m {
            StepManifest::Single(one) => {
                let one = relocated(one, moved)?;
                let (bytes, hash) = encode(step, &one)?;
                (bytes, hash, StepManifest::Single(one))
            }
            StepManifest::Sharded { shards, ids } => {
                let (mut new_shards, mut new_ids) = (Vec::new(), Vec::new());
                for (shard, id) in shards.iter().zip(ids) {
                    let shard = relocated(shard, moved)?;
                    let (bytes, hash) = encode(step, &shard)?;
                    let id = ShardName { hash, ..*id };
                    self.bucket
                        .put(&self.bucket.layout.shard(step, &id), bytes)?;
                    new_shards.push(shard);
                    new_ids.push(id);
                }
                let global = GlobalManifest::of(step, &new_ids);
                let (bytes, hash) = encode(step, &global)?;
                let now = StepManifest::Sharded {
                    shards: new_shards,
                    ids: new_ids,
                };
                (bytes, hash, now)
            }
        };
        let commit = Commit::after(Some(c), step, hash);
        self.put_manifest_and_commit(&commit, bytes)?;
        Ok((commit, now))
    }
}

/// The packs more than half of whose bytes, and at least
/// [`MIN_DEAD_BYTES`], none of `all` needs.
fn mostly_dead(all: &[&RemoteManifest]) -> HashSet<Hash> {
    let mut size: HashMap<Hash, u64> = HashMap::new();
    let mut live: HashMap<Hash, HashSet<(u64, u64)>> = HashMap::new();
    for m in all {
        for (_, len, loc) in chunk_places(m) {
            size.insert(loc.pack, loc.pack_len);
            live.entry(loc.pack)
                .or_default()
                .insert((loc.at, loc.stored.len(len)));
        }
    }
    size.into_iter()
        .filter(|(pack, len)| {
            let used: u64 = live[pack].iter().map(|(_, n)| n).sum();
            let dead = len.saturating_sub(used);
            dead > used && dead >= MIN_DEAD_BYTES
        })
        .map(|(pack, _)| pack)
        .collect()
}

/// Each chunk of `m` that lies in a pack: its hash, length and location.
fn chunk_places(m: &RemoteManifest) -> Vec<(Hash, u64, Location)> {
    let at: HashMap<Hash, Location> = m.locations().into_iter().collect();
    m.chunk_lengths()
        .into_iter()
        .filter_map(|(hash, len)| Some((hash, len, *at.get(&hash)?)))
        .collect()
}

/// Whether `m` needs any of the packs `doomed`.
fn names_any(m: &RemoteManifest, doomed: &HashSet<Hash>) -> bool {
    m.locations().iter().any(|(_, l)| doomed.contains(&l.pack))
}

/// `m` with its chunks where `moved` says, the others where they were.
fn relocated(m: &RemoteManifest, moved: &HashMap<Hash, Location>) -> Result<RemoteManifest> {
    if !m.format.has_packs() {
        return Ok(m.clone());
    }
    let old: HashMap<Hash, Location> = m.locations().into_iter().collect();
    let locate = |h: &Hash| moved.get(h).or_else(|| old.get(h)).copied();
    let order = m.chunk_lengths().into_iter().map(|(h, _)| h);
    let (packs, index) = index_of(order, locate)
        .ok_or_else(|| crate::Error::corrupt(Some(m.step), "a chunk in no pack while repacking"))?;
    let mut m = m.clone();
    m.format = format_of(&index);
    (m.packs, m.index) = (Some(packs), Some(index));
    m.check_to_write(m.step)?;
    Ok(m)
}
