//! Listing and restoring steps from the bucket alone: a step counts only
//! when its commit names a manifest that is there, hashes right, and names
//! only chunks the bucket holds; every chunk read is hash-checked.

use std::collections::HashSet;

use crate::remote::format::manifest::{RemoteManifest, RemotePlace};
use crate::remote::read::Reader;
use crate::remote::BucketError;

use crate::checkpoint::Incoming;
use crate::remote::read::restore::{incoming, skeleton};
use crate::remote::read::step::{new_bytes, StepManifest};
use crate::remote::Commit;
use crate::{
    CheckpointStore, CommitInfo, Error, GradientCheckpoint, Result, StepInfo, StepSummary,
};

impl Reader<'_> {
    /// Does the work of [`Remote::steps`](crate::Remote::steps).
    pub(crate) fn steps(&self) -> Result<Vec<u64>> {
        let mut steps: Vec<u64> = self.commits()?.iter().map(|c| c.step).collect();
        steps.dedup();
        Ok(steps)
    }

    /// Does the work of [`Remote::latest_step`](crate::Remote::latest_step).
    pub(crate) fn latest_step(&self) -> Result<Option<u64>> {
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

    /// Does the work of [`Remote::get`](crate::Remote::get).
    pub(crate) fn get(&self, step: u64) -> Result<Option<GradientCheckpoint>> {
        self.get_with(step, &mut |_, _| {})
    }

    /// Does the work of [`Remote::get_with`](crate::Remote::get_with).
    pub(crate) fn get_with(
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

    /// Does the work of [`Remote::pull`](crate::Remote::pull).
    pub(crate) fn pull(&self, step: u64, store: &CheckpointStore) -> Result<CommitInfo> {
        self.pull_with(step, store, &mut |_, _| {})
    }

    /// Does the work of [`Remote::pull_with`](crate::Remote::pull_with).
    pub(crate) fn pull_with(
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

    /// Does the work of [`Remote::summaries`](crate::Remote::summaries).
    pub(crate) fn summaries(&self) -> Result<Vec<StepSummary>> {
        let mut seen = HashSet::new();
        let complete = self.complete()?;
        let summaries = complete.iter().map(|(_, m)| {
            let mut s = m.summary();
            let new = m.parts().iter().map(|p| new_bytes(p, &mut seen));
            (s.bytes_written, s.stored_bytes) = new.fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
            s
        });
        Ok(summaries.collect())
    }

    /// Does the work of [`Remote::info`](crate::Remote::info).
    pub(crate) fn info(&self, step: u64) -> Result<Option<StepInfo>> {
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
