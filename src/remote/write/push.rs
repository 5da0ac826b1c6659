//! `Remote::push`: upload every committed step the bucket lacks.
//!
//! Per step, in order: the step's chunks the bucket lacks, in pack objects
//! (bucket format 3; read from the store as each pack is filled, a few
//! packs in flight), then its manifest (the store's own, with the packs
//! and the index of where each chunk lies), then the commit object. A
//! step is visible in the bucket only once its commit is there, and a
//! rerun after any failure skips what landed.
//!
//! What the bucket holds comes from one of two places ([`knowledge`]):
//! what the store remembers of it, while the bucket's collection mark is
//! the one remembered; else a listing. Where the bucket's chunks lie comes
//! from the manifests of the steps the push builds on (the step below the
//! first one pushed, and an older commit of a step pushed again), one GET
//! each, and from what this remote wrote or read before ([`packs`]):
//! nothing is asked of the bucket per chunk.
//!
//! A step committed again with other content (a rollback and redo) is
//! pushed under a commit of a newer generation, which readers take. A push
//! writes only into a prefix that holds its store's run (see
//! [`owner`](crate::remote::coordination::owner)).
//!
//! [`knowledge`]: crate::remote::write::knowledge
//! [`packs`]: crate::remote::write::packs

use std::collections::HashSet;

use bytes::Bytes;

use crate::engine::{ChunkPlace, Pushed, StepData};
use crate::format::manifest::Hash;
use crate::remote::coordination::locks::Lock;
use crate::remote::format::layout::encode;
use crate::remote::format::manifest::RemoteManifest;
use crate::remote::write::knowledge::{Knowledge, Verdict};
use crate::remote::write::Writer;
use crate::remote::Commit;
use crate::{CheckpointStore, GradientCheckpoint, Result, StepInfo};

/// What [`Remote::push`](crate::Remote::push) did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PushReport {
    /// Steps uploaded by this push, ascending.
    pub steps_pushed: Vec<u64>,
    /// Steps the bucket had already (or that retention deleted from it).
    pub steps_present: u64,
    /// Bytes of chunks uploaded, as sent (compressed where a chunk was
    /// stored compressed: [`Remote::with_compression`](crate::Remote::with_compression)).
    pub bytes_uploaded: u64,
    /// The chunks uploaded, at their own lengths: `bytes_uploaded` where
    /// none was stored compressed.
    pub raw_bytes_uploaded: u64,
    /// Bytes of chunks (their own lengths) not uploaded because the bucket had them.
    pub bytes_skipped: u64,
    /// Chunks uploaded (in pack objects).
    pub chunks_uploaded: u64,
}

/// What a push did with one step, and what the store is to remember of
/// it: the bucket holds the store's version of it whole under `commit`.
pub(crate) struct Done {
    pub(crate) pushed: bool,
    pub(crate) remember: Pushed,
}

impl Done {
    /// Uploaded now.
    fn pushed(commit: Commit) -> Done {
        let remember = Pushed {
            generation: commit.generation,
            hash: commit.hash,
            whole: true,
        };
        Done {
            pushed: true,
            remember,
        }
    }

    /// Already there (or deleted by retention).
    fn present(commit: Commit) -> Done {
        Done {
            pushed: false,
            ..Done::pushed(commit)
        }
    }
}

