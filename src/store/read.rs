//! Reading: get, latest, listing, info, stats.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeBounds;

use redb::{
    AccessGuard, Key, ReadOnlyTable, ReadTransaction, ReadableTable, TableDefinition, TableHandle,
    Value, WriteTransaction,
};

use super::chunks::{chunk_lengths, hex};
use super::manifest::{decode_manifest, Manifest};
use super::retention::{Goal, StepSummary};
use super::schema::{
    meta_u64, BlobRef, ChunkId, PackedRef, CHUNK_DATA, LEGACY_CHUNKS, META, META_STORED_BYTES,
    META_STORED_CHUNKS, PACKED, PINS, STEPS, SUMMARIES,
};
use super::CheckpointStore;
use crate::error::StorageContext;
use crate::{Error, GradientCheckpoint, Result};

/// Blobs at least this large are read and hashed in a pipeline.
const PIPELINE_MIN_BYTES: usize = 4 << 20;

/// A step's metadata, read without its blobs.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct StepInfo {
    /// The step number.
    pub step: u64,
    /// Unix time in seconds of the checkpoint.
    pub timestamp: u64,
    /// CID of the loss tensor.
    pub loss_cid: Option<String>,
    /// Named metrics.
    pub metrics: BTreeMap<String, f64>,
    /// Nodes in the computation graph.
    pub node_count: usize,
    /// Edges in the computation graph.
    pub edge_count: usize,
    /// Each optimizer blob's length in bytes, by name.
    pub blobs: BTreeMap<String, u64>,
}

impl StepInfo {
    /// Total bytes of optimizer state.
    pub fn logical_bytes(&self) -> u64 {
        self.blobs.values().sum()
    }
}

/// What [`CheckpointStore::stats`] reports.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct StoreStats {
    /// Steps stored.
    pub steps: u64,
    /// Bytes of optimizer state over all steps, as if stored separately.
    pub logical_bytes: u64,
    /// Bytes of blob data actually stored: each chunk once, plus the
    /// packed small blobs of every step.
    pub stored_bytes: u64,
    /// Chunks stored.
    pub chunks: u64,
    /// Size of the store file (0 for a custom backend). redb grows the
    /// file in large steps, so this runs ahead of `allocated_bytes`.
    pub file_bytes: u64,
    /// Bytes of the file redb has allocated (pages in use, including pages
    /// freed by recent commits that are not reusable yet); 0 for a
    /// read-only store.
    pub allocated_bytes: u64,
}

impl StoreStats {
    /// `logical_bytes / stored_bytes`: how many times over deduplication
    /// saves (1.0 with nothing shared or nothing stored).
    pub fn dedup_ratio(&self) -> f64 {
        if self.stored_bytes == 0 {
            1.0
        } else {
            self.logical_bytes as f64 / self.stored_bytes as f64
        }
    }
}

impl CheckpointStore {
    /// The checkpoint stored under `step`, or `None`.
    ///
    /// Every chunk's hash and the manifest's hash are checked: damaged data
    /// is an [`Error::Corrupt`] naming the step, never a wrong checkpoint.
    pub fn get(&self, step: u64) -> Result<Option<GradientCheckpoint>> {
        let what = || format!("reading step {step}");
        self.shielded(Some(step), &what, || {
            let txn = self.begin_read()?;
            match manifest_of(&txn, step)? {
                Some(manifest) => assemble(&txn, manifest).map(Some),
                None => Ok(None),
            }
        })
    }

