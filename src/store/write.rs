//! Writing: commit, replace, remove, rollback, retention, pins.

use std::collections::BTreeMap;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use redb::{ReadableTable, WriteTransaction};

use super::chunks::{split, with_hashes, ChunkTables, Hashing};
use super::manifest::{decode_manifest, encode_manifest};
use super::read::{read_pins, read_summaries};
use super::retention::{Retention, StepSummary};
use super::schema::{
    meta_u64, BlobRef, ChunkId, PackedRef, META, META_STAGING, META_STORED_BYTES,
    META_STORED_CHUNKS, PACKED, PINS, STEPS, SUMMARIES,
};
use super::CheckpointStore;
use crate::error::StorageContext;
use crate::{Error, GradientCheckpoint, Result};

/// What a commit did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CommitInfo {
    /// The step committed.
    pub step: u64,
    /// Bytes of optimizer state in the checkpoint.
    pub logical_bytes: u64,
    /// Blob bytes this commit wrote as new chunks.
    pub bytes_written: u64,
    /// Blob bytes already stored and referenced instead of written.
    pub bytes_reused: u64,
    /// Chunks written.
    pub chunks_written: u64,
    /// Chunks referenced without writing.
    pub chunks_reused: u64,
    /// Bytes of the step's manifest (graph and metadata).
    pub manifest_bytes: u64,
    /// Blob bytes freed: of the step this commit replaced, and of the steps
    /// the retention policy removed.
    pub bytes_freed: u64,
    /// Steps the store's retention policy removed in the same transaction.
    pub removed: Vec<u64>,
    /// Wall time of the whole commit, hashing and fsync included.
    pub duration: Duration,
}

/// Changes to the `meta` counters a transaction makes.
#[derive(Default)]
struct Delta {
    bytes: i128,
    chunks: i128,
}

impl Delta {
    fn freed(&mut self, (bytes, chunks): (u64, u64)) {
        self.bytes -= i128::from(bytes);
        self.chunks -= i128::from(chunks);
    }

    fn apply(&self, txn: &WriteTransaction, what: &dyn Fn() -> String) -> Result<()> {
        let mut meta = txn.open_table(META).context(what)?;
        for (key, delta) in [
            (META_STORED_BYTES, self.bytes),
            (META_STORED_CHUNKS, self.chunks),
        ] {
            let old = meta_u64(&meta, key)?;
            let new = (i128::from(old) + delta).clamp(0, i128::from(u64::MAX)) as u64;
            meta.insert(key, new.to_le_bytes().as_slice())
                .context(what)?;
        }
        Ok(())
    }
}

impl CheckpointStore {
    /// Store `ckpt` under `ckpt.step` in one write transaction.
    ///
    /// When it returns `Ok`, the step is complete and (with the default
    /// [`Durability::Immediate`](crate::Durability::Immediate)) on disk.
    /// Unchanged chunks already in the store are referenced, not rewritten.
    /// The store's retention policy, if any, runs in the same transaction.
    ///
    /// # Errors
    /// [`Error::InvalidCheckpoint`] for a non-finite metric (nothing is
    /// written); [`Error::StepExists`] if the step is stored already (nothing
    /// is changed; use [`replace`](Self::replace)); [`Error::ReadOnly`] on a
    /// read-only store; [`Error::Storage`] when redb or the disk fails, after
    /// which the store reopens its file on the next call. After an I/O error
    /// the step may or may not have been committed (the error can strike
    /// after the commit point); it is never partial: `get` tells.
    pub fn commit(&self, ckpt: &GradientCheckpoint) -> Result<CommitInfo> {
        self.put(ckpt, false, Hashing::Pipelined)
    }

    /// [`commit`](Self::commit) for the background writer: hashing inline,
    /// so that a background commit keeps to one core.
    pub(crate) fn commit_in_background(&self, ckpt: &GradientCheckpoint) -> Result<CommitInfo> {
        self.put(ckpt, false, Hashing::Inline)
    }