impl Writer<'_> {
    /// Does the work of [`Remote::push`](crate::Remote::push).
    pub(crate) fn push(&self, store: &CheckpointStore) -> Result<PushReport> {
        self.push_with(store, &mut |_, _| true)
    }

    /// Does the work of [`Remote::push_with`](crate::Remote::push_with).
    pub(crate) fn push_with(
        &self,
        store: &CheckpointStore,
        progress: &mut dyn FnMut(u64, u64) -> bool,
    ) -> Result<PushReport> {
        self.with_push_lock(|lock| self.push_locked(store, lock, progress, false))
    }

    /// Does the work of [`Remote::repair`](crate::Remote::repair).
    pub(crate) fn repair(&self, store: &CheckpointStore) -> Result<PushReport> {
        self.with_push_lock(|lock| self.push_locked(store, lock, &mut |_, _| true, true))
    }

    fn push_locked(
        &self,
        store: &CheckpointStore,
        lock: &mut Lock,
        progress: &mut dyn FnMut(u64, u64) -> bool,
        repair: bool,
    ) -> Result<PushReport> {
        self.claim(&store.store_id()?)?;
        // Read once the lock is held: a collection that starts later (only
        // if the lock lapses) changes it, and the next push lists.
        let mark = self.collection_mark()?;
        if repair {
            self.known()?.clear();
        }
        let knowledge = Knowledge::of(self, store.remembered(&self.bucket.url)?, &mark, repair)?;
        let report = self.push_steps(store, &knowledge, &mark, lock, progress)?;
        if store.is_read_only() && !report.steps_pushed.is_empty() {
            // Commits the writer's memory of the bucket does not know of.
            self.new_collection_mark()?;
        }
        Ok(report)
    }

    /// Push every step of `store` that `knowledge` does not show whole in
    /// the bucket; then the store remembers what the bucket holds as of
    /// `mark` (step by step when it trusted its memory, all at once after
    /// a listing).
    fn push_steps(
        &self,
        store: &CheckpointStore,
        knowledge: &Knowledge,
        mark: &[u8],
        lock: &mut Lock,
        progress: &mut dyn FnMut(u64, u64) -> bool,
    ) -> Result<PushReport> {
        let mut report = PushReport::default();
        let mut memo = knowledge.bucket_commits();
        let mut first = true;
        for step in store.steps()? {
            if let Some(p) = knowledge.whole_unread(step) {
                memo.insert(step, p);
                report.steps_present += 1;
                continue;
            }
            self.refresh(lock)?;
            if std::mem::take(&mut first) {
                // What the first step pushed builds on: the step below.
                self.learn_from(knowledge.newest_below(step), knowledge, mark)?;
            }
            let done = store.with_step_once(step, |ckpt, info, data| {
                let todo = StepPush {
                    step,
                    ckpt: &ckpt,
                    info: &info,
                    data,
                };
                self.push_step(&todo, knowledge, mark, lock, &mut report, progress)
            })?;
            // None: removed since it was listed.
            let Some(done) = done else { continue };
            if knowledge.is_listed() {
                memo.insert(step, done.remember);
            } else {
                store.remember(&self.bucket.url, mark, false, &[(step, done.remember)])?;
            }
            if done.pushed {
                report.steps_pushed.push(step);
            } else {
                report.steps_present += 1;
            }
            if !progress(step, report.bytes_uploaded) {
                break;
            }
        }
        if knowledge.is_listed() {
            let memo: Vec<(u64, Pushed)> = memo.into_iter().collect();
            store.remember(&self.bucket.url, mark, true, &memo)?;
        }
        Ok(report)
    }

    /// Push one stored step, unless `knowledge` shows it in the bucket:
    /// its new chunks in packs, its manifest and its commit.
    fn push_step(
        &self,
        todo: &StepPush<'_, '_>,
        knowledge: &Knowledge,
        mark: &[u8],
        lock: &mut Lock,
        report: &mut PushReport,
        progress: &mut dyn FnMut(u64, u64) -> bool,
    ) -> Result<Done> {
        let step = todo.step;
        let mut manifest = remote_manifest(todo.ckpt, todo.info, todo.data)?;
        manifest.check_to_write(step)?;
        let chunks = step_chunks(todo.data)?;
        let pieces: Vec<(Hash, u64)> = chunks.iter().map(|c| (c.hash, c.len as u64)).collect();
        let newest = match knowledge.verdict(step, &encode(step, &manifest)?.1, &pieces) {
            Verdict::Present(commit) => return Ok(Done::present(commit)),
            Verdict::Push(newest) => newest,
        };
        // A step pushed again builds on what its older commit holds.
        self.learn_from(newest, knowledge, mark)?;
        let mut read = |i: usize| chunks[i].read(todo.data).map(Bytes::from);
        let mut landed = report.bytes_uploaded;
        let widths = self.widths([&manifest]);
        let packed = self.pack(&pieces, &widths, &mut read, mark, lock, &mut |n| {
            landed += n;
            progress(step, landed);
            Ok(())
        })?;
        let total: u64 = pieces.iter().map(|(_, n)| n).sum();
        report.bytes_uploaded += packed.bytes_uploaded;
        report.raw_bytes_uploaded += packed.raw_bytes_uploaded;
        report.bytes_skipped += total.saturating_sub(packed.raw_bytes_uploaded);
        report.chunks_uploaded += packed.chunks_uploaded;
        manifest.format = packed.format;
        (manifest.packs, manifest.index) = (Some(packed.packs), Some(packed.index));
        manifest.check_to_write(step)?;
        let (bytes, hash) = encode(step, &manifest)?;
        let commit = Commit::after(newest, step, hash);
        // The same manifest as the newest commit's: the step is there
        // unless packs (uploaded again now) or its manifest were missing.
        let there = newest == Some(commit) && knowledge.has_manifest(step, &hash);
        if !there {
            self.put_step(&commit, bytes)?;
        }
        self.known()?.learned(mark, step, hash);
        Ok(if there && packed.bytes_uploaded == 0 {
            Done::present(commit)
        } else {
            Done::pushed(commit)
        })
    }

    /// Learn where the chunks of `commit`'s step lie, if it is a step
    /// pushed from a store in format 3 whose manifest this remote has not
    /// read yet while the bucket's mark is `mark` (one GET). After a
    /// listing, only packs the listing found are learned (a repair then
    /// uploads again what was deleted by hand).
    fn learn_from(&self, commit: Option<Commit>, knowledge: &Knowledge, mark: &[u8]) -> Result<()> {
        let Some(c) = commit else { return Ok(()) };
        if self.known()?.has_learned(mark, c.step, c.hash) {
            return Ok(());
        }
        if let Ok(crate::remote::read::step::CommitBody::Single(m)) = self.read_commit(c, None)? {
            let there = |pack: &Hash| knowledge.pack_is_there(pack);
            self.learn_where(&m, mark, &there)?;
        }
        self.known()?.learned(mark, c.step, c.hash);
        Ok(())
    }
}

