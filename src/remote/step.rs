//! What a commit object stands for: one step's manifest, or, for a global
//! step of N ranks, a list of N shard manifests; and the checks a step
//! passes before any reader counts it.

use std::collections::HashSet;

use super::layout::{parse_hex, GlobalManifest, RemoteManifest, ShardId, MANIFEST_FORMAT};
use super::{Commit, Remote};
use crate::format::layout::chunk_lengths;
use crate::format::manifest::Hash;
use crate::{Result, StepSummary};

/// A complete step's manifests.
#[derive(Clone, Debug)]
pub(crate) enum StepManifest {
    /// A step pushed from one store.
    Single(RemoteManifest),
    /// A global step: each rank's shard, by rank.
    Sharded {
        shards: Vec<RemoteManifest>,
        ids: Vec<ShardId>,
    },
}

impl StepManifest {
    /// Its manifests: one, or one per rank.
    pub(crate) fn parts(&self) -> &[RemoteManifest] {
        match self {
            StepManifest::Single(m) => std::slice::from_ref(m),
            StepManifest::Sharded { shards, .. } => shards,
        }
    }

    /// 1, or the number of ranks.
    pub(crate) fn world_size(&self) -> u32 {
        match self {
            StepManifest::Single(_) => 1,
            StepManifest::Sharded { ids, .. } => ids.first().map_or(1, |id| id.world_size),
        }
    }

    /// Every chunk it names.
    pub(crate) fn chunks(&self) -> impl Iterator<Item = Hash> + '_ {
        self.parts().iter().flat_map(chunks_of)
    }

    /// The record retention ranks: time, loss and metrics of rank 0, the
    /// bytes of every rank.
    pub(crate) fn summary(&self) -> StepSummary {
        let parts = self.parts();
        let mut s = summary(&parts[0]);
        s.logical_bytes = parts.iter().map(|m| summary(m).logical_bytes).sum();
        s.blobs = parts.iter().map(|m| m.blobs.len()).sum();
        s
    }
}

impl Remote {
    /// What `commit` stands for, if its manifest is there, hashes right, is
    /// one this build reads, and (given the bucket's chunks) names only
    /// chunks that are there; for a global step, the same of every shard.
    pub(super) fn checked_manifest(
        &self,
        commit: Commit,
        chunks: Option<&HashSet<Hash>>,
    ) -> Result<Option<StepManifest>> {
        let key = self.layout.manifest(commit.step, &commit.hash);
        let Some(bytes) = self.get_hashed(&key, &commit.hash)? else {
            return Ok(None);
        };
        if let Ok(m) = serde_json::from_slice::<RemoteManifest>(&bytes) {
            let ok = m.format == MANIFEST_FORMAT && m.step == commit.step && has_chunks(&m, chunks);
            return Ok(ok.then_some(StepManifest::Single(m)));
        }
        let Ok(global) = serde_json::from_slice::<GlobalManifest>(&bytes) else {
            return Ok(None);
        };
        let world_size = global.world_size;
        let size_ok = usize::try_from(world_size).is_ok_and(|n| n == global.shards.len());
        if global.format != MANIFEST_FORMAT || global.step != commit.step || !size_ok {
            return Ok(None);
        }
        let (mut shards, mut ids) = (Vec::new(), Vec::new());
        for (rank, hash) in (0..world_size).zip(&global.shards) {
            let Some(hash) = parse_hex(hash) else {
                return Ok(None);
            };
            let id = ShardId {
                rank,
                world_size,
                hash,
            };
            let Some(m) = self.checked_shard(commit.step, &id, chunks)? else {
                return Ok(None);
            };
            shards.push(m);
            ids.push(id);
        }
        Ok(Some(StepManifest::Sharded { shards, ids }))
    }

    /// Shard `id` of `step`, if it is there, hashes right, and (given the
    /// bucket's chunks) names only chunks that are there.
    pub(super) fn checked_shard(
        &self,
        step: u64,
        id: &ShardId,
        chunks: Option<&HashSet<Hash>>,
    ) -> Result<Option<RemoteManifest>> {
        let Some(bytes) = self.get_hashed(&self.layout.shard(step, id), &id.hash)? else {
            return Ok(None);
        };
        let Ok(m) = serde_json::from_slice::<RemoteManifest>(&bytes) else {
            return Ok(None);
        };
        let ok = m.format == MANIFEST_FORMAT && m.step == step && has_chunks(&m, chunks);
        Ok(ok.then_some(m))
    }