    /// The checkpoint with the highest step, or `None` for an empty store.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// assert_eq!(store.latest()?, None);
    /// for step in [10_000, 9_000] {
    ///     store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), step))?;
    /// }
    /// assert_eq!(store.latest()?.map(|c| c.step), Some(10_000));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn latest(&self) -> Result<Option<GradientCheckpoint>> {
        let what = || "reading the latest step".to_owned();
        self.shielded(None, &what, || {
            let txn = self.begin_read()?;
            let steps = open_steps(&txn)?;
            let Some((key, bytes)) = steps.last().context(|| "reading table steps".into())? else {
                return Ok(None);
            };
            let step = key.value();
            let manifest = decode_manifest(step, bytes.value())?;
            assemble(&txn, manifest).map(Some)
        })
    }

    /// The highest stored step, or `None` for an empty store. Reads no blob.
    pub fn latest_step(&self) -> Result<Option<u64>> {
        let what = || "reading the latest step number".to_owned();
        self.shielded(None, &what, || {
            let txn = self.begin_read()?;
            let steps = open_steps(&txn)?;
            let last = steps.last().context(|| "reading table steps".into())?;
            Ok(last.map(|(k, _)| k.value()))
        })
    }

    /// Every stored step, ascending.
    pub fn steps(&self) -> Result<Vec<u64>> {
        self.steps_in(..)
    }

    /// The stored steps within `range`, ascending.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for step in [5, 10, 15, 20] {
    ///     store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), step))?;
    /// }
    /// assert_eq!(store.steps_in(10..20)?, vec![10, 15]);
    /// assert_eq!(store.steps_in(..=10)?, vec![5, 10]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn steps_in(&self, range: impl RangeBounds<u64>) -> Result<Vec<u64>> {
        let what = || "listing steps".to_owned();
        self.shielded(None, &what, || {
            let txn = self.begin_read()?;
            let steps = open_steps(&txn)?;
            let ctx = || "reading table steps".to_owned();
            let iter = steps.range(range).context(ctx)?;
            iter.map(|r| r.map(|(k, _)| k.value()))
                .collect::<Result<_, _>>()
                .context(ctx)
        })
    }

    /// The metadata of `step` (graph size, loss CID, metrics, blob lengths)
    /// without reading its blobs.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 3);
    /// ckpt.set_optimizer_state("adam_v", vec![0; 1000]);
    /// store.commit(&ckpt)?;
    /// let info = store.info(3)?.expect("step 3 is stored");
    /// assert_eq!(info.blobs["adam_v"], 1000);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn info(&self, step: u64) -> Result<Option<StepInfo>> {
        let what = || format!("reading step {step}");
        self.shielded(Some(step), &what, || {
            let txn = self.begin_read()?;
            let Some(m) = manifest_of(&txn, step)? else {
                return Ok(None);
            };
            Ok(Some(StepInfo {
                step,
                timestamp: m.timestamp,
                loss_cid: m.loss_cid,
                metrics: m.metrics,
                node_count: m.graph.node_count(),
                edge_count: m.graph.edge_count(),
                blobs: m.blobs.into_iter().map(|(k, b)| (k, b.len)).collect(),
            }))
        })
    }

    /// The summaries (time, loss CID, metrics, sizes) of the steps in
    /// `range`, ascending, without reading manifests or blobs.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for (step, loss) in [(1, 0.9), (2, 0.4), (3, 0.6)] {
    ///     let c = GradientCheckpoint::new(ComputationGraphStore::new(), step).with_metric("loss", loss);
    ///     store.commit(&c)?;
    /// }
    /// let all = store.summaries(..)?;
    /// assert_eq!(all.len(), 3);
    /// assert_eq!(all[1].metrics["loss"], 0.4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn summaries(&self, range: impl RangeBounds<u64>) -> Result<Vec<StepSummary>> {
        let what = || "listing step summaries".to_owned();
        self.shielded(None, &what, || {
            let txn = self.begin_read()?;
            let table = txn
                .open_table(SUMMARIES)
                .context(|| "opening table summaries".to_owned())?;
            collect_summaries(&table, range)
        })
    }

    /// The step with the best value of `metric`, or `None` if no step has
    /// it. Ties go to the newer step.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Goal};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for (step, loss) in [(1, 0.9), (2, 0.4), (3, 0.6)] {
    ///     let c = GradientCheckpoint::new(ComputationGraphStore::new(), step).with_metric("loss", loss);
    ///     store.commit(&c)?;
    /// }
    /// assert_eq!(store.best_step("loss", Goal::Minimize)?, Some(2));
    /// assert_eq!(store.best_step("loss", Goal::Maximize)?, Some(1));
    /// assert_eq!(store.best_step("accuracy", Goal::Maximize)?, None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn best_step(&self, metric: &str, goal: Goal) -> Result<Option<u64>> {
        let best = self
            .summaries(..)?
            .into_iter()
            .filter_map(|s| s.metrics.get(metric).map(|&v| (v, s.step)))
            .max_by(|a, b| {
                let by_value = match goal {
                    Goal::Minimize => b.0.total_cmp(&a.0),
                    Goal::Maximize => a.0.total_cmp(&b.0),
                };
                by_value.then(a.1.cmp(&b.1))
            });
        Ok(best.map(|(_, step)| step))
    }

    /// One optimizer blob of `step`, read and hash-checked without the
    /// others. `None` if the step or the blob is not stored.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
    /// c.set_optimizer_state("adam_m", vec![1; 10]);
    /// c.set_optimizer_state("adam_v", vec![2; 10]);
    /// store.commit(&c)?;
    /// assert_eq!(store.get_blob(1, "adam_v")?, Some(vec![2; 10]));
    /// assert_eq!(store.get_blob(1, "nope")?, None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn get_blob(&self, step: u64, name: &str) -> Result<Option<Vec<u8>>> {
        let what = || format!("reading blob {name:?} of step {step}");
        self.shielded(Some(step), &what, || {
            let txn = self.begin_read()?;
            let Some(mut manifest) = manifest_of(&txn, step)? else {
                return Ok(None);
            };
            let Some(blob) = manifest.blobs.remove(name) else {
                return Ok(None);
            };
            manifest.blobs = [(name.to_owned(), blob)].into();
            let mut ckpt = assemble(&txn, manifest)?;
            Ok(ckpt.optimizer_state.remove(name))
        })
    }

    /// The steps [`apply_retention`](Self::apply_retention) would delete
    /// now, without deleting them.
    pub fn retention_preview(&self, policy: &crate::Retention) -> Result<Vec<u64>> {
        let what = || "previewing a retention policy".to_owned();
        self.shielded(None, &what, || {
            let txn = self.begin_read()?;
            let summaries = txn
                .open_table(SUMMARIES)
                .context(|| "opening table summaries".to_owned())?;
            let pins = txn
                .open_table(PINS)
                .context(|| "opening table pins".to_owned())?;
            Ok(policy.doomed(&collect_summaries(&summaries, ..)?, &collect_keys(&pins)?))
        })
    }

    /// The pinned steps, ascending.
    pub fn pinned(&self) -> Result<Vec<u64>> {
        let what = || "listing pinned steps".to_owned();
        self.shielded(None, &what, || {
            let txn = self.begin_read()?;
            let table = txn
                .open_table(PINS)
                .context(|| "opening table pins".to_owned())?;
            Ok(collect_keys(&table)?.into_iter().collect())
        })
    }

    /// Space and deduplication figures for the whole store.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for step in 0..4 {
    ///     let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    ///     c.set_optimizer_state("frozen", vec![7; 100_000]);
    ///     store.commit(&c)?;
    /// }
    /// let stats = store.stats()?;
    /// assert_eq!(stats.steps, 4);
    /// assert_eq!(stats.logical_bytes, 400_000);
    /// assert_eq!(stats.stored_bytes, 100_000);
    /// assert_eq!(stats.dedup_ratio(), 4.0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn stats(&self) -> Result<StoreStats> {
        let summaries = self.summaries(..)?;
        let what = || "reading store statistics".to_owned();
        let (stored_bytes, chunks) = self.shielded(None, &what, || {
            let txn = self.begin_read()?;
            let meta = txn
                .open_table(META)
                .context(|| "opening table meta".to_owned())?;
            Ok((
                meta_u64(&meta, META_STORED_BYTES)?,
                meta_u64(&meta, META_STORED_CHUNKS)?,
            ))
        })?;
        // Pages in use, from redb: needs a write transaction (then aborted),
        // so a read-only store reports 0.
        let allocated_bytes = self.shielded(None, &what, || {
            let guard = self.live_handle()?;
            let super::Handle::Writable(db) = &*guard else {
                return Ok(0);
            };
            let txn = db.begin_write().context(what)?;
            let stats = txn.stats().context(what)?;
            let bytes = stats.allocated_pages() * stats.page_size() as u64;
            txn.abort().context(what)?;
            Ok(bytes)
        })?;
        Ok(StoreStats {
            allocated_bytes,
            steps: summaries.len() as u64,
            logical_bytes: summaries.iter().map(|s| s.logical_bytes).sum(),
            stored_bytes,
            chunks,
            file_bytes: std::fs::metadata(self.path()).map_or(0, |m| m.len()),
        })
    }
}