/// One stored step to push: what one read of it gives.
struct StepPush<'a, 'd> {
    step: u64,
    ckpt: &'a GradientCheckpoint,
    info: &'a StepInfo,
    data: &'a StepData<'d>,
}

/// One chunk of a step: of a blob, or the step's packed blobs.
pub(crate) struct StepChunk {
    pub(crate) hash: Hash,
    pub(crate) len: usize,
    what: Missing,
}

impl StepChunk {
    /// Its bytes, read from the store.
    fn read(&self, data: &StepData<'_>) -> Result<Vec<u8>> {
        match &self.what {
            Missing::Chunk(place) => data.read_chunk(place),
            Missing::Packed => data.packed_bytes(),
        }
    }
}

/// Where a chunk's bytes are in the store.
enum Missing {
    Chunk(ChunkPlace),
    Packed,
}

/// The chunks of the step, each once.
pub(crate) fn step_chunks(data: &StepData<'_>) -> Result<Vec<StepChunk>> {
    let mut seen = HashSet::new();
    let mut chunks = Vec::new();
    if let Some(p) = data.packed_ref() {
        seen.insert(p.hash);
        chunks.push(StepChunk {
            hash: p.hash,
            len: usize::try_from(p.len).unwrap_or(usize::MAX),
            what: Missing::Packed,
        });
    }
    for name in data.blob_refs().keys() {
        for place in data.chunk_places(name)? {
            if seen.insert(place.hash) {
                chunks.push(StepChunk {
                    hash: place.hash,
                    len: place.len,
                    what: Missing::Chunk(place),
                });
            }
        }
    }
    Ok(chunks)
}

/// The bucket's manifest of a stored step, from the store's manifest
/// (formats 1 and 2: chunks named by hash, where they lie not yet said).
fn remote_manifest(
    ckpt: &GradientCheckpoint,
    info: &StepInfo,
    data: &StepData<'_>,
) -> Result<RemoteManifest> {
    let typed = |name: &str| info.tensors.get(name).map(|t| (t.dtype, t.shape.clone()));
    RemoteManifest::from_model(ckpt, data.blob_refs(), &typed, data.packed_ref())
}
