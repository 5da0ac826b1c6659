//! What a commit object stands for: one step's manifest, or, for a global
//! step of N ranks, a list of N shard manifests; and the checks a step
//! passes before any reader counts it.

use std::collections::HashSet;

use crate::format::manifest::Hash;
use crate::remote::format::hash::HexHash;
use crate::remote::format::layout::{GlobalManifest, ShardName, MAX_MANIFEST_BYTES};
use crate::remote::format::manifest::RemoteManifest;
use crate::remote::format::pack_format::Object;
use crate::remote::read::Reader;
use crate::remote::Commit;
use crate::{Error, Result, SaveRecord, StepSummary};

/// A complete step's manifests.
#[derive(Clone, Debug)]
pub(crate) enum StepManifest {
    /// A step pushed from one store.
    Single(RemoteManifest),
    /// A global step: each rank's shard, by rank.
    Sharded {
        shards: Vec<RemoteManifest>,
        ids: Vec<ShardName>,
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

    /// Every object it needs (chunks, or packs).
    pub(crate) fn objects(&self) -> impl Iterator<Item = Object> + '_ {
        self.parts().iter().flat_map(RemoteManifest::objects)
    }

    /// The record retention ranks: time, loss and metrics of rank 0, the
    /// bytes of every rank.
    pub(crate) fn summary(&self) -> StepSummary {
        let parts = self.parts();
        let mut s = summary(&parts[0]);
        s.logical_bytes = parts
            .iter()
            .fold(0, |n, m| n.saturating_add(summary(m).logical_bytes));
        s.blobs = parts.iter().map(|m| m.blobs.len()).sum();
        s
    }
}

/// What a commit's manifest names: a step pushed from one store, or the
/// shards of a global step (not read yet).
#[derive(Clone, Debug)]
pub(crate) enum CommitBody {
    Single(Box<RemoteManifest>),
    Sharded(Vec<ShardName>),
}

/// Steps none of whose commits checks out, each with why its newest does
/// not.
type Skipped = Vec<(u64, String)>;

/// What a commit stands for, or why a reader cannot rely on it.
pub(crate) type Checked<T = StepManifest> = std::result::Result<T, Rejected>;

/// Shard manifests a coordinator's commit reads at once: a commit of N
/// ranks takes about N / this round trips, within S3's rate of reads per
/// prefix at tens of milliseconds a request.
pub(crate) const SHARDS_IN_FLIGHT: usize = 64;

/// Why a reader cannot rely on a commit, naming the object at fault by
/// its URL: a reader takes the step's newest commit that none of these
/// befalls.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Rejected {
    /// The manifest (or a shard) is not in the bucket.
    Missing { url: String },
    /// Its bytes do not hash to the hash its name gives.
    WrongHash { url: String },
    /// It could not be read whole (over the size cap).
    Unreadable { detail: String },
    /// Its bytes are no manifest this build decodes.
    Undecodable { url: String, why: String },
    /// Decoded, and refused by its checks ([`RemoteManifest::check`]).
    Refused { url: String, why: String },
    /// It names an object (a chunk or a pack) the bucket does not hold.
    Incomplete { url: String, object: String },
    /// The step has no commit at all.
    NoCommit,
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejected::Missing { url } => write!(f, "{url} is missing"),
            Rejected::WrongHash { url } => write!(f, "{url} fails its hash check"),
            Rejected::Unreadable { detail } => f.write_str(detail),
            Rejected::Undecodable { url, why } => {
                write!(f, "{url} is not a manifest this build reads ({why})")
            }
            Rejected::Refused { url, why } => write!(f, "{url}: {why}"),
            Rejected::Incomplete { url, object } => {
                write!(f, "{url}: it names {object}, which is missing")
            }
            Rejected::NoCommit => f.write_str("it has no commit"),
        }
    }
}

/// Why a read of a commit gave nothing, inside this file: the bucket
/// failed (an error for the caller) or the commit is rejected (a reader
/// passes over it). [`verdict`] parts them again.
enum Unsound {
    Failed(Error),
    Rejected(Rejected),
}

impl From<Error> for Unsound {
    fn from(e: Error) -> Self {
        Unsound::Failed(e)
    }
}

