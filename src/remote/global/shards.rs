//! Global steps of N ranks: each rank uploads its shard of a step (chunks,
//! then its shard manifest); whichever rank finds all N shards there
//! writes the step's manifest (the list of shards) and its commit. No rank
//! waits for another and nothing coordinates them: every object is
//! write-once, the step's manifest is a function of the shards it lists
//! (so ranks finishing together write the same bytes), and readers count a
//! step only when its commit names N shards that are all there and whole.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::engine::hashing::with_known_hashes;
use crate::engine::plan::Plan;
use crate::format::manifest::{ChunkRef, Hash};
use crate::remote::coordination::locks::Lock;
use crate::remote::format::hash::HexHash;
use crate::remote::format::hash::{SaveId, ShardHash};
use crate::remote::format::layout::{encode, ShardName, MAX_WORLD_SIZE};
use crate::remote::format::manifest::{RemoteManifest, RemotePacked};
use crate::remote::global::Coordinator;
use crate::remote::read::step::StepManifest;
use crate::remote::BucketError;
use crate::remote::Commit;
use crate::step::{Step, StepRef};
use crate::{Error, Result};

/// What [`Remote::commit_shard`](crate::Remote::commit_shard) did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardInfo {
    /// The step.
    pub step: u64,
    /// This shard's rank.
    pub rank: u32,
    /// The number of ranks.
    pub world_size: u32,
    /// Bytes of chunks uploaded, as sent (compressed where a chunk was
    /// stored compressed: [`Remote::with_compression`](crate::Remote::with_compression)).
    pub bytes_uploaded: u64,
    /// Bytes of chunks (their own lengths) not uploaded because this remote knows the bucket
    /// holds them (it wrote or loaded them, at any step or rank).
    pub bytes_skipped: u64,
    /// Whether the step is complete: this call found every shard there and
    /// the step's commit written (by it or another rank).
    pub complete: bool,
    /// Time from this shard landing to the end of the call: looking for the
    /// other shards and, when all are there, writing the step's commit.
    pub finalize: Duration,
    /// The shard's name: the hash of its manifest (what
    /// [`Remote::commit_global`](crate::Remote::commit_global) takes).
    pub shard: ShardHash,
}

/// Which ranks of a step's newest save have landed
/// ([`Remote::shards`](crate::Remote::shards)).
///
/// A save is the shards of one rank-local save ([`SaveId`]), or the
/// coordinated shards of one world size. The newest save is the one whose
/// latest whole shard landed last: a relaunch's shards are never counted
/// with those of the save that died before it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardStatus {
    /// The step.
    pub step: u64,
    /// The number of ranks of the newest save (with no whole shard, the
    /// smallest its shards' names say).
    pub world_size: Option<u32>,
    /// The rank-local save the newest save is; `None` for a coordinated
    /// save.
    pub save: Option<SaveId>,
    /// How many saves have whole shards under the step (more than one:
    /// the others were given up or died; `gc` collects their shards).
    pub saves: usize,
    /// Ranks of the newest save whose shard is there and whole, ascending.
    pub landed: Vec<u32>,
    /// Ranks of `0..world_size` without one in the newest save, ascending.
    pub missing: Vec<u32>,
    /// Every world size the step's shards give: more than one is an error
    /// of the job that wrote them.
    pub world_sizes: Vec<u32>,
    /// Whether the step is a complete global step.
    pub complete: bool,
}

