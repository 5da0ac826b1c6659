//! `Remote::push`: upload every committed step the bucket lacks.
//!
//! Per step, in order: the chunks the bucket lacks (read from the store one
//! at a time, several uploads in flight), then the manifest, then the
//! commit object. The manifest is built from the store's own manifest
//! (same chunks, same hashes), so a step already in the bucket costs a
//! metadata read, not a read of its data. A step is visible in the bucket
//! only once its commit is there, and a rerun after any failure skips what
//! landed: chunks are listed first, and a step whose newest commit names
//! the same content and whose chunks are all there is done.
//!
//! A step committed again with other content (a rollback and redo) is
//! pushed under a commit of a newer generation, which readers take. A push
//! writes only into a prefix that holds its store's run (see
//! [`owner`](crate::remote::coordination::owner)).

use std::collections::{BTreeMap, BTreeSet, HashSet};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectStoreExt, PutPayload};

use crate::engine::{ChunkPlace, Pushed, StepData};
use crate::format::manifest::Hash;
use crate::remote::coordination::locks::Lock;
use crate::remote::format::layout::{encode, RemoteManifest};
use crate::remote::{remote_error, Commit, Remote};
use crate::{CheckpointStore, Error, GradientCheckpoint, Result, StepInfo};

/// Uploads in flight at once.
pub(crate) const UPLOADS_IN_FLIGHT: usize = 8;

/// What [`Remote::push`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PushReport {
    /// Steps uploaded by this push, ascending.
    pub steps_pushed: Vec<u64>,
    /// Steps the bucket had already (or that retention deleted from it).
    pub steps_present: u64,
    /// Bytes of chunks uploaded.
    pub bytes_uploaded: u64,
    /// Bytes of chunks not uploaded because the bucket had them.
    pub bytes_skipped: u64,
    /// Chunk objects uploaded.
    pub chunks_uploaded: u64,
}

/// What a push did with one step, and what the store is to remember of
/// it.
pub(crate) struct Done {
    pub(crate) pushed: bool,
    pub(crate) remember: Pushed,
    pub(crate) chunks: Vec<Hash>,
}

impl Done {
    /// Uploaded now: the bucket holds it whole.
    pub(crate) fn pushed(generation: u64, hash: Hash, chunks: Vec<Hash>) -> Done {
        let remember = Pushed {
            generation,
            hash,
            whole: true,
        };
        Done {
            pushed: true,
            remember,
            chunks,
        }
    }

    /// Already there (or deleted by retention, with no `chunks`).
    pub(crate) fn present(generation: u64, hash: Hash, chunks: Vec<Hash>) -> Done {
        Done {
            pushed: false,
            ..Done::pushed(generation, hash, chunks)
        }
    }
}

/// What makes a step visible once its manifest is encoded: its chunks
/// (those `missing` uploaded), then its manifest `bytes` and `commit`.
pub(crate) struct Landing<'a> {
    pub(crate) commit: Commit,
    pub(crate) bytes: Vec<u8>,
    pub(crate) chunks: &'a [StepChunk],
    pub(crate) missing: &'a [&'a StepChunk],
}