impl From<Rejected> for Unsound {
    fn from(why: Rejected) -> Self {
        Unsound::Rejected(why)
    }
}

/// `read`'s failure as an error, its rejection as a verdict.
fn verdict<T>(read: std::result::Result<T, Unsound>) -> Result<Checked<T>> {
    match read {
        Ok(value) => Ok(Ok(value)),
        Err(Unsound::Rejected(why)) => Ok(Err(why)),
        Err(Unsound::Failed(e)) => Err(e),
    }
}

impl Reader<'_> {
    /// What `commit` stands for, if its manifest is there, hashes right, is
    /// one this build reads, passes [`RemoteManifest::check`], and (given
    /// the bucket's chunks) names only chunks that are there; for a global
    /// step, the same of every shard.
    pub(crate) fn checked_manifest(
        &self,
        commit: Commit,
        chunks: Option<&HashSet<Object>>,
    ) -> Result<Checked> {
        verdict(self.manifest_of(commit, chunks))
    }

    fn manifest_of(
        &self,
        commit: Commit,
        chunks: Option<&HashSet<Object>>,
    ) -> std::result::Result<StepManifest, Unsound> {
        match self.commit_body(commit, chunks)? {
            CommitBody::Single(m) => Ok(StepManifest::Single(*m)),
            CommitBody::Sharded(ids) => {
                let shards = ids
                    .iter()
                    .map(|id| self.shard_of(commit.step, id, chunks))
                    .collect::<std::result::Result<_, _>>()?;
                Ok(StepManifest::Sharded { shards, ids })
            }
        }
    }

    /// What `commit` names, if its manifest is there, hashes right and
    /// passes its checks (for a step pushed from one store, also against
    /// `chunks`): one request, whatever the number of shards.
    pub(crate) fn read_commit(
        &self,
        commit: Commit,
        chunks: Option<&HashSet<Object>>,
    ) -> Result<Checked<CommitBody>> {
        verdict(self.commit_body(commit, chunks))
    }

    fn commit_body(
        &self,
        commit: Commit,
        chunks: Option<&HashSet<Object>>,
    ) -> std::result::Result<CommitBody, Unsound> {
        let key = self.bucket.layout.manifest(commit.step, &commit.hash);
        let (bytes, url) = self.get_hashed(&key, &commit.hash)?;
        let step = commit.step;
        let single = match serde_json::from_slice::<RemoteManifest>(&bytes) {
            Ok(m) => {
                let m = self.check_single(m, step, chunks, &url)?;
                return Ok(CommitBody::Single(Box::new(m)));
            }
            Err(e) => e,
        };
        let Ok(global) = serde_json::from_slice::<GlobalManifest>(&bytes) else {
            let why = single.to_string();
            return Err(Rejected::Undecodable { url, why }.into());
        };
        if let Err(why) = global.check(step) {
            return Err(Rejected::Refused { url, why }.into());
        }
        let world_size = global.world_size;
        let ids = (0..world_size)
            .zip(&global.shards)
            .map(|(rank, hash)| ShardName {
                rank,
                world_size,
                hash: hash.0,
            })
            .collect();
        Ok(CommitBody::Sharded(ids))
    }

    /// Shard `id` of `step`, if it is there, hashes right, passes
    /// [`RemoteManifest::check`], and (given the bucket's chunks) names
    /// only chunks that are there.
    pub(crate) fn checked_shard(
        &self,
        step: u64,
        id: &ShardName,
        chunks: Option<&HashSet<Object>>,
    ) -> Result<Checked<RemoteManifest>> {
        verdict(self.shard_of(step, id, chunks))
    }

    /// Each of `ids`' shard manifests of `step`, checked as
    /// [`checked_shard`](Self::checked_shard) checks one, in order; at
    /// most [`SHARDS_IN_FLIGHT`] requests in flight.
    pub(crate) fn checked_shards(
        &self,
        step: u64,
        ids: &[&ShardName],
    ) -> Result<Vec<Checked<RemoteManifest>>> {
        use futures::StreamExt;
        let reads = futures::stream::iter(ids.iter().map(|id| self.fetch_shard(step, id)));
        let found: Vec<_> = self
            .bucket
            .run(reads.buffered(SHARDS_IN_FLIGHT).collect())?;
        found.into_iter().collect()
    }

    /// [`checked_shard`](Self::checked_shard) without the chunks, as a future.
    async fn fetch_shard(&self, step: u64, id: &ShardName) -> Result<Checked<RemoteManifest>> {
        let key = self.bucket.layout.shard(step, id);
        let got = self.fetch_hashed(&key, &id.hash).await;
        verdict(got.and_then(|(bytes, url)| self.decoded_shard(&bytes, step, None, url)))
    }

    fn shard_of(
        &self,
        step: u64,
        id: &ShardName,
        chunks: Option<&HashSet<Object>>,
    ) -> std::result::Result<RemoteManifest, Unsound> {
        let (bytes, url) = self.get_hashed(&self.bucket.layout.shard(step, id), &id.hash)?;
        self.decoded_shard(&bytes, step, chunks, url)
    }

    /// A shard manifest of `step` from its bytes (read from `url`), checked.
    fn decoded_shard(
        &self,
        bytes: &[u8],
        step: u64,
        chunks: Option<&HashSet<Object>>,
        url: String,
    ) -> std::result::Result<RemoteManifest, Unsound> {
        match serde_json::from_slice::<RemoteManifest>(bytes) {
            Ok(m) => Ok(self.check_single(m, step, chunks, &url)?),
            Err(e) => Err(Rejected::Undecodable {
                url,
                why: e.to_string(),
            }
            .into()),
        }
    }

    /// Of `commits` (ascending), the newest that checks out against the
    /// bucket's `chunks`, with what it stands for.
    pub(crate) fn newest_complete(
        &self,
        commits: &[Commit],
        chunks: &HashSet<Object>,
    ) -> Result<Option<(Commit, StepManifest)>> {
        Ok(self.newest_or_why(commits, chunks)?.ok())
    }

    /// Of `commits` (ascending, one step's, at least one), the newest that
    /// checks out against the bucket's `chunks`, or why the newest does not
    /// when none does: what a reader gets of the step.
    pub(crate) fn newest_or_why(
        &self,
        commits: &[Commit],
        chunks: &HashSet<Object>,
    ) -> Result<Checked<(Commit, StepManifest)>> {
        let mut why = None;
        for c in commits.iter().rev() {
            match self.checked_manifest(*c, Some(chunks))? {
                Ok(m) => return Ok(Ok((*c, m))),
                Err(reason) => {
                    why.get_or_insert(reason);
                }
            }
        }
        Ok(Err(why.unwrap_or(Rejected::NoCommit)))
    }

    /// Step `step`'s newest commit that checks out against the bucket's
    /// `chunks`, reading only that step's manifests.
    pub(crate) fn complete_step(
        &self,
        step: u64,
        chunks: &HashSet<Object>,
    ) -> Result<Option<(Commit, StepManifest)>> {
        self.newest_complete(&self.commits_of(step)?, chunks)
    }

    /// The bytes at `key` if they are there, within [`MAX_MANIFEST_BYTES`]
    /// and hash to `hash`, with the object's URL; else why not.
    fn get_hashed(
        &self,
        key: &object_store::path::Path,
        hash: &Hash,
    ) -> std::result::Result<(bytes::Bytes, String), Unsound> {
        self.bucket.run(self.fetch_hashed(key, hash))?
    }

    /// [`get_hashed`](Self::get_hashed), as a future.
    async fn fetch_hashed(
        &self,
        key: &object_store::path::Path,
        hash: &Hash,
    ) -> std::result::Result<(bytes::Bytes, String), Unsound> {
        let url = self.bucket.layout.url_of(&self.bucket.url, key);
        let bytes = match self.bucket.fetch_bytes(key, MAX_MANIFEST_BYTES).await {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Err(Rejected::Missing { url }.into()),
            Err(Error::Corrupt { detail, .. }) => {
                return Err(Rejected::Unreadable { detail }.into())
            }
            Err(e) => return Err(e.into()),
        };
        if blake3::hash(&bytes).as_bytes() != hash {
            return Err(Rejected::WrongHash { url }.into());
        }
        Ok((bytes, url))
    }

    /// Does the work of [`Remote::skipped_steps`](crate::Remote::skipped_steps).
    pub(crate) fn skipped_steps(&self) -> Result<Vec<(u64, String)>> {
        Ok(self.sort_steps()?.1)
    }

    /// Each complete step's newest commit that checks out, with what it
    /// stands for, ascending.
    pub(crate) fn complete(&self) -> Result<Vec<(Commit, StepManifest)>> {
        Ok(self.sort_steps()?.0)
    }

    /// One pass over the commits, newest first within each step: each
    /// step's newest commit that checks out (ascending), and the steps none
    /// of whose commits do, with why their newest does not.
    fn sort_steps(&self) -> Result<(Vec<(Commit, StepManifest)>, Skipped)> {
        let commits = self.commits()?;
        let (mut complete, mut skipped) = (Vec::new(), Vec::new());
        if commits.is_empty() {
            return Ok((complete, skipped));
        }
        let chunks = self.bucket.objects()?;
        // Commits come sorted by step: one group per step.
        for of_step in commits.chunk_by(|a, b| a.step == b.step) {
            match self.newest_or_why(of_step, &chunks)? {
                Ok(found) => complete.push(found),
                Err(why) => skipped.push((of_step[0].step, why.to_string())),
            }
        }
        Ok((complete, skipped))
    }
}