impl Coordinator<'_> {
    /// Check a shard's arguments as every shard write does.
    pub(crate) fn check_shard_args(
        step: u64,
        rank: u32,
        world_size: u32,
        ckpt: StepRef<'_>,
    ) -> Result<()> {
        let invalid = |reason: String| Error::InvalidCheckpoint { step, reason };
        if rank >= world_size {
            return Err(invalid(format!(
                "rank {rank} of {world_size} ranks: ranks are 0..{world_size}"
            )));
        }
        if ckpt.step() != step {
            return Err(invalid(format!(
                "the checkpoint is of step {}",
                ckpt.step()
            )));
        }
        if world_size > MAX_WORLD_SIZE {
            return Err(invalid(format!(
                "{world_size} ranks: a global step has at most {MAX_WORLD_SIZE}"
            )));
        }
        ckpt.validate()
    }

    /// Upload a shard's chunks, then as `then` says its manifest, and the
    /// step's commit if every rank's shard is there.
    pub(crate) fn put_shard(
        &self,
        step: u64,
        rank: u32,
        world_size: u32,
        plan: &Plan<'_>,
        lock: &mut Lock,
        then: &ShardUpload,
    ) -> Result<ShardInfo> {
        let (mut manifest, mut pieces, packed) = shard_manifest(plan)?;
        pieces.extend(packed);
        let lengths: Vec<(Hash, u64)> = pieces.iter().map(|(h, b)| (*h, b.len() as u64)).collect();
        // Copied only when its pack is uploaded: the packs in flight are
        // in memory, not the shard.
        let mut read = |i: usize| Ok(bytes::Bytes::copy_from_slice(pieces[i].1));
        let mark = self.collection_mark()?;
        let widths = self.widths([&manifest]);
        let packed = self.pack(&lengths, &widths, &mut read, &mark, lock, &mut |_| Ok(()))?;
        let (total, uploaded) = (
            lengths.iter().map(|(_, n)| n).sum::<u64>(),
            packed.bytes_uploaded,
        );
        let skipped = total.saturating_sub(packed.raw_bytes_uploaded);
        manifest.format = packed.format;
        (manifest.packs, manifest.index) = (Some(packed.packs), Some(packed.index));
        let save = then.save().map(|s| HexHash(s.0));
        manifest.save = save.map(Box::new);
        manifest.check_to_write(step)?;
        let (bytes, hash) = encode(step, &manifest)?;
        let id = ShardName {
            rank,
            world_size,
            hash,
        };
        let mut info = ShardInfo {
            step,
            rank,
            world_size,
            bytes_uploaded: uploaded,
            bytes_skipped: skipped,
            complete: false,
            finalize: Duration::ZERO,
            shard: ShardHash(hash),
        };
        if *then == ShardUpload::ChunksOnly {
            return Ok(info);
        }
        self.bucket
            .put(&self.bucket.layout.shard(step, &id), bytes)?;
        if matches!(then, ShardUpload::Manifest | ShardUpload::RankLocalShard(_)) {
            return Ok(info);
        }
        let landed = Instant::now();
        // Another rank may have started the step with another world size
        // since the check before the upload (a rank-local save's shards
        // are told apart by their save, whatever world wrote the others).
        if save.is_none() {
            self.check_world_size(step, world_size)?;
        }
        info.complete = self.finalize(step, &id, save)?;
        info.finalize = landed.elapsed();
        Ok(info)
    }

    /// Refuse a world size other shards of `step` contradict.
    pub(crate) fn check_world_size(&self, step: u64, world_size: u32) -> Result<()> {
        match self
            .shard_ids(step)?
            .iter()
            .find(|id| id.world_size != world_size)
        {
            Some(other) => Err(BucketError::WorldSizeMismatch {
                url: self.bucket.url.clone(),
                step,
                ours: world_size,
                theirs: other.world_size,
            }
            .into()),
            None => Ok(()),
        }
    }

    /// If every rank of `step` has a whole shard in the current attempt
    /// (written after the step's newest commit, of save `save`; of a
    /// rank's, the newest), write the step's manifest and a commit of a
    /// newer generation. Whether the step's newest commit then names shard
    /// `ours`.
    fn finalize(&self, step: u64, ours: &ShardName, save: Option<HexHash>) -> Result<bool> {
        let newest = self.commit_times(step)?.last().copied();
        match self.commit_whole(step, ours.world_size, save, newest)? {
            Some(chosen) => Ok(chosen.contains(ours)),
            None => self.names_shard(newest.map(|(c, _)| c), ours),
        }
    }

    /// If each of the `world` ranks of `step` has a whole shard of save
    /// `save` written after the step's `newest` commit (and its time),
    /// write the step's manifest and a commit of a newer generation naming
    /// them (of a rank's, the newest): the shards named.
    fn commit_whole(
        &self,
        step: u64,
        world: u32,
        save: Option<HexHash>,
        newest: Option<(Commit, i64)>,
    ) -> Result<Option<Vec<ShardName>>> {
        let since = newest.map_or(i64::MIN, |(_, t)| t);
        let mut attempt: Vec<(i64, ShardName)> = self
            .landed_shards(step)?
            .into_iter()
            .filter(|&(t, id)| id.world_size == world && t > since)
            .collect();
        // Until every rank is listed no shard is read: a rank that lands
        // before the last asks a listing, not a manifest per rank.
        let ranks = usize::try_from(world).unwrap_or(usize::MAX);
        let listed: BTreeSet<u32> = attempt.iter().map(|(_, id)| id.rank).collect();
        if listed.len() != ranks {
            return Ok(None);
        }
        // Newest first; of shards written in the same millisecond, the
        // smallest hash, so that every rank that finalizes picks the same.
        attempt.sort_by(|(ta, a), (tb, b)| tb.cmp(ta).then(a.hash.cmp(&b.hash)));
        let mut chosen: BTreeMap<u32, ShardName> = BTreeMap::new();
        for (_, id) in &attempt {
            if chosen.contains_key(&id.rank) {
                continue;
            }
            // A shard's chunks land before it, and collection takes no
            // chunk a young shard names: a shard there and whole is whole.
            // Only ours are chosen, so a rank's shard of another save (a
            // save of the step that died) does not hide its older one.
            if matches!(self.checked_shard(step, id, None)?, Ok(m) if m.save.as_deref() == save.as_ref())
            {
                chosen.insert(id.rank, *id);
            }
        }
        if chosen.len() != ranks {
            return Ok(None);
        }
        let chosen: Vec<ShardName> = chosen.into_values().collect();
        self.write_commit(step, &chosen, newest.map(|(c, _)| c))?;
        Ok(Some(chosen))
    }

    /// Whether `commit` (a global step's) names shard `id`.
    fn names_shard(&self, commit: Option<Commit>, id: &ShardName) -> Result<bool> {
        let Some(commit) = commit else {
            return Ok(false);
        };
        Ok(match self.checked_manifest(commit, None)? {
            Ok(StepManifest::Sharded { ids, .. }) => ids.contains(id),
            _ => false,
        })
    }

    /// Every shard object of `step`, with when it landed (milliseconds,
    /// the bucket's clock).
    fn landed_shards(&self, step: u64) -> Result<Vec<(i64, ShardName)>> {
        let folder = self.bucket.layout.shard_folder(step);
        Ok(self
            .bucket
            .list_under(&folder, 1)?
            .into_iter()
            .filter_map(|(name, meta)| {
                let id: ShardName = name[0].parse().ok()?;
                Some((meta.last_modified.timestamp_millis(), id))
            })
            .collect())
    }

    /// Every shard object of `step`.
    fn shard_ids(&self, step: u64) -> Result<Vec<ShardName>> {
        let folder = self.bucket.layout.shard_folder(step);
        let names = self.bucket.list_keys(&folder)?;
        Ok(names.iter().filter_map(|n| n.parse().ok()).collect())
    }

    /// Does the work of [`Remote::get_shard`](crate::Remote::get_shard).
    pub(crate) fn get_shard(&self, step: u64, rank: u32) -> Result<Option<Step>> {
        let chunks = self.bucket.objects()?;
        if let Some((_, StepManifest::Sharded { mut shards, ids })) =
            self.complete_step(step, &chunks)?
        {
            return match ids.iter().position(|id| id.rank == rank) {
                Some(i) => {
                    let ckpt = self.assemble(shards.swap_remove(i), &mut |_| {})?;
                    Ok(Some(ckpt.into_step()))
                }
                None => Ok(None),
            };
        }
        let mut ids: Vec<ShardName> = self.shard_ids(step)?;
        ids.sort();
        for id in ids.iter().filter(|id| id.rank == rank) {
            if let Ok(m) = self.checked_shard(step, id, Some(&chunks))? {
                return Ok(Some(self.assemble(m, &mut |_| {})?.into_step()));
            }
        }
        Ok(None)
    }

    /// Does the work of [`Remote::shards`](crate::Remote::shards).
    pub(crate) fn shards(&self, step: u64) -> Result<ShardStatus> {
        let ids = self.landed_shards(step)?;
        let chunks = self.bucket.objects()?;
        let world_sizes: BTreeSet<u32> = ids.iter().map(|(_, id)| id.world_size).collect();
        // Each whole shard under its save: (save, world size) -> (when its
        // newest shard landed, the ranks landed).
        let mut saves: BTreeMap<(Option<SaveId>, u32), (i64, BTreeSet<u32>)> = BTreeMap::new();
        for (t, id) in &ids {
            if let Ok(m) = self.checked_shard(step, id, Some(&chunks))? {
                let save = m.save.as_deref().map(|h| SaveId(h.0));
                let entry = saves.entry((save, id.world_size)).or_default();
                entry.0 = entry.0.max(*t);
                entry.1.insert(id.rank);
            }
        }
        let newest = saves.iter().max_by_key(|(_, (t, _))| *t);
        let (save, world_size, landed) = match newest {
            Some((&(save, world_size), (_, ranks))) => (save, Some(world_size), ranks.clone()),
            None => (None, world_sizes.first().copied(), BTreeSet::new()),
        };
        let missing = (0..world_size.unwrap_or(0))
            .filter(|r| !landed.contains(r))
            .collect();
        let complete = matches!(
            self.complete_step(step, &chunks)?,
            Some((_, StepManifest::Sharded { .. }))
        );
        Ok(ShardStatus {
            step,
            world_size,
            save,
            saves: saves.len(),
            landed: landed.into_iter().collect(),
            missing,
            world_sizes: world_sizes.into_iter().collect(),
            complete,
        })
    }

    /// Does the work of [`Remote::world_sizes`](crate::Remote::world_sizes).
    pub(crate) fn world_sizes(&self) -> Result<BTreeMap<u64, u32>> {
        let complete = self.complete()?;
        Ok(complete
            .iter()
            .map(|(c, m)| (c.step, m.world_size()))
            .collect())
    }

    /// Does the work of [`Remote::incomplete_steps`](crate::Remote::incomplete_steps).
    pub(crate) fn incomplete_steps(&self) -> Result<Vec<ShardStatus>> {
        let complete: BTreeSet<u64> = self.world_sizes()?.into_keys().collect();
        let partial: BTreeSet<u64> = self
            .bucket
            .list_shards()?
            .into_iter()
            .map(|(step, _, _)| step)
            .filter(|step| !complete.contains(step))
            .collect();
        partial.into_iter().map(|step| self.shards(step)).collect()
    }

    /// Does the work of [`Remote::complete_landed`](crate::Remote::complete_landed).
    pub(crate) fn complete_landed(&self) -> Result<Vec<u64>> {
        let mut completed = Vec::new();
        for status in self.incomplete_steps()? {
            let (Some(save), Some(world)) = (status.save, status.world_size) else {
                continue;
            };
            if !status.missing.is_empty() {
                continue;
            }
            let (step, save) = (status.step, Some(HexHash(save.0)));
            let named = self.with_push_lock(|_| {
                let newest = self.commit_times(step)?.last().copied();
                self.commit_whole(step, world, save, newest)
            })?;
            if named.is_some() {
                completed.push(step);
            }
        }
        Ok(completed)
    }

    /// Does the work of [`Remote::world_size`](crate::Remote::world_size).
    pub(crate) fn world_size(&self, step: u64) -> Result<Option<u32>> {
        if let Some((_, m)) = self.complete_step(step, &self.bucket.objects()?)? {
            return Ok(Some(m.world_size()));
        }
        Ok(self.shard_ids(step)?.iter().map(|id| id.world_size).min())
    }
}

