//! Retention in the bucket: a doomed step's deletion marker is written,
//! then its commit deleted (readers stop seeing it), then its manifest;
//! chunks no remaining step names are deleted by a garbage collection that
//! a push in flight holds off (see [`locks`](crate::remote::coordination::locks)).

use std::collections::{BTreeSet, HashSet};

use crate::format::manifest::Hash;
use crate::remote::coordination::locks::LockKind;
use crate::remote::format::layout::{parse_chunk, ShardName, StepHash, CHUNKS, MANIFESTS, PACKS};
use crate::remote::format::manifest::RemoteManifest;
use crate::remote::format::pack_format::Object;
use crate::remote::gc::Collector;
use crate::remote::read::step::StepManifest;
use crate::remote::Commit;
use crate::{Result, Retention};

/// What a garbage collection of the bucket did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GcReport {
    /// Steps the retention policy deleted, ascending.
    pub steps_removed: Vec<u64>,
    /// Chunk objects deleted.
    pub chunks_deleted: u64,
    /// Pack objects deleted (bucket format 3) that no remaining step or
    /// young shard needs.
    pub packs_deleted: u64,
    /// Bytes of the chunks and packs deleted.
    pub bytes_deleted: u64,
    /// Manifests deleted that no commit named (left by killed pushes), and
    /// shards of global steps that did not complete within the grace
    /// period.
    pub manifests_deleted: u64,
    /// Unreferenced objects kept because they are younger than the grace
    /// period.
    pub young_kept: u64,
    /// Commits of steps committed again since (a rollback and redo, or a
    /// repack), deleted: a newer commit of the step checks out.
    pub commits_superseded: u64,
    /// Packs written by rewriting packs more than half of whose bytes no
    /// step needed (the old packs are deleted by the next collection).
    pub packs_repacked: u64,
    /// Bytes of the packs written so.
    pub bytes_repacked: u64,
    /// True when nothing was deleted because a push was in flight (its
    /// lock was live): run it again later.
    pub deferred: bool,
}

