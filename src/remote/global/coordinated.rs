//! Global steps a coordinator completes (the storage layer under
//! `torch.distributed.checkpoint`): every rank uploads its shard without
//! completing the step ([`Remote::upload_shard`](crate::Remote::upload_shard));
//! the coordinator, told every rank's shard, writes the step's commit naming
//! exactly those ([`Remote::commit_global`](crate::Remote::commit_global)).
//! Shards of an attempt that died before its commit are named by no commit:
//! they never mix into a step and never block one (gc removes them).

use std::collections::{BTreeSet, HashSet};

use crate::engine::plan::Plan;
use crate::format::manifest::{hex, Hash};
use crate::remote::format::hash::ShardHash;
use crate::remote::format::layout::{encode, GlobalManifest, ShardName, MAX_WORLD_SIZE};
use crate::remote::global::shards::ShardUpload;
use crate::remote::global::Coordinator;
use crate::remote::{Commit, ShardInfo};
use crate::{Error, Result};

impl Coordinator<'_> {
    /// Check the arguments, then upload `plan` as `how` says.
    pub(crate) fn upload_planned(
        &self,
        (step, rank, world_size): (u64, u32, u32),
        plan: &Plan<'_>,
        how: &ShardUpload,
    ) -> Result<ShardInfo> {
        Self::check_shard_args(step, rank, world_size, plan.source)?;
        if *how == ShardUpload::Complete {
            self.check_world_size(step, world_size)?;
        }
        self.with_push_lock(|lock| self.put_shard(step, rank, world_size, plan, lock, how))
    }

    /// Does the work of [`Remote::commit_global`](crate::Remote::commit_global).
    pub(crate) fn commit_global(&self, step: u64, shards: &[ShardHash]) -> Result<()> {
        let named: Vec<Option<ShardHash>> = shards.iter().copied().map(Some).collect();
        let ids = shard_ids(step, &named, None)?;
        self.with_push_lock(|_| self.commit_locked(step, &ids, None))
    }

    /// Does the work of [`Remote::commit_reported`](crate::Remote::commit_reported):
    /// the step's manifest and commit, no shard read, under the push lock
    /// as every commit is written.
    pub(crate) fn commit_reported(&self, step: u64, shards: &[ShardHash]) -> Result<()> {
        let named: Vec<Option<ShardHash>> = shards.iter().copied().map(Some).collect();
        let ids = shard_ids(step, &named, None)?;
        self.with_push_lock(|_| self.commit_as_newest(step, &ids))
    }

    /// Upload `plan` as rank `rank`'s shard of rank-local save `save`
    /// (its manifest only), then, the push lock still held, `announce` it;
    /// where that completes the save, write the step's commit naming the
    /// shards announced in the same lock cycle (no shard read).
    pub(crate) fn upload_announced(
        &self,
        (step, rank, world_size): (u64, u32, u32),
        plan: &Plan<'_>,
        save: crate::SaveId,
        announce: super::write::Announce<'_>,
    ) -> Result<ShardInfo> {
        Self::check_shard_args(step, rank, world_size, plan.source)?;
        let then = ShardUpload::RankLocalShard(save);
        self.with_push_lock(|lock| {
            let mut info = self.put_shard(step, rank, world_size, plan, lock, &then)?;
            let Some(told) = announce(info.shard) else {
                return Ok(info);
            };
            let every: Vec<Option<ShardHash>> = told.iter().copied().map(Some).collect();
            let ids = shard_ids(step, &every, None)?;
            if ids.len() != world_size as usize || told.get(rank as usize) != Some(&info.shard) {
                return Err(Error::InvalidCheckpoint {
                    step,
                    reason: format!(
                        "{} shards announced for a world of {world_size}, rank {rank}'s not the \
                         one it uploaded",
                        told.len()
                    ),
                });
            }
            self.commit_as_newest(step, &ids)?;
            info.complete = true;
            Ok(info)
        })
    }

    /// Upload `plan` as rank `rank`'s shard's manifest, then the step's
    /// commit naming `shards` with this rank's entry the shard just
    /// uploaded, under one push lock ([`ShardUpload::Commit`]; the others
    /// read and checked first where `check`, else trusted:
    /// [`ShardUpload::CommitReported`]).
    pub(crate) fn upload_and_commit(
        &self,
        (step, rank, world_size): (u64, u32, u32),
        plan: &Plan<'_>,
        shards: &[Option<ShardHash>],
        check: bool,
    ) -> Result<ShardInfo> {
        Self::check_shard_args(step, rank, world_size, plan.source)?;
        if usize::try_from(world_size).ok() != Some(shards.len()) {
            return Err(Error::InvalidCheckpoint {
                step,
                reason: format!("{} shards named for a world of {world_size}", shards.len()),
            });
        }
        let mut ids = shard_ids(step, shards, Some(rank))?;
        self.with_push_lock(|lock| {
            let info =
                self.put_shard(step, rank, world_size, plan, lock, &ShardUpload::Manifest)?;
            let own = &mut ids[rank as usize];
            own.hash = info.shard.0;
            if check {
                self.commit_locked(step, &ids, Some(rank))?;
            } else {
                self.commit_as_newest(step, &ids)?;
            }
            Ok(info)
        })
    }

    /// Check each shard of `ids` but `own` (written under this very lock)
    /// is there and whole (their manifests read several at once), then
    /// write the step's manifest and commit.
    fn commit_locked(&self, step: u64, ids: &[ShardName], own: Option<u32>) -> Result<()> {
        let others: Vec<&ShardName> = ids.iter().filter(|id| Some(id.rank) != own).collect();
        let checked = self.checked_shards(step, &others)?;
        for (id, m) in others.into_iter().zip(checked) {
            let m = m.map_err(|why| Error::corrupt(Some(step), why.to_string()))?;
            // A shard of packs was written after its rank saw (or put)
            // its packs there under its own push lock, and a young
            // shard's packs are not collected: a request per rank.
            if m.packs.is_some() {
                continue;
            }
            let named: Vec<Hash> = crate::remote::format::objects::chunks_of(&m).collect();
            let there = self.present(named.iter().copied())?;
            if let Some(gone) = named.iter().find(|h| !there.contains(*h)) {
                return Err(Error::corrupt(
                    Some(step),
                    format!(
                        "shard {} names chunk {} that {} lacks",
                        id.rank,
                        hex(gone),
                        self.bucket.url
                    ),
                ));
            }
        }
        self.commit_as_newest(step, ids)
    }

    /// The step's manifest naming `ids`, and a commit of a generation
    /// after the step's newest one, listed now (under the caller's lock).
    fn commit_as_newest(&self, step: u64, ids: &[ShardName]) -> Result<()> {
        let newest = self.commit_times(step)?.last().map(|(c, _)| *c);
        self.write_commit(step, ids, newest)
    }

    /// The step's manifest naming `ids`, and a commit of a generation
    /// after `newest` (the step's newest commit, as listed under this
    /// lock).
    pub(super) fn write_commit(
        &self,
        step: u64,
        ids: &[ShardName],
        newest: Option<Commit>,
    ) -> Result<()> {
        let global = GlobalManifest::of(step, ids);
        let (bytes, hash) = encode(step, &global)?;
        self.put_step(&Commit::after(newest, step, hash), bytes)
    }
}