/// How far a shard write goes after its chunks
/// ([`ShardWrite::then`](crate::ShardWrite::then)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShardUpload {
    /// Nothing more: the chunks are in the bucket, named by no shard (a
    /// coordinator that learns the rest of its shard later, DCP's
    /// metadata at `finish`, uploads its data early beside the other
    /// ranks, and its shard's later write finds the chunks there; chunks
    /// named by no shard are collected by `gc` after the grace period).
    ChunksOnly,
    /// The shard's manifest (as [`Remote::upload_shard`](crate::Remote::upload_shard)).
    Manifest,
    /// The manifest, and the step's commit when every rank is there (as
    /// [`Remote::commit_shard`](crate::Remote::commit_shard)).
    Complete,
    /// As [`Complete`](Self::Complete), for a save of ranks that do not
    /// coordinate (DCP's rank-local mode): the manifest names the save,
    /// and the step's commit is written, by whichever rank finds them
    /// there, once every rank's shard of this save is: never with a shard
    /// of another save of the step, whatever its world size.
    RankLocal(SaveId),
    /// The manifest naming save `save`, and nothing more: a rank of a
    /// rank-local save whose ranks tell each other their shards through
    /// the job's rendezvous store, where the rank that completes the count
    /// writes the step's commit ([`Remote::commit_reported`](crate::Remote::commit_reported)).
    /// No listing, no other rank's manifest read. A save whose completing
    /// rank died is left incomplete; its shards name their save, as
    /// [`RankLocal`](Self::RankLocal)'s do.
    RankLocalShard(SaveId),
    /// The manifest, then the step's commit naming exactly these shards
    /// (every rank's, by rank, as [`ShardInfo::shard`] named them; this
    /// rank's entry is the shard just written, `None` will do), each
    /// other checked there and whole first, under one push lock: a
    /// coordinator's save in one lock cycle, its own shard not read
    /// back. Every other rank's entry must name its shard, checked before
    /// anything is uploaded; no commit is written if the upload fails.
    Commit(Vec<Option<ShardHash>>),
    /// As [`Commit`](Self::Commit), the other shards trusted rather than
    /// read: names each rank reported once its upload returned (S3 reads
    /// its writes), told to the coordinator by the save's own collective
    /// (`ckptstore.dcp`'s). The commit costs a handful of requests
    /// whatever the number of ranks, as
    /// [`Remote::commit_reported`](crate::Remote::commit_reported); a name
    /// that is wrong makes a commit no reader takes (each checks every
    /// shard it reads).
    CommitReported(Vec<Option<ShardHash>>),
}