impl Remote {
    /// Upload every committed step of `store` that this bucket lacks, deduplicated by content
    /// against everything in the bucket. Idempotent and resumable: rerun
    /// after any failure or kill, it finishes the job without uploading
    /// again what landed. A step that the bucket's retention deleted
    /// ([`Remote::apply_retention`]) is not uploaded again.
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Remote};
    /// # let dir = tempfile::tempdir()?;
    /// let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
    /// ckpt.set_optimizer_state("adam_m", vec![7u8; 1 << 20]);
    /// store.commit(&ckpt)?;
    ///
    /// let bucket = dir.path().join("bucket");
    /// let remote = Remote::open(&format!("file://{}", bucket.display()))?;
    /// let report = remote.push(&store)?;
    /// assert_eq!(report.steps_pushed, vec![1]);
    /// assert_eq!(remote.push(&store)?.steps_present, 1); // nothing to do
    /// assert_eq!(remote.get(1)?, Some(ckpt));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Remote`] when the bucket cannot be reached or refuses a
    /// request (after bounded retries); [`Error::RemoteBusy`] when a
    /// garbage collection of the bucket holds its lock for longer than the
    /// grace period; store errors as for reads.
    pub fn push(&self, store: &CheckpointStore) -> Result<PushReport> {
        self.push_with(store, &mut |_, _| true)
    }

    /// [`push`](Self::push), calling `progress(step, bytes_uploaded)` after
    /// each chunk lands and each step is done (for progress bars); the push
    /// stops early, with what it did so far, when `progress` returns false.
    pub fn push_with(
        &self,
        store: &CheckpointStore,
        progress: &mut dyn FnMut(u64, u64) -> bool,
    ) -> Result<PushReport> {
        self.with_push_lock(|lock| self.push_locked(store, lock, progress, false))
    }

    /// [`push`](Self::push) that lists the bucket rather than trust what the
    /// store remembers of it, so that it also repairs steps whose chunks or
    /// manifests were deleted by hand (a plain push notices only what a
    /// garbage collection deleted). Costs one listing of the bucket.
    pub fn repair(&self, store: &CheckpointStore) -> Result<PushReport> {
        self.with_push_lock(|lock| self.push_locked(store, lock, &mut |_, _| true, true))
    }

    fn push_locked(
        &self,
        store: &CheckpointStore,
        lock: &mut Lock,
        progress: &mut dyn FnMut(u64, u64) -> bool,
        list: bool,
    ) -> Result<PushReport> {
        self.claim(&store.store_id()?)?;
        // Read once the lock is held: a collection that starts later (only
        // if the lock lapses) changes it, and the next push lists.
        let mark = self.collection_mark()?;
        let report = match store.remembered(&self.url)? {
            Some(known) if known.mark == mark && !list => {
                self.push_known(store, &known, lock, progress)?
            }
            _ => self.push_listed(store, &mark, lock, progress)?,
        };
        if store.is_read_only() && !report.steps_pushed.is_empty() {
            // Commits the writer's memory of the bucket does not know of.
            self.new_collection_mark()?;
        }
        Ok(report)
    }

    /// Push after listing the bucket's commits, deletion markers, manifests
    /// and chunks; then the store remembers what the bucket holds as of
    /// `mark`.
    fn push_listed(
        &self,
        store: &CheckpointStore,
        mark: &[u8],
        lock: &mut Lock,
        progress: &mut dyn FnMut(u64, u64) -> bool,
    ) -> Result<PushReport> {
        let mut report = PushReport::default();
        let commits = self.commits()?;
        // Ascending: the last commit of a step is its newest.
        let newest: BTreeMap<u64, Commit> = commits.iter().map(|c| (c.step, *c)).collect();
        let deleted: HashSet<(u64, Hash)> = self.deleted()?.into_iter().collect();
        let manifests = self.manifest_names()?;
        let mut present: HashSet<Hash> = self.chunk_hashes()?;
        let mut memo: BTreeMap<u64, Pushed> = newest
            .values()
            .map(|c| {
                let p = Pushed {
                    generation: c.generation,
                    hash: c.hash,
                    whole: false,
                };
                (c.step, p)
            })
            .collect();
        // Each chunk once, though many steps share it.
        let mut memo_chunks: HashSet<Hash> = HashSet::new();
        for step in store.steps()? {
            self.refresh(lock)?;
            let done = store.with_step_once(step, |ckpt, info, data| {
                let (bytes, hash) = encoded(step, &ckpt, &info, data)?;
                let generation_there = newest.get(&step).map_or(0, |c| c.generation);
                if deleted.contains(&(step, hash)) {
                    return Ok(Done::present(generation_there, hash, Vec::new()));
                }
                let chunks = step_chunks(data)?;
                let hashes: Vec<Hash> = chunks.iter().map(|c| c.hash).collect();
                // The same content as the newest commit, whole: done. The
                // same content with its manifest or chunks missing (chunks
                // collected after a lock lapsed): repaired under the same
                // commit.
                let same = newest.get(&step).filter(|c| c.hash == hash);
                let whole = manifests.contains(&(step, hash))
                    && chunks.iter().all(|c| present.contains(&c.hash));
                if let (Some(c), true) = (same, whole) {
                    return Ok(Done::present(c.generation, hash, hashes));
                }
                let commit = Commit::after(newest.get(&step).copied(), step, hash);
                let generation = commit.generation;
                let before = report.bytes_uploaded;
                let missing = count_missing(&chunks, &mut present, &mut report);
                let landing = Landing {
                    commit,
                    bytes,
                    chunks: &chunks,
                    missing: &missing,
                };
                self.land(data, landing, lock, before, progress)?;
                Ok(Done::pushed(generation, hash, hashes))
            })?;
            // None: removed since it was listed.
            if let Some(done) = done {
                memo.insert(step, done.remember);
                memo_chunks.extend(done.chunks);
                if done.pushed {
                    report.steps_pushed.push(step);
                } else {
                    report.steps_present += 1;
                }
            }
            if !progress(step, report.bytes_uploaded) {
                break;
            }
        }
        let memo: Vec<(u64, Pushed)> = memo.into_iter().collect();
        let memo_chunks: Vec<Hash> = memo_chunks.into_iter().collect();
        store.remember(&self.url, mark, true, &memo, &memo_chunks)?;
        Ok(report)
    }

    /// Make a step visible: upload its missing chunks; if the push lock
    /// lapsed meanwhile (a collection may have run), wait out collections,
    /// check (HEAD) every chunk the step names and upload what is gone,
    /// until a check finds everything; then its manifest and commit.
    pub(crate) fn land(
        &self,
        data: &StepData<'_>,
        landing: Landing<'_>,
        lock: &mut Lock,
        before: u64,
        progress: &mut dyn FnMut(u64, u64) -> bool,
    ) -> Result<()> {
        let Landing {
            commit,
            bytes,
            chunks,
            missing,
        } = landing;
        let step = commit.step;
        self.upload(step, data, missing, lock, before, progress)?;
        while self.reassert(lock)? {
            let there = self.present(chunks.iter().map(|c| c.hash))?;
            let gone: Vec<&StepChunk> =
                chunks.iter().filter(|c| !there.contains(&c.hash)).collect();
            if gone.is_empty() {
                break;
            }
            self.upload(step, data, &gone, lock, before, progress)?;
        }
        self.put_step(&commit, bytes)
    }

    /// The bucket's collection mark, written first if there is none: it
    /// also tells this bucket from another one later found at the same URL
    /// (a prefix emptied or a bucket made again), whose mark differs.
    pub(crate) fn collection_mark(&self) -> Result<Vec<u8>> {
        let key = self.layout.collection_mark();
        if let Some(mark) = self.get_bytes(&key, 1024)? {
            return Ok(mark.to_vec());
        }
        self.new_collection_mark()
    }

    /// The bucket's collection mark, if it has one (nothing is written).
    pub(crate) fn current_mark(&self) -> Result<Option<Vec<u8>>> {
        let key = self.layout.collection_mark();
        Ok(self.get_bytes(&key, 1024)?.map(|m| m.to_vec()))
    }

    /// Write a new collection mark: what any store remembers of the bucket
    /// no longer holds (a collection is about to delete, another store
    /// takes the prefix over, or a store pushed what it cannot remember).
    pub(crate) fn new_collection_mark(&self) -> Result<Vec<u8>> {
        let mark = uuid::Uuid::new_v4().simple().to_string().into_bytes();
        self.put(&self.layout.collection_mark(), mark.clone())?;
        Ok(mark)
    }
}