/// The shards of a global step as `commit_global` is given them, by rank;
/// `own`'s entry is not read (its hash is filled in once uploaded), and
/// every other rank's must name a shard.
fn shard_ids(step: u64, shards: &[Option<ShardHash>], own: Option<u32>) -> Result<Vec<ShardName>> {
    let invalid = |reason: String| Error::InvalidCheckpoint { step, reason };
    let world_size = u32::try_from(shards.len())
        .ok()
        .filter(|&n| (1..=MAX_WORLD_SIZE).contains(&n))
        .ok_or_else(|| {
            invalid(format!(
                "{} shards: a global step has 1 to {MAX_WORLD_SIZE}",
                shards.len()
            ))
        })?;
    shards
        .iter()
        .zip(0..)
        .map(|(name, rank)| {
            let hash: Hash = match name {
                _ if Some(rank) == own => Hash::default(),
                Some(name) => name.0,
                None => return Err(invalid(format!("shard {rank}: no shard named"))),
            };
            Ok(ShardName {
                rank,
                world_size,
                hash,
            })
        })
        .collect()
}

/// HEAD requests in flight at once.
const HEADS_IN_FLIGHT: usize = 8;

impl Coordinator<'_> {
    /// Which of `hashes` the bucket holds as chunk objects (formats 1 and
    /// 2), asked object by object (several requests in flight).
    fn present(&self, hashes: impl Iterator<Item = Hash>) -> Result<HashSet<Hash>> {
        use futures::{StreamExt, TryStreamExt};
        let unique: BTreeSet<Hash> = hashes.collect();
        if crate::remote::read::local::direct(self) {
            return crate::remote::read::local::present(self, unique);
        }
        let bucket = &self.bucket;
        bucket.run(async {
            futures::stream::iter(unique)
                .map(|hash| async move {
                    let found = bucket.has(&bucket.layout.chunk(&hash)).await?;
                    Ok::<_, crate::Error>(found.then_some(hash))
                })
                .buffer_unordered(HEADS_IN_FLIGHT)
                .try_filter_map(|found| async move { Ok(found) })
                .try_collect()
                .await
        })?
    }
}