/// A table that may not exist: a format 1 store opened read-only has no
/// format 2 chunk tables, a format 2 store no format 1 ones.
pub(super) fn open_optional<K: Key + 'static, V: Value + 'static>(
    txn: &ReadTransaction,
    table: TableDefinition<K, V>,
) -> Result<Option<ReadOnlyTable<K, V>>> {
    match txn.open_table(table) {
        Ok(t) => Ok(Some(t)),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(e).context(|| format!("opening table {}", table.name())),
    }
}

/// Summaries of the steps in `range`, from any readable `summaries` table.
fn collect_summaries(
    table: &impl ReadableTable<u64, &'static [u8]>,
    range: impl RangeBounds<u64>,
) -> Result<Vec<StepSummary>> {
    let ctx = || "reading table summaries".to_owned();
    let mut out = Vec::new();
    for entry in table.range(range).context(ctx)? {
        let (key, value) = entry.context(ctx)?;
        let step = key.value();
        let summary: StepSummary = serde_json::from_slice(value.value())
            .map_err(|e| Error::corrupt(Some(step), format!("summary does not decode: {e}")))?;
        if summary.step != step {
            return Err(Error::corrupt(Some(step), "summary names another step"));
        }
        out.push(summary);
    }
    Ok(out)
}

/// Summaries of the steps in `range`, inside a write transaction.
pub(crate) fn read_summaries(
    txn: &WriteTransaction,
    range: impl RangeBounds<u64>,
) -> Result<Vec<StepSummary>> {
    let table = txn
        .open_table(SUMMARIES)
        .context(|| "opening table summaries".to_owned())?;
    collect_summaries(&table, range)
}

