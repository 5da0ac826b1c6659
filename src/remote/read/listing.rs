//! Listing and restoring steps from the bucket alone: a step counts only
//! when its commit names a manifest that is there, hashes right, and names
//! only chunks the bucket holds; every chunk read is hash-checked.

use std::collections::HashSet;

use crate::remote::format::manifest::{RemoteManifest, RemotePlace};
use crate::remote::BucketError;

use crate::checkpoint::Incoming;
use crate::remote::read::restore::{incoming, skeleton};
use crate::remote::read::step::{new_bytes, StepManifest};
use crate::remote::{Commit, Remote};
use crate::{
    CheckpointStore, CommitInfo, Error, GradientCheckpoint, Result, StepInfo, StepSummary,
};

impl Remote {
    /// The committed steps in the bucket, ascending: from the listing of
    /// commit objects alone (a request per 1,000 commits), whatever the
    /// bucket's size. A commit is written last, once everything its step
    /// needs is there; a step whose objects were damaged or deleted since
    /// stays listed until [`verify`](Self::verify) reports it and reading
    /// it fails ([`skipped_steps`](Self::skipped_steps) lists those).
    pub fn steps(&self) -> Result<Vec<u64>> {
        let mut steps: Vec<u64> = self.commits()?.iter().map(|c| c.step).collect();
        steps.dedup();
        Ok(steps)
    }

    /// The newest step with a commit whose manifest is there and checks
    /// out: the commits from the step the bucket's latest-step hint names
    /// on (a GET and a listing of what follows, whatever the bucket's
    /// size), then the newest manifests, one GET each, until one checks
    /// out; below the hint only if none does (a damaged newest step never
    /// hides an older one). Neither a global step's shard manifests nor
    /// chunks are looked for: reading the step checks each.
    pub fn latest_step(&self) -> Result<Option<u64>> {
        let (newest, hint) = self.newest_commits()?;
        if let Some(step) = self.newest_checked(&newest)? {
            return Ok(Some(step));
        }
        match hint {
            Some(hint) => self.newest_checked(&self.commits_before(hint)?),
            None => Ok(None),
        }
    }

    /// The step of the newest of `commits` (ascending) whose manifest
    /// checks out (one GET each).
    fn newest_checked(&self, commits: &[Commit]) -> Result<Option<u64>> {
        for c in commits.iter().rev() {
            if self.read_commit(*c, None)?.is_ok() {
                return Ok(Some(c.step));
            }
        }
        Ok(None)
    }

    /// Step `step`, restored from the bucket with every chunk hash-checked,
    /// or `None` if the bucket has no complete copy of it.
    ///
    /// # Errors
    /// [`Error::Corrupt`] when a chunk is missing or fails its hash check
    /// (naming the URL); [`BucketError::Request`](crate::BucketError::Request) when the bucket fails;
    /// [`BucketError::ShardedStep`](crate::BucketError::ShardedStep) for a global step of several ranks (read its
    /// shards with [`get_shard`](Self::get_shard)).
    pub fn get(&self, step: u64) -> Result<Option<GradientCheckpoint>> {
        self.get_with(step, &mut |_, _| {})
    }