    /// Of `commits` (ascending), the newest that checks out against the
    /// bucket's `chunks`, with what it stands for.
    pub(crate) fn newest_complete(
        &self,
        commits: &[Commit],
        chunks: &HashSet<Hash>,
    ) -> Result<Option<(Commit, StepManifest)>> {
        for c in commits.iter().rev() {
            if let Some(m) = self.checked_manifest(*c, Some(chunks))? {
                return Ok(Some((*c, m)));
            }
        }
        Ok(None)
    }

    /// Step `step`'s newest commit that checks out against the bucket's
    /// `chunks`, reading only that step's manifests.
    pub(crate) fn complete_step(
        &self,
        step: u64,
        chunks: &HashSet<Hash>,
    ) -> Result<Option<(Commit, StepManifest)>> {
        let commits: Vec<Commit> = self
            .commits()?
            .into_iter()
            .filter(|c| c.step == step)
            .collect();
        self.newest_complete(&commits, chunks)
    }

    /// The bytes at `key` if they are there and hash to `hash`.
    fn get_hashed(
        &self,
        key: &object_store::path::Path,
        hash: &Hash,
    ) -> Result<Option<bytes::Bytes>> {
        let bytes = self.get_bytes(key)?;
        Ok(bytes.filter(|b| blake3::hash(b).as_bytes() == hash))
    }

    /// Each complete step's newest commit that checks out, with what it
    /// stands for, ascending.
    pub(crate) fn complete(&self) -> Result<Vec<(Commit, StepManifest)>> {
        let commits = self.commits()?;
        if commits.is_empty() {
            return Ok(Vec::new());
        }
        let chunks = self.chunk_hashes()?;
        let mut complete = Vec::new();
        // Commits come sorted by step: one group per step.
        for of_step in commits.chunk_by(|a, b| a.step == b.step) {
            complete.extend(self.newest_complete(of_step, &chunks)?);
        }
        Ok(complete)
    }
}

/// Whether every chunk `m` names parses, and (given the bucket's chunks)
/// is there.
fn has_chunks(m: &RemoteManifest, chunks: Option<&HashSet<Hash>>) -> bool {
    let Some(chunks) = chunks else {
        return true;
    };
    let named = m
        .blobs
        .values()
        .map(|b| b.chunks.as_ref().map_or(0, Vec::len));
    let all_parse = chunks_of(m).count() == named.sum::<usize>() + usize::from(m.packed.is_some());
    all_parse && chunks_of(m).all(|h| chunks.contains(&h))
}

/// The chunks a manifest names (its blobs' and its packed chunk).
pub(crate) fn chunks_of(m: &RemoteManifest) -> impl Iterator<Item = Hash> + '_ {
    m.blobs
        .values()
        .flat_map(|b| b.chunks.iter().flatten())
        .chain(m.packed.iter().map(|p| &p.hash))
        .filter_map(|h| parse_hex(h))
}

/// The retention record of one manifest.
fn summary(m: &RemoteManifest) -> StepSummary {
    StepSummary {
        step: m.step,
        timestamp: m.timestamp,
        loss_cid: m.loss_cid.clone(),
        metrics: m.metrics.clone(),
        logical_bytes: m.blobs.values().map(|b| b.len).sum(),
        bytes_written: 0,
        blobs: m.blobs.len(),
    }
}

/// Bytes of the chunks of `m` not in `seen`, which takes them.
pub(crate) fn new_bytes(m: &RemoteManifest, seen: &mut HashSet<String>) -> u64 {
    let mut bytes = 0;
    for blob in m.blobs.values() {
        let (Some(hashes), Ok(len)) = (&blob.chunks, usize::try_from(blob.len)) else {
            continue;
        };
        for (hash, n) in hashes.iter().zip(chunk_lengths(len)) {
            if seen.insert(hash.clone()) {
                bytes += n as u64;
            }
        }
    }
    if let Some(p) = &m.packed {
        if seen.insert(p.hash.clone()) {
            bytes += p.len;
        }
    }
    bytes
}