/// One chunk of a step: of a blob, or the step's packed blobs.
pub(crate) struct StepChunk {
    pub(crate) hash: Hash,
    pub(crate) len: usize,
    what: Missing,
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

/// The chunks of `chunks` the bucket lacks, counted in `report`; they are
/// taken as present from here on.
fn count_missing<'c>(
    chunks: &'c [StepChunk],
    present: &mut HashSet<Hash>,
    report: &mut PushReport,
) -> Vec<&'c StepChunk> {
    let mut missing = Vec::new();
    for c in chunks {
        if present.insert(c.hash) {
            report.bytes_uploaded += c.len as u64;
            report.chunks_uploaded += 1;
            missing.push(c);
        } else {
            report.bytes_skipped += c.len as u64;
        }
    }
    missing
}

/// The bucket's manifest of stored step `step`, checked as readers will
/// check it, and encoded: its bytes and hash.
pub(crate) fn encoded(
    step: u64,
    ckpt: &GradientCheckpoint,
    info: &StepInfo,
    data: &StepData<'_>,
) -> Result<(Vec<u8>, Hash)> {
    let manifest = remote_manifest(ckpt, info, data)?;
    manifest.check_to_write(step)?;
    encode(step, &manifest)
}

/// The bucket's manifest of a stored step, from the store's manifest.
fn remote_manifest(
    ckpt: &GradientCheckpoint,
    info: &StepInfo,
    data: &StepData<'_>,
) -> Result<RemoteManifest> {
    let typed = |name: &str| info.tensors.get(name).map(|t| (t.dtype, t.shape.clone()));
    RemoteManifest::from_model(ckpt, data.blob_refs(), &typed, data.packed_ref())
}

