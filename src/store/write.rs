//! Writing: commit, replace, remove, rollback.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use redb::{ReadableTable, WriteTransaction};

use super::chunks::{split, with_hashes, ChunkTables};
use super::schema::{decode_manifest, encode_manifest, BlobRef, CHUNKS, REFS, STEPS};
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
    /// Blob bytes freed from the step this commit replaced, if any.
    pub bytes_freed: u64,
    /// Wall time of the whole commit, hashing and fsync included.
    pub duration: Duration,
}

impl CheckpointStore {
    /// Store `ckpt` under `ckpt.step` in one write transaction.
    ///
    /// When it returns `Ok`, the step is complete and (with the default
    /// [`Durability::Immediate`](crate::Durability::Immediate)) on disk.
    /// Unchanged chunks already in the store are referenced, not rewritten.
    ///
    /// # Errors
    /// [`Error::InvalidCheckpoint`] for a non-finite metric (nothing is
    /// written); [`Error::StepExists`] if the step is stored already (nothing is
    /// changed; use [`replace`](Self::replace)); [`Error::ReadOnly`] on a
    /// read-only store; [`Error::Storage`] when redb or the disk fails, after
    /// which the store reopens its file on the next call.
    pub fn commit(&self, ckpt: &GradientCheckpoint) -> Result<CommitInfo> {
        self.put(ckpt, false)
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
        self.put(ckpt, true)
    }

    fn put(&self, ckpt: &GradientCheckpoint, replace: bool) -> Result<CommitInfo> {
        let start = Instant::now();
        let step = ckpt.step;
        ckpt.validate()?;

        // Split before the transaction; hashing runs on another thread
        // while the transaction writes (for large checkpoints).
        let mut names: Vec<&String> = ckpt.optimizer_state.keys().collect();
        names.sort_unstable();
        let mut pieces: Vec<&[u8]> = Vec::new();
        let mut spans = Vec::with_capacity(names.len());
        for name in names {
            let blob = &ckpt.optimizer_state[name];
            let first = pieces.len();
            pieces.extend(split(blob));
            spans.push((name, blob.len() as u64, first..pieces.len()));
        }

        let what = || format!("committing step {step}");
        let (added, freed, manifest_len) = with_hashes(&pieces, |hashes| {
            self.write("commit", &what, |txn| {
                let mut steps = txn.open_table(STEPS).context(what)?;
                let old = steps.get(step).context(what)?.map(|g| g.value().to_vec());
                if old.is_some() && !replace {
                    return Err(Error::StepExists { step });
                }
                let mut tables = chunk_tables(txn, &what)?;
                // Add before releasing, so chunks shared with the replaced
                // version are never deleted and written again.
                let (added, ids) = tables.add(&pieces, hashes)?;
                let blobs: BTreeMap<String, BlobRef> = spans
                    .iter()
                    .map(|(name, len, range)| {
                        let chunks = ids[range.clone()].to_vec();
                        ((*name).clone(), BlobRef { len: *len, chunks })
                    })
                    .collect();
                let manifest = encode_manifest(ckpt, &blobs)?;
                let mut freed = 0;
                if let Some(old) = old {
                    // A manifest that no longer decodes cannot tell which
                    // chunks it held; they stay referenced (verify() says so).
                    if let Ok(old) = decode_manifest(step, &old) {
                        freed = tables.release(&old)?;
                    }
                }
                steps.insert(step, manifest.as_slice()).context(what)?;
                Ok((added, freed, manifest.len()))
            })
        })?;

        Ok(CommitInfo {
            step,
            logical_bytes: ckpt.logical_bytes(),
            bytes_written: added.bytes_written,
            bytes_reused: added.bytes_reused,
            chunks_written: added.chunks_written,
            chunks_reused: added.chunks_reused,
            manifest_bytes: manifest_len as u64,
            bytes_freed: freed,
            duration: start.elapsed(),
        })
    }

    /// Remove `step` and free the chunks no other step uses, in one write
    /// transaction. Returns whether the step was stored.
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
        let removed = self.write("remove", &what, |txn| remove_steps(txn, &[step], &what))?;
        Ok(!removed.is_empty())
    }

    /// Discard every step after `step` in one write transaction (a run that
    /// restarts from an earlier step). Returns the steps removed, ascending.
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
            let doomed: Vec<u64> = {
                let steps = txn.open_table(STEPS).context(what)?;
                let range = steps.range(after..).context(what)?;
                range
                    .map(|r| r.map(|(k, _)| k.value()))
                    .collect::<Result<_, _>>()
                    .context(what)?
            };
            remove_steps(txn, &doomed, &what)
        })
    }
}

fn chunk_tables<'txn>(
    txn: &'txn WriteTransaction,
    what: &dyn Fn() -> String,
) -> Result<ChunkTables<'txn>> {
    Ok(ChunkTables {
        op: what(),
        chunks: txn.open_table(CHUNKS).context(what)?,
        refs: txn.open_table(REFS).context(what)?,
    })
}

/// Remove `doomed` steps and release their chunks; returns those found.
fn remove_steps(
    txn: &WriteTransaction,
    doomed: &[u64],
    what: &dyn Fn() -> String,
) -> Result<Vec<u64>> {
    let mut steps = txn.open_table(STEPS).context(what)?;
    let mut tables = chunk_tables(txn, what)?;
    let mut removed = Vec::with_capacity(doomed.len());
    for &step in doomed {
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
            tables.release(&manifest)?;
        }
    }
    Ok(removed)
}