    /// Store `ckpt`, replacing the step of the same number if it is stored,
    /// in one write transaction.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let first = GradientCheckpoint::new(ComputationGraphStore::new(), 5);
    /// store.commit(&first)?;
    /// let second = first.clone().with_loss_cid("cid_new_loss");
    /// assert!(store.commit(&second).is_err());
    /// store.replace(&second)?;
    /// assert_eq!(store.get(5)?, Some(second));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn replace(&self, ckpt: &GradientCheckpoint) -> Result<CommitInfo> {
        self.put(ckpt, true, Hashing::Pipelined)
    }

    fn put(
        &self,
        ckpt: &GradientCheckpoint,
        replace: bool,
        hashing: Hashing,
    ) -> Result<CommitInfo> {
        let start = Instant::now();
        let step = ckpt.step;
        ckpt.validate()?;

        // Split before the transaction: large blobs into content-addressed
        // chunks (hashed on another thread while the transaction writes),
        // small ones packed together under the step (see PackedRef).
        let mut names: Vec<&String> = ckpt.optimizer_state.keys().collect();
        names.sort_unstable();
        let mut pieces: Vec<&[u8]> = Vec::new();
        let mut spans = Vec::with_capacity(names.len());
        let mut packed: Vec<u8> = Vec::new();
        let mut packed_at: BTreeMap<&String, u64> = BTreeMap::new();
        for name in names {
            let blob = &ckpt.optimizer_state[name];
            if blob.len() < PACK_BELOW {
                packed_at.insert(name, packed.len() as u64);
                packed.extend_from_slice(blob);
                continue;
            }
            let first = pieces.len();
            pieces.extend(split(blob));
            spans.push((name, blob.len() as u64, first..pieces.len()));
        }
        let packed_ref = (!packed.is_empty()).then(|| PackedRef {
            len: packed.len() as u64,
            hash: *blake3::hash(&packed).as_bytes(),
        });

        let what = || format!("committing step {step}");
        let policy = &self.core.options.retention;
        let chunk_bytes: usize = pieces.iter().map(|p| p.len()).sum();
        let mut info = with_hashes(&pieces, hashing, |hashes| {
            // More new pages than redb's write buffer holds: stage the chunks
            // in transactions of their own first (see `stage`).
            let staging = (chunk_bytes > self.stage_above()).then(|| {
                self.core
                    .staging
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
            });
            let mut staged = Vec::new();
            let mut staged_hashes;
            let hashes: &mut dyn Iterator<Item = ChunkId> = if staging.is_some() {
                if let Err(e) = self.stage(step, replace, &pieces, hashes, &mut staged, &what) {
                    self.unstage(&staged, &what);
                    return Err(e);
                }
                staged_hashes = staged.clone().into_iter();
                &mut staged_hashes
            } else {
                hashes
            };
            let outcome = self.write("commit", &what, |txn| {
                let mut delta = Delta::default();
                let mut info = {
                    let mut steps = txn.open_table(STEPS).context(what)?;
                    let old = steps.get(step).context(what)?.map(|g| g.value().to_vec());
                    if old.is_some() && !replace {
                        return Err(Error::StepExists { step });
                    }
                    let mut tables = chunk_tables(txn, &what)?;
                    // Add before releasing, so chunks shared with the
                    // replaced version are never deleted and written again.
                    let (added, hashes, ids) = tables.add(&pieces, hashes)?;
                    delta.bytes += i128::from(added.bytes_written);
                    delta.chunks += i128::from(added.chunks_written);
                    let mut blobs: BTreeMap<String, BlobRef> = spans
                        .iter()
                        .map(|(name, len, range)| {
                            let blob = BlobRef {
                                len: *len,
                                chunks: hashes[range.clone()].to_vec(),
                                ids: Some(ids[range.clone()].to_vec()),
                                packed: None,
                            };
                            ((*name).clone(), blob)
                        })
                        .collect();
                    for (name, &offset) in &packed_at {
                        let blob = BlobRef {
                            len: ckpt.optimizer_state[*name].len() as u64,
                            chunks: Vec::new(),
                            ids: Some(Vec::new()),
                            packed: Some(offset),
                        };
                        blobs.insert((*name).clone(), blob);
                    }
                    let manifest = encode_manifest(ckpt, &blobs, packed_ref.as_ref());
                    let mut freed = 0;
                    if let Some(old) = old {
                        // A manifest that no longer decodes cannot tell which
                        // chunks it held; they stay referenced.
                        if let Ok(old) = decode_manifest(step, &old) {
                            let f = tables.release(&old)?;
                            freed = f.0;
                            delta.freed(f);
                        }
                        // The replaced step's packed bytes go too (a new
                        // step has none: no lookup on the common path).
                        let unpacked = remove_packed(txn, step, &what)?;
                        freed += unpacked;
                        delta.bytes -= i128::from(unpacked);
                    }
                    steps.insert(step, manifest.as_slice()).context(what)?;
                    put_packed(txn, step, &packed, &what)?;
                    delta.bytes += packed.len() as i128;
                    let summary = StepSummary {
                        step,
                        timestamp: ckpt.timestamp,
                        loss_cid: ckpt.loss_cid.clone(),
                        metrics: ckpt.metrics.clone(),
                        logical_bytes: ckpt.logical_bytes(),
                        bytes_written: added.bytes_written + packed.len() as u64,
                        blobs: ckpt.optimizer_state.len(),
                    };
                    let summary =
                        serde_json::to_vec(&summary).map_err(|e| Error::InvalidCheckpoint {
                            step,
                            reason: format!("its summary does not encode: {e}"),
                        })?;
                    txn.open_table(SUMMARIES)
                        .context(what)?
                        .insert(step, summary.as_slice())
                        .context(what)?;
                    CommitInfo {
                        step,
                        logical_bytes: ckpt.logical_bytes(),
                        bytes_written: added.bytes_written + packed.len() as u64,
                        bytes_reused: added.bytes_reused,
                        chunks_written: added.chunks_written,
                        chunks_reused: added.chunks_reused,
                        manifest_bytes: manifest.len() as u64,
                        bytes_freed: freed,
                        removed: Vec::new(),
                        duration: Duration::ZERO,
                    }
                };
                if !policy.is_empty() {
                    let doomed = policy.doomed(&read_summaries(txn, ..)?, &read_pins(txn)?);
                    let (removed, freed) = remove_steps(txn, &doomed, &mut delta, &what)?;
                    info.removed = removed;
                    info.bytes_freed += freed;
                }
                if staging.is_some() {
                    end_staging(txn, &what)?;
                }
                delta.apply(txn, &what)?;
                Ok(info)
            });
            if outcome.is_err() && staging.is_some() {
                self.unstage(&staged, &what);
            }
            outcome
        })?;
        info.duration = start.elapsed();
        Ok(info)
    }

    /// Chunk bytes above which a commit stages its chunks: a quarter of the
    /// cache. redb keeps a transaction's new pages in a write buffer of half
    /// its cache; pages it must evict before the commit it reads back and
    /// writes again at the commit (to fill in their checksums). A 256 MiB
    /// commit in one transaction read 256 MB and wrote 512 MB.
    fn stage_above(&self) -> usize {
        self.core.options.cache_size / 4
    }

    /// Write the chunks of `pieces` not yet stored, in transactions of up
    /// to [`stage_above`](Self::stage_above) bytes each, as staged chunks
    /// (used by no step); push every piece's hash to `staged`. Refuses a
    /// stored step first, unless replacing.
    fn stage(
        &self,
        step: u64,
        replace: bool,
        pieces: &[&[u8]],
        hashes: &mut dyn Iterator<Item = ChunkId>,
        staged: &mut Vec<ChunkId>,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        if !replace && self.info(step)?.is_some() {
            return Err(Error::StepExists { step });
        }
        let part_bytes = self.stage_above();
        let mut rest = pieces;
        while !rest.is_empty() {
            let mut n = 1;
            let mut bytes = rest[0].len();
            while n < rest.len() && bytes + rest[n].len() <= part_bytes {
                bytes += rest[n].len();
                n += 1;
            }
            let (part, tail) = rest.split_at(n);
            self.write_with("commit", what, true, |txn| {
                txn.open_table(META)
                    .context(what)?
                    .insert(META_STAGING, [1u8].as_slice())
                    .context(what)?;
                chunk_tables(txn, what)?.stage(part, hashes, staged)
            })?;
            rest = tail;
        }
        Ok(())
    }

    /// Delete what a failed commit staged. Best effort: what is left is
    /// deleted when the store is next opened for writing.
    fn unstage(&self, staged: &[ChunkId], what: &dyn Fn() -> String) {
        let _ = self.write("commit", what, |txn| {
            chunk_tables(txn, what)?.unstage(staged)?;
            end_staging(txn, what)
        });
    }

    /// Remove `step` and free the chunks no other step uses, in one write
    /// transaction. Returns whether the step was stored.
    ///
    /// # Errors
    /// [`Error::StepPinned`] if the step is pinned.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// assert!(store.remove(1)?);
    /// assert!(!store.remove(1)?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn remove(&self, step: u64) -> Result<bool> {
        let what = || format!("removing step {step}");
        let removed = self.write("remove", &what, |txn| {
            if read_pins(txn)?.contains(&step) {
                return Err(Error::StepPinned {
                    step,
                    op: "removing it",
                });
            }
            let mut delta = Delta::default();
            let (removed, _) = remove_steps(txn, &[step], &mut delta, &what)?;
            delta.apply(txn, &what)?;
            Ok(removed)
        })?;
        Ok(!removed.is_empty())
    }

    /// Discard every step after `step` in one write transaction (a run that
    /// restarts from an earlier step). Returns the steps removed, ascending.
    ///
    /// # Errors
    /// [`Error::StepPinned`] if a step after `step` is pinned (nothing is
    /// removed).
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for step in [10, 20, 30, 40] {
    ///     store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), step))?;
    /// }
    /// assert_eq!(store.rollback_to(20)?, vec![30, 40]);
    /// assert_eq!(store.latest_step()?, Some(20));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn rollback_to(&self, step: u64) -> Result<Vec<u64>> {
        let what = || format!("rolling back to step {step}");
        self.write("rollback", &what, |txn| {
            let Some(after) = step.checked_add(1) else {
                return Ok(Vec::new());
            };
            if let Some(&pinned) = read_pins(txn)?.range(after..).next() {
                return Err(Error::StepPinned {
                    step: pinned,
                    op: "rolling back past it",
                });
            }
            let doomed: Vec<u64> = read_summaries(txn, after..)?
                .iter()
                .map(|s| s.step)
                .collect();
            let mut delta = Delta::default();
            let (removed, _) = remove_steps(txn, &doomed, &mut delta, &what)?;
            delta.apply(txn, &what)?;
            Ok(removed)
        })
    }

    /// Apply `policy` now, in one write transaction: delete every step no
    /// rule keeps (pinned steps are kept). Returns the steps deleted.
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Retention};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for step in 0..10 {
    ///     store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), step))?;
    /// }
    /// store.pin(2)?;
    /// let removed = store.apply_retention(&Retention::new().keep_last(3))?;
    /// assert_eq!(removed, vec![0, 1, 3, 4, 5, 6]);
    /// assert_eq!(store.steps()?, vec![2, 7, 8, 9]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn apply_retention(&self, policy: &Retention) -> Result<Vec<u64>> {
        let what = || "applying a retention policy".to_owned();
        self.write("retention", &what, |txn| {
            let doomed = policy.doomed(&read_summaries(txn, ..)?, &read_pins(txn)?);
            let mut delta = Delta::default();
            let (removed, _) = remove_steps(txn, &doomed, &mut delta, &what)?;
            delta.apply(txn, &what)?;
            Ok(removed)
        })
    }

    /// Pin `step`: retention never deletes it, and `remove` and
    /// `rollback_to` refuse to. Returns whether it was newly pinned.
    ///
    /// # Errors
    /// [`Error::StepNotFound`] if the step is not stored.
    pub fn pin(&self, step: u64) -> Result<bool> {
        let what = || format!("pinning step {step}");
        self.write("pin", &what, |txn| {
            let stored = txn
                .open_table(STEPS)
                .context(what)?
                .get(step)
                .context(what)?
                .is_some();
            if !stored {
                return Err(Error::StepNotFound { step });
            }
            let mut pins = txn.open_table(PINS).context(what)?;
            let was = pins.insert(step, ()).context(what)?.is_some();
            Ok(!was)
        })
    }

    /// Unpin `step`. Returns whether it was pinned.
    pub fn unpin(&self, step: u64) -> Result<bool> {
        let what = || format!("unpinning step {step}");
        self.write("unpin", &what, |txn| {
            let mut pins = txn.open_table(PINS).context(what)?;
            let was = pins.remove(step).context(what)?.is_some();
            Ok(was)
        })
    }

    /// Hand the file's free space back to the filesystem (redb compaction).
    /// Needs no other transaction in flight in this process. Returns whether
    /// anything was compacted.
    pub fn compact(&self) -> Result<bool> {
        let what = || format!("compacting {}", self.path().display());
        self.shielded(None, &what, || {
            let mut guard = self.handle_mut()?;
            let super::Handle::Writable(db) = &mut *guard else {
                return Err(Error::ReadOnly {
                    path: self.path().to_owned(),
                    op: "compact",
                });
            };
            db.compact().context(what)
        })
    }
}