impl ShardUpload {
    /// The save a rank-local upload names.
    fn save(&self) -> Option<SaveId> {
        match *self {
            ShardUpload::RankLocal(save) | ShardUpload::RankLocalShard(save) => Some(save),
            _ => None,
        }
    }
}

/// A checkpoint held in memory, as the bucket takes it: its manifest, its
/// chunks, and its small blobs packed into one chunk.
type ShardData<'a> = (
    RemoteManifest,
    Vec<(Hash, &'a [u8])>,
    Option<(Hash, &'a [u8])>,
);

fn shard_manifest<'p>(plan: &'p Plan<'_>) -> Result<ShardData<'p>> {
    // Cut as a local commit cuts it: the same plan, in the bucket's codec.
    let ckpt = plan.source;
    // Hashed on every core (the caller waits; the hashers do it all).
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let hashes: Vec<Hash> =
        with_known_hashes(&plan.pieces, &plan.known, cores + 1, |h| h.collect());
    let pieces: Vec<(Hash, &[u8])> = hashes
        .into_iter()
        .zip(plan.pieces.iter().copied())
        .collect();
    // A bucket names chunks by hash; the ids are the store's.
    let refs: Vec<ChunkRef> = pieces
        .iter()
        .map(|(hash, _)| ChunkRef { hash: *hash, id: 0 })
        .collect();
    let placements = plan.placements(&refs);
    let typed = |name: &str| {
        plan.typed
            .iter()
            .find(|t| t.0 == name)
            .map(|t| (t.1, t.2.to_vec()))
    };
    // Every chunk goes in a pack object: a blob's small end is a chunk
    // like any other (format 2 packed it with the small blobs, to spare
    // an object per chunk), and an unchanged blob is uploaded not at all.
    let mut manifest = RemoteManifest::from_model(ckpt, &placements, &typed, None)?;
    let packed = &plan.packed[..];
    let packed = (!packed.is_empty()).then(|| (*blake3::hash(packed).as_bytes(), packed));
    manifest.packed = packed.as_ref().map(|(hash, bytes)| RemotePacked {
        len: bytes.len() as u64,
        hash: HexHash(*hash),
    });
    // Refused before anything is uploaded (its packs are added later).
    manifest.check_to_write(ckpt.step())?;
    Ok((manifest, pieces, packed))
}