impl Remote {
    /// Upload `missing` chunks of a step: each read from the store when an
    /// upload slot frees up, several in flight, keeping `lock` fresh;
    /// `landed` counts the bytes uploaded by the push, for `progress`.
    fn upload(
        &self,
        step: u64,
        data: &StepData<'_>,
        missing: &[&StepChunk],
        lock: &mut Lock,
        mut landed: u64,
        progress: &mut dyn FnMut(u64, u64) -> bool,
    ) -> Result<()> {
        let reads = missing.iter().map(|c| -> Result<(Hash, Bytes)> {
            match &c.what {
                Missing::Chunk(place) => Ok((c.hash, Bytes::from(data.read_chunk(place)?))),
                Missing::Packed => Ok((c.hash, Bytes::from(data.packed_bytes()?))),
            }
        });
        self.upload_chunks(reads, &mut |len| {
            landed += len;
            progress(step, landed);
            self.refresh(lock)
        })
    }

    /// Upload the chunks `reads` yields, each taken when an upload slot
    /// frees up ([`UPLOADS_IN_FLIGHT`] in flight); `landed` gets each
    /// one's length as it lands, outside the runtime (free to block;
    /// uploads in flight wait meanwhile), and may stop the upload.
    pub(crate) fn upload_chunks(
        &self,
        reads: impl Iterator<Item = Result<(Hash, Bytes)>>,
        landed: &mut dyn FnMut(u64) -> Result<()>,
    ) -> Result<()> {
        let (store, layout, url) = (&self.store, &self.layout, &self.url);
        let mut uploads = futures::stream::iter(reads)
            .map(|read| async move {
                let (hash, bytes) = read?;
                let len = bytes.len() as u64;
                let key = layout.chunk(&hash);
                store
                    .put(&key, PutPayload::from_bytes(bytes))
                    .await
                    .map_err(|e| remote_error(url, &layout.url_of(url, &key), "uploading", e))?;
                Ok::<u64, Error>(len)
            })
            .buffer_unordered(UPLOADS_IN_FLIGHT);
        while let Some(len) = self.run(uploads.try_next())?? {
            landed(len)?;
        }
        Ok(())
    }

    /// Which of `hashes` the bucket holds, asked object by object (several
    /// requests in flight).
    pub(crate) fn present(&self, hashes: impl Iterator<Item = Hash>) -> Result<HashSet<Hash>> {
        let unique: BTreeSet<Hash> = hashes.collect();
        if crate::remote::read::local::direct(self) {
            return crate::remote::read::local::present(self, unique);
        }
        let (store, layout, url) = (&self.store, &self.layout, &self.url);
        self.run(async {
            futures::stream::iter(unique)
                .map(|hash| async move {
                    let key = layout.chunk(&hash);
                    match store.head(&key).await {
                        Ok(_) => Ok(Some(hash)),
                        Err(object_store::Error::NotFound { .. }) => Ok(None),
                        Err(e) => Err(remote_error(
                            url,
                            &layout.url_of(url, &key),
                            "looking for",
                            e,
                        )),
                    }
                })
                .buffer_unordered(UPLOADS_IN_FLIGHT)
                .try_filter_map(|found| async move { Ok(found) })
                .try_collect()
                .await
        })?
    }
}
