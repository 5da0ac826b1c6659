//! The commit objects: listing them (all, one step's, or from a step on)
//! and writing one, with the latest-step hint that lets a search for the
//! newest step list only the commits from the hinted step on.

use crate::remote::format::layout::{LatestHint, COMMITS, MAX_HINT_BYTES};
use crate::remote::read::Reader;
use crate::remote::Commit;
use crate::{Error, Result};

impl Reader<'_> {
    /// Every commit object, ascending by step, then generation.
    pub(crate) fn commits(&self) -> Result<Vec<Commit>> {
        self.commits_from(0, None)
    }

    /// The commits of `step`, ascending by generation: one request however
    /// many commits the bucket holds (see [`commits_from`](Self::commits_from)).
    pub(crate) fn commits_of(&self, step: u64) -> Result<Vec<Commit>> {
        self.commits_from(step, Some(step))
    }

    /// The commits of steps `from ..= to` (`to` unbounded when `None`),
    /// ascending. Listed from the first name of step `from` on: S3 lists in
    /// name order and names sort by step, so a listing that stops at `to`
    /// is a request per 1,000 commits it returns (a directory lists
    /// everything and drops what is out of range).
    pub(crate) fn commits_from(&self, from: u64, to: Option<u64>) -> Result<Vec<Commit>> {
        let found = self.commits_listed(from, to)?;
        Ok(found.into_iter().map(|(c, _)| c).collect())
    }

    /// The commits of `step` with the time each was written (ms since the
    /// epoch, server clock), ascending by generation: one listing request
    /// however many commits the bucket holds.
    pub(crate) fn commit_times(&self, step: u64) -> Result<Vec<(Commit, i64)>> {
        self.commits_listed(step, Some(step))
    }

    /// As [`commits_from`](Self::commits_from), each with the time it was
    /// written.
    fn commits_listed(&self, from: u64, to: Option<u64>) -> Result<Vec<(Commit, i64)>> {
        let folder = self.bucket.layout.folder(COMMITS);
        let sorted = self.bucket.lists_in_order();
        let in_range = |c: &Commit| c.step >= from && to.is_none_or(|to| c.step <= to);
        // Every name of step `from` sorts after this offset (its prefix),
        // every name of an earlier step before it.
        let offset = folder.clone().join(format!("{from:020}"));
        let mut found: Vec<(Commit, i64)> = Vec::new();
        self.bucket.scan(
            &folder,
            (from > 0).then_some(&offset),
            &mut |name, modified| {
                match name.parse::<Commit>().ok() {
                    Some(c) if in_range(&c) => found.push((c, modified)),
                    Some(c) if sorted && to.is_some_and(|to| c.step > to) => return false,
                    _ => {}
                }
                true
            },
        )?;
        found.sort();
        Ok(found)
    }

    /// The commits worth looking at for the newest step, ascending: those
    /// from the hinted step on, and whether that is all of them (no hint,
    /// or one naming step 0). When none of the first set checks out, the
    /// caller looks below the hint ([`commits_before`](Self::commits_before)).
    pub(crate) fn newest_commits(&self) -> Result<(Vec<Commit>, Option<u64>)> {
        match self.latest_hint()? {
            Some(hint) if hint > 0 => Ok((self.commits_from(hint, None)?, Some(hint))),
            _ => Ok((self.commits()?, None)),
        }
    }

    /// The commits of steps below `step`, ascending.
    pub(crate) fn commits_before(&self, step: u64) -> Result<Vec<Commit>> {
        let mut commits = self.commits()?;
        commits.retain(|c| c.step < step);
        Ok(commits)
    }

    /// The step the latest-step hint names, if there is a readable one.
    /// The hint is untrusted like every object: anything but its JSON is
    /// no hint, and any step it names only sets where a listing starts.
    fn latest_hint(&self) -> Result<Option<u64>> {
        let bytes = match self
            .bucket
            .get_bytes(&self.bucket.layout.latest_hint(), MAX_HINT_BYTES)
        {
            Ok(Some(bytes)) => bytes,
            Ok(None) | Err(Error::Corrupt { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        Ok(serde_json::from_slice::<LatestHint>(&bytes)
            .ok()
            .filter(|h| h.format == 1)
            .map(|h| h.step))
    }

    /// Make `commit`'s step visible: its manifest `bytes`, the latest-step
    /// hint, then the commit naming the manifest. Whatever the step needs
    /// must be there. The hint goes first so that a failure leaves no
    /// step whose hint is missing; a hint naming a step whose commit never
    /// landed only sends readers to list further.
    pub(crate) fn put_step(&self, commit: &Commit, bytes: Vec<u8>) -> Result<()> {
        self.bucket.put(
            &self.bucket.layout.manifest(commit.step, &commit.hash),
            bytes,
        )?;
        let hint = LatestHint {
            format: 1,
            step: commit.step,
        };
        self.bucket
            .put(&self.bucket.layout.latest_hint(), json(&hint)?)?;
        self.bucket
            .put(&self.bucket.layout.commit(commit), json(&commit.body())?)
    }

    /// [`put_step`](Self::put_step) without the hint: a step committed
    /// again that need not be the newest (a repack).
    pub(crate) fn put_manifest_and_commit(&self, commit: &Commit, bytes: Vec<u8>) -> Result<()> {
        self.bucket.put(
            &self.bucket.layout.manifest(commit.step, &commit.hash),
            bytes,
        )?;
        self.bucket
            .put(&self.bucket.layout.commit(commit), json(&commit.body())?)
    }
}

/// The JSON of a small body this crate writes.
fn json(body: &impl serde::Serialize) -> Result<Vec<u8>> {
    serde_json::to_vec(body).map_err(|e| Error::Json {
        path: None,
        source: Box::new(e),
    })
}