/// Small blobs below this size are packed per step instead of chunked.
const PACK_BELOW: usize = 64 << 10;

/// Store a step's packed small blobs (nothing if empty).
fn put_packed(
    txn: &WriteTransaction,
    step: u64,
    packed: &[u8],
    what: &dyn Fn() -> String,
) -> Result<()> {
    if packed.is_empty() {
        return Ok(());
    }
    let mut table = txn.open_table(PACKED).context(what)?;
    for (i, piece) in split(packed).enumerate() {
        let i = u32::try_from(i).map_err(|_| Error::InvalidCheckpoint {
            step,
            reason: "too many small blobs to pack".into(),
        })?;
        table.insert((step, i), piece).context(what)?;
    }
    Ok(())
}

/// Delete a step's packed small blobs; returns the bytes deleted.
fn remove_packed(txn: &WriteTransaction, step: u64, what: &dyn Fn() -> String) -> Result<u64> {
    let mut table = txn.open_table(PACKED).context(what)?;
    let keys: Vec<(u64, u32)> = table
        .range((step, 0)..=(step, u32::MAX))
        .context(what)?
        .map(|r| r.map(|(k, _)| k.value()))
        .collect::<Result<_, _>>()
        .context(what)?;
    let mut freed = 0;
    for key in keys {
        if let Some(v) = table.remove(key).context(what)? {
            freed += v.value().len() as u64;
        }
    }
    Ok(freed)
}