    /// [`get`](Self::get), calling `progress(bytes_fetched, bytes_total)`
    /// as chunks arrive (for progress bars).
    pub fn get_with(
        &self,
        step: u64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Option<GradientCheckpoint>> {
        for (c, m) in self.readable(step)? {
            let total = fetch_bytes(&m);
            let mut fetched = 0;
            match self.assemble(m, &mut |n| {
                fetched += n;
                progress(fetched, total);
            }) {
                Ok(ckpt) => return Ok(Some(ckpt)),
                // Retention may have deleted the step while it was read.
                Err(e @ Error::Corrupt { .. }) if !self.commits_of(step)?.contains(&c) => drop(e),
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// The commits of `step` whose manifest is there and checks out, with
    /// it, newest first.
    fn readable(&self, step: u64) -> Result<Vec<(Commit, RemoteManifest)>> {
        let mut readable = Vec::new();
        for c in self.commits_of(step)?.into_iter().rev() {
            if let Ok(m) = self.checked_manifest(c, None)? {
                readable.push((c, single(step, m)?));
            }
        }
        Ok(readable)
    }

    /// Copy step `step` from the bucket into `store` (one commit there).
    /// An empty store takes the run identity of the prefix
    /// ([`owner`](Self::owner)): a job resumed from the bucket on a new
    /// machine goes on pushing into it.
    ///
    /// # Errors
    /// [`Error::StepsNotFound`] when the bucket has no complete copy of it;
    /// as [`get`](Self::get) and [`CheckpointStore::commit`].
    pub fn pull(&self, step: u64, store: &CheckpointStore) -> Result<CommitInfo> {
        self.pull_with(step, store, &mut |_, _| {})
    }

    /// [`pull`](Self::pull), with progress as for [`get_with`](Self::get_with).
    /// The step is fed into one streamed commit blob by blob while the
    /// next chunks download, so memory holds a batch of chunks (32 MiB, or
    /// the largest blob) rather than the step.
    pub fn pull_with(
        &self,
        step: u64,
        store: &CheckpointStore,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<CommitInfo> {
        if store.info(step)?.is_some() {
            return Err(Error::StepExists { step });
        }
        let (_, m) = self
            .readable(step)?
            .into_iter()
            .next()
            .ok_or(Error::StepsNotFound { steps: vec![step] })?;
        // An empty store filled from this prefix continues its run: it
        // takes the prefix's owner as its id, so it may push there.
        if let Some(owner) = self.owner()? {
            store.join_run(&owner)?;
        }
        let total = fetch_bytes(&m);
        let mut fetched = 0;
        self.restore_into(m, store, &mut |n| {
            fetched += n;
            progress(fetched, total);
        })
    }

    /// The summaries (time, loss CID, metrics, sizes) of the complete
    /// steps, ascending, from their manifests.
    /// `bytes_written` is what each step added to the bucket: its chunks
    /// that no earlier step there has.
    pub fn summaries(&self) -> Result<Vec<StepSummary>> {
        let mut seen = HashSet::new();
        let complete = self.complete()?;
        let summaries = complete.iter().map(|(_, m)| {
            let mut s = m.summary();
            s.bytes_written = m.parts().iter().map(|p| new_bytes(p, &mut seen)).sum();
            s
        });
        Ok(summaries.collect())
    }

    /// Step `step`'s metadata, from its manifest (no chunk is read), or
    /// `None` if the bucket has no complete copy of it.
    ///
    /// # Errors
    /// [`BucketError::ShardedStep`](crate::BucketError::ShardedStep) for a global step of several ranks (see
    /// [`get_shard`](Self::get_shard)).
    pub fn info(&self, step: u64) -> Result<Option<StepInfo>> {
        let Some((_, m)) = self.complete_step(step, &self.bucket.objects()?)? else {
            return Ok(None);
        };
        let m = single(step, m)?;
        let entries: Vec<Incoming> = m
            .blobs
            .iter()
            .map(|(name, blob)| incoming(step, name.clone(), blob))
            .collect::<Result<_>>()?;
        let info = StepInfo::of(&skeleton(m)?, entries);
        Ok(Some(info))
    }
}

/// The one manifest of a step, which may be a global step of one rank.
fn single(step: u64, m: StepManifest) -> Result<RemoteManifest> {
    match m {
        StepManifest::Single(m) => Ok(m),
        StepManifest::Sharded { mut shards, .. } if shards.len() == 1 => Ok(shards.remove(0)),
        StepManifest::Sharded { shards, .. } => Err(BucketError::ShardedStep {
            step,
            world_size: u32::try_from(shards.len()).unwrap_or(u32::MAX),
        }
        .into()),
    }
}

/// Bytes of the chunks a restore of `m` downloads.
fn fetch_bytes(m: &RemoteManifest) -> u64 {
    let chunked = m
        .blobs
        .values()
        .filter(|b| matches!(b.place, RemotePlace::Chunks { .. }));
    // A blob's tail is in the packed chunk.
    let in_chunks = chunked.map(|b| b.len - b.tail_bytes().map_or(0, |(_, n)| n));
    in_chunks.sum::<u64>() + m.packed.as_ref().map_or(0, |p| p.len)
}