impl Reader<'_> {
    /// `m` (read from `url`) as step `step`'s manifest, if it passes its
    /// checks and (given the bucket's chunks and packs) names only objects
    /// that are there; else why not, naming the object missing by its URL.
    fn check_single(
        &self,
        m: RemoteManifest,
        step: u64,
        chunks: Option<&HashSet<Object>>,
        url: &str,
    ) -> Checked<RemoteManifest> {
        if let Err(why) = m.check(step) {
            let url = url.to_owned();
            return Err(Rejected::Refused { url, why });
        }
        if let Some(chunks) = chunks {
            if let Some(o) = m.objects().into_iter().find(|o| !chunks.contains(o)) {
                let key = match o {
                    Object::Chunk(h) => self.bucket.layout.chunk(&h),
                    Object::Pack(h) => self.bucket.layout.pack(&h),
                };
                let object = self.bucket.layout.url_of(&self.bucket.url, &key);
                let url = url.to_owned();
                return Err(Rejected::Incomplete { url, object });
            }
        }
        Ok(m)
    }
}

/// The retention record of one manifest.
fn summary(m: &RemoteManifest) -> StepSummary {
    let mut metrics = m.metrics.clone();
    let save_record = if m.save_record.is_empty() {
        SaveRecord::from_legacy_metrics(&mut metrics, |n| m.blobs.contains_key(n))
    } else {
        (*m.save_record).clone()
    };
    StepSummary {
        step: m.step,
        timestamp: m.timestamp,
        loss_cid: m.loss_cid.clone(),
        metrics,
        logical_bytes: m.blobs.values().fold(0, |n, b| n.saturating_add(b.len)),
        bytes_written: 0,
        stored_bytes: 0,
        blobs: m.blobs.len(),
        save_record,
    }
}

/// A stored copy of a chunk: its own object (formats 1-2), or a place in
/// a pack (formats 3-4, where two writers that did not know of each other
/// may each have packed the same chunk).
pub(crate) type StoredCopy = (Object, Option<u64>);

/// Bytes of the stored copies of `m`'s chunks not in `seen`, which takes
/// them: their own, and as their packs hold them (fewer where they are
/// stored compressed). A chunk packed twice counts twice: these are
/// bytes the bucket holds.
pub(crate) fn new_bytes(m: &RemoteManifest, seen: &mut HashSet<StoredCopy>) -> (u64, u64) {
    let (mut raw, mut held) = (0u64, 0u64);
    let mut add = |hash: &HexHash, n: u64| {
        // A manifest's checks refuse a chunk its index does not place.
        if let Some((object, at, stored)) = m.locate(&hash.0) {
            if seen.insert((object, at)) {
                raw = raw.saturating_add(n);
                held = held.saturating_add(stored.len(n));
            }
        }
    };
    for blob in m.blobs.values() {
        for (hash, n) in blob.chunks().iter().zip(blob.chunk_lengths()) {
            add(hash, n as u64);
        }
    }
    if let Some(p) = &m.packed {
        add(&p.hash, p.len);
    }
    (raw, held)
}