impl Collector<'_> {
    /// Does the work of [`Remote::retention_preview`](crate::Remote::retention_preview).
    pub(crate) fn retention_preview(&self, policy: &Retention) -> Result<Vec<u64>> {
        Ok(policy.doomed(&self.summaries()?, &BTreeSet::new()))
    }

    /// Does the work of [`Remote::apply_retention`](crate::Remote::apply_retention).
    pub(crate) fn apply_retention(&self, policy: &Retention) -> Result<Vec<u64>> {
        Ok(self.gc(policy)?.steps_removed)
    }

    /// Does the work of [`Remote::gc`](crate::Remote::gc).
    pub(crate) fn gc(&self, policy: &Retention) -> Result<GcReport> {
        policy.check_keeps_something()?;
        let doomed = self.retention_preview(policy)?;
        let commits = self.commits()?;
        for &step in &doomed {
            for c in commits.iter().filter(|c| c.step == step) {
                let (shards, unpacked) = match self.checked_manifest(*c, None)? {
                    Ok(StepManifest::Sharded { ids, .. }) => (ids, None),
                    Ok(StepManifest::Single(m)) => (Vec::new(), m.unpacked_hash()?),
                    Err(_) => (Vec::new(), None),
                };
                self.bucket
                    .put(&self.bucket.layout.deleted(step, &c.hash), Vec::new())?;
                if let Some(hash) = unpacked.filter(|h| *h != c.hash) {
                    self.bucket
                        .put(&self.bucket.layout.deleted(step, &hash), Vec::new())?;
                }
                self.bucket.delete(&self.bucket.layout.commit(c))?;
                self.bucket
                    .delete(&self.bucket.layout.manifest(step, &c.hash))?;
                for id in &shards {
                    self.bucket.delete(&self.bucket.layout.shard(step, id))?;
                }
            }
        }
        let mut report = self.collect_garbage()?;
        report.steps_removed = doomed;
        Ok(report)
    }

    /// Does the work of [`Remote::collect_garbage`](crate::Remote::collect_garbage).
    pub(crate) fn collect_garbage(&self) -> Result<GcReport> {
        let lock = self.write_lock(LockKind::Gc)?;
        let result = self.live_locks(LockKind::Push, &lock).and_then(|pushes| {
            if pushes.is_empty() {
                self.collect_locked()
            } else {
                Ok(GcReport {
                    deferred: true,
                    ..GcReport::default()
                })
            }
        });
        self.release(lock);
        result
    }

    fn collect_locked(&self) -> Result<GcReport> {
        // Before anything is deleted: what stores remember of the bucket
        // no longer holds.
        self.new_collection_mark()?;
        let mut report = GcReport::default();
        let mut current: Vec<(Commit, StepManifest)> = Vec::new();
        for c in self.current_commits(&mut report)? {
            // A commit whose manifest is missing or damaged names nothing
            // that can be read; `verify` reports it.
            if let Ok(m) = self.checked_manifest(c, None)? {
                current.push((c, m));
            }
        }
        let named_shards = |current: &[(Commit, StepManifest)]| -> HashSet<(u64, ShardName)> {
            let ids = current.iter().flat_map(|(c, m)| match m {
                StepManifest::Sharded { ids, .. } => ids.iter().map(|id| (c.step, *id)).collect(),
                StepManifest::Single(_) => Vec::new(),
            });
            ids.collect()
        };
        let cutoff = self.cutoff()?;
        // Shards of steps not complete: young ones may still be joined by
        // the other ranks' (their chunks stay); old ones go.
        let shards = self.bucket.list_shards()?;
        let named = named_shards(&current);
        let mut young = Vec::new();
        for (step, id, modified) in &shards {
            if !named.contains(&(*step, *id)) && *modified >= cutoff {
                if let Ok(m) = self.checked_shard(*step, id, None)? {
                    young.push(m);
                }
            }
        }
        // Old commits and packs stay until the next collection: readers
        // that opened them keep reading.
        let repacked = self.repack(&current, &young)?;
        report.packs_repacked = repacked.packs;
        report.bytes_repacked = repacked.bytes;
        current.extend(repacked.steps);
        let named = named_shards(&current);
        let mut needed: HashSet<Object> = young.iter().flat_map(RemoteManifest::objects).collect();
        needed.extend(current.iter().flat_map(|(_, m)| m.objects()));
        for (step, id, modified) in shards {
            if named.contains(&(step, id)) {
                continue;
            }
            if modified >= cutoff {
                report.young_kept += 1;
                continue;
            }
            self.bucket.delete(&self.bucket.layout.shard(step, &id))?;
            report.manifests_deleted += 1;
        }
        let named: HashSet<(u64, Hash)> = current.iter().map(|(c, _)| (c.step, c.hash)).collect();
        let (manifests, _) = self.sweep(MANIFESTS, cutoff, &mut report, |key| {
            let stem = key.strip_suffix(".json").unwrap_or(key);
            stem.parse::<StepHash>()
                .is_ok_and(|n| named.contains(&(n.step, n.hash)))
        })?;
        report.manifests_deleted += manifests;
        let (chunks, bytes) = self.sweep(CHUNKS, cutoff, &mut report, |key| {
            parse_chunk(key).is_some_and(|h| needed.contains(&Object::Chunk(h)))
        })?;
        let (packs, pack_bytes) = self.sweep(PACKS, cutoff, &mut report, |key| {
            parse_chunk(key).is_some_and(|h| needed.contains(&Object::Pack(h)))
        })?;
        report.chunks_deleted = chunks;
        report.packs_deleted = packs;
        report.bytes_deleted = bytes + pack_bytes;
        Ok(report)
    }

    /// The commits that stay: of each step, the newest that checks out and
    /// every newer one (a damaged newer commit is for `verify` to report);
    /// older ones are superseded (a step committed again) and deleted here.
    fn current_commits(&self, report: &mut GcReport) -> Result<Vec<Commit>> {
        let commits = self.commits()?;
        if commits.is_empty() {
            return Ok(commits);
        }
        let chunks = self.bucket.objects()?;
        let mut current = Vec::new();
        for of_step in commits.chunk_by(|a, b| a.step == b.step) {
            let Some((newest, _)) = self.newest_complete(of_step, &chunks)? else {
                current.extend_from_slice(of_step);
                continue;
            };
            for c in of_step {
                if *c >= newest {
                    current.push(*c);
                } else {
                    self.bucket.delete(&self.bucket.layout.commit(c))?;
                    report.commits_superseded += 1;
                }
            }
        }
        Ok(current)
    }

    /// Delete each object of `folder` that `keep` does not keep, unless it
    /// was modified at or after `cutoff` (counted as young); returns the
    /// objects and bytes deleted.
    fn sweep(
        &self,
        folder: &str,
        cutoff: i64,
        report: &mut GcReport,
        keep: impl Fn(&str) -> bool,
    ) -> Result<(u64, u64)> {
        let (mut objects, mut bytes) = (0, 0);
        for (key, modified, size) in self.bucket.list_meta(folder)? {
            if keep(&key) {
                continue;
            }
            if modified >= cutoff {
                report.young_kept += 1;
                continue;
            }
            self.bucket
                .delete(&self.bucket.layout.folder(folder).join(key.as_str()))?;
            objects += 1;
            bytes += size;
        }
        Ok((objects, bytes))
    }

    /// Objects modified at or after this time (server clock, ms since the
    /// epoch) are younger than the grace period. The server's clock is read
    /// off the newest lock, which this collection just wrote.
    fn cutoff(&self) -> Result<i64> {
        let now = self
            .bucket
            .list_meta(crate::remote::format::layout::LOCKS)?
            .iter()
            .map(|(_, t, _)| *t)
            .max()
            .unwrap_or(0);
        let grace = i64::try_from(self.grace.as_millis()).unwrap_or(i64::MAX);
        Ok(now.saturating_sub(grace))
    }
}