/// Pinned steps, inside a write transaction.
pub(crate) fn read_pins(txn: &WriteTransaction) -> Result<BTreeSet<u64>> {
    let table = txn
        .open_table(PINS)
        .context(|| "opening table pins".to_owned())?;
    collect_keys(&table)
}

fn collect_keys<V: redb::Value + 'static>(
    table: &impl ReadableTable<u64, V>,
) -> Result<BTreeSet<u64>> {
    let ctx = || "reading table pins".to_owned();
    table
        .range::<u64>(..)
        .context(ctx)?
        .map(|r| r.map(|(k, _)| k.value()))
        .collect::<Result<_, _>>()
        .context(ctx)
}

/// The decoded, hash-checked manifest of `step`, if stored.
fn manifest_of(txn: &ReadTransaction, step: u64) -> Result<Option<Manifest>> {
    let steps = open_steps(txn)?;
    let Some(bytes) = steps.get(step).context(|| read_ctx(step))? else {
        return Ok(None);
    };
    decode_manifest(step, bytes.value()).map(Some)
}

fn read_ctx(step: u64) -> String {
    format!("reading step {step} from table steps")
}

pub(super) fn open_steps(txn: &ReadTransaction) -> Result<ReadOnlyTable<u64, &'static [u8]>> {
    txn.open_table(STEPS)
        .context(|| "opening table steps".to_owned())
}

/// Read a manifest's chunks into a checkpoint, checking every hash.
pub(super) fn assemble(txn: &ReadTransaction, manifest: Manifest) -> Result<GradientCheckpoint> {
    let step = manifest.step;
    let chunks = ChunkSource {
        data: open_optional(txn, CHUNK_DATA)?,
        legacy: open_optional(txn, LEGACY_CHUNKS)?,
    };
    let packed = match &manifest.packed {
        Some(p) => read_packed(txn, step, p)?,
        None => Vec::new(),
    };
    let (mut ckpt, blobs) = manifest.into_parts();
    for (name, blob) in blobs {
        let data = match blob.packed {
            // Bounds were checked when the manifest was decoded.
            Some(offset) => packed
                .get(offset as usize..(offset + blob.len) as usize)
                .ok_or_else(|| {
                    Error::corrupt(
                        Some(step),
                        format!("blob {name:?} is outside the packed bytes"),
                    )
                })?
                .to_vec(),
            None => read_blob(&chunks, step, &name, &blob)?,
        };
        ckpt.optimizer_state.insert(name, data);
    }
    Ok(ckpt)
}

/// A step's packed small blobs, checked against their length and hash.
fn read_packed(txn: &ReadTransaction, step: u64, packed: &PackedRef) -> Result<Vec<u8>> {
    let ctx = || format!("reading the packed blobs of step {step}");
    let table = txn.open_table(PACKED).context(ctx)?;
    let len = usize::try_from(packed.len)
        .map_err(|_| Error::corrupt(Some(step), "packed blobs too long to load"))?;
    let mut expected = chunk_lengths(len);
    let mut data = Vec::new();
    data.try_reserve_exact(len)
        .map_err(|e| Error::corrupt(Some(step), format!("cannot allocate packed blobs: {e}")))?;
    for entry in table.range((step, 0)..=(step, u32::MAX)).context(ctx)? {
        let (_, piece) = entry.context(ctx)?;
        let piece = piece.value();
        if expected.next() != Some(piece.len()) {
            return Err(Error::corrupt(
                Some(step),
                "packed blobs have the wrong layout",
            ));
        }
        data.extend_from_slice(piece);
    }
    if expected.next().is_some() || data.len() != len {
        return Err(Error::corrupt(Some(step), "packed blobs are incomplete"));
    }
    if blake3::hash(&data).as_bytes() != &packed.hash {
        return Err(Error::corrupt(
            Some(step),
            "packed blobs fail their hash check",
        ));
    }
    Ok(data)
}