fn chunk_tables<'txn>(
    txn: &'txn WriteTransaction,
    what: &dyn Fn() -> String,
) -> Result<ChunkTables<'txn>> {
    ChunkTables::open(txn, what())
}

/// Remove `doomed` steps with their summaries and pins and release their
/// chunks; returns the steps found and the blob bytes freed.
fn remove_steps(
    txn: &WriteTransaction,
    doomed: &[u64],
    delta: &mut Delta,
    what: &dyn Fn() -> String,
) -> Result<(Vec<u64>, u64)> {
    let mut steps = txn.open_table(STEPS).context(what)?;
    let mut summaries = txn.open_table(SUMMARIES).context(what)?;
    let mut tables = chunk_tables(txn, what)?;
    let mut removed = Vec::with_capacity(doomed.len());
    let mut freed = 0;
    for &step in doomed {
        summaries.remove(step).context(what)?;
        delta.bytes -= i128::from(remove_packed(txn, step, what)?);
        let Some(old) = steps
            .remove(step)
            .context(what)?
            .map(|g| g.value().to_vec())
        else {
            continue;
        };
        removed.push(step);
        // A damaged manifest is removed all the same; its chunks stay
        // referenced, since nothing says which they are.
        if let Ok(manifest) = decode_manifest(step, &old) {
            let f = tables.release(&manifest)?;
            freed += f.0;
            delta.freed(f);
        }
    }
    Ok((removed, freed))
}

/// Mark the store as having no staging in progress.
fn end_staging(txn: &WriteTransaction, what: &dyn Fn() -> String) -> Result<()> {
    txn.open_table(META)
        .context(what)?
        .remove(META_STAGING)
        .context(what)?;
    Ok(())
}