/// Read one blob's chunks, checking each length and hash. Chunk boundaries
/// are a function of the blob's length; for large blobs a second thread
/// hashes each chunk while the next is read.
fn read_blob(chunks: &ChunkSource, step: u64, name: &str, blob: &BlobRef) -> Result<Vec<u8>> {
    let corrupt = |detail: String| Error::corrupt(Some(step), detail);
    // The manifest's hash was checked and its length bounded by its chunk
    // count when it was decoded.
    let len = usize::try_from(blob.len)
        .map_err(|_| corrupt(format!("blob {name:?} is too long to load")))?;
    let lengths: Vec<usize> = chunk_lengths(len).collect();
    if lengths.len() != blob.chunks.len() {
        return Err(corrupt(format!(
            "blob {name:?} lists {} chunks, its length {len} needs {}",
            blob.chunks.len(),
            lengths.len()
        )));
    }
    let mut data = vec![0u8; len];
    let ctx = BlobCtx {
        chunks,
        step,
        name,
        blob,
        lengths: &lengths,
    };
    let hashes_ok = if len < PIPELINE_MIN_BYTES {
        let mut ok = true;
        ctx.fill(&mut data, &mut |piece, id| {
            ok = blake3::hash(piece).as_bytes() == id;
            ok
        })?;
        ok
    } else {
        std::thread::scope(|s| -> Result<bool> {
            let (tx, rx) = std::sync::mpsc::sync_channel::<(&[u8], ChunkId)>(16);
            let hasher = s.spawn(move || {
                rx.into_iter()
                    .all(|(piece, id)| blake3::hash(piece).as_bytes() == &id)
            });
            // Each piece of `data` is written here, then only read there.
            let filled = ctx.fill(&mut data, &mut |piece, id| tx.send((piece, *id)).is_ok());
            drop(tx);
            let ok = hasher.join().unwrap_or(false);
            filled.map(|()| ok)
        })?
    };
    if !hashes_ok {
        return Err(corrupt(format!("blob {name:?} fails its hash check")));
    }
    Ok(data)
}

/// Where chunks are read from: by id, or (format 1) by hash.
struct ChunkSource {
    data: Option<ReadOnlyTable<u64, &'static [u8]>>,
    legacy: Option<ReadOnlyTable<&'static [u8; 32], &'static [u8]>>,
}

impl ChunkSource {
    /// Chunk `hash` with id `id` (`None`: a format 1 chunk) of `step`.
    fn get(
        &self,
        step: u64,
        hash: &ChunkId,
        id: Option<u64>,
    ) -> Result<Option<AccessGuard<'_, &'static [u8]>>> {
        let ctx = || format!("reading chunk {} of step {step}", hex(hash));
        match (id, &self.data, &self.legacy) {
            (Some(id), Some(data), _) => data.get(id).context(ctx),
            (None, _, Some(legacy)) => legacy.get(hash).context(ctx),
            _ => Ok(None),
        }
    }
}

/// What reading one blob needs.
struct BlobCtx<'a> {
    chunks: &'a ChunkSource,
    step: u64,
    name: &'a str,
    blob: &'a BlobRef,
    lengths: &'a [usize],
}

impl BlobCtx<'_> {
    /// Copy each chunk into its piece of `data`, checking its length, and
    /// hand the piece with its id to `sink`; stop early if `sink` says so.
    fn fill<'d>(
        &self,
        data: &'d mut [u8],
        sink: &mut dyn FnMut(&'d [u8], &ChunkId) -> bool,
    ) -> Result<()> {
        let (step, name) = (self.step, self.name);
        let mut rest = data;
        for (i, (id, &n)) in self.blob.chunks.iter().zip(self.lengths).enumerate() {
            let chunk_id = match &self.blob.ids {
                Some(ids) => Some(*ids.get(i).ok_or_else(|| {
                    Error::corrupt(Some(step), format!("blob {name:?} lacks chunk ids"))
                })?),
                None => None,
            };
            let chunk = self.chunks.get(step, id, chunk_id)?.ok_or_else(|| {
                Error::corrupt(
                    Some(step),
                    format!("chunk {} of blob {name:?} is missing", hex(id)),
                )
            })?;
            let bytes = chunk.value();
            if bytes.len() != n {
                return Err(Error::corrupt(
                    Some(step),
                    format!(
                        "chunk {} of blob {name:?} has {} bytes, expected {n}",
                        hex(id),
                        bytes.len()
                    ),
                ));
            }
            let (piece, tail) = std::mem::take(&mut rest).split_at_mut(n);
            piece.copy_from_slice(bytes);
            rest = tail;
            if !sink(piece, id) {
                break; // a hash already failed
            }
        }
        Ok(())
    }
}
