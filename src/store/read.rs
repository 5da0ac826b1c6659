//! Reading: get, latest, listing, info, verify.

use std::collections::BTreeMap;
use std::ops::RangeBounds;

use redb::{ReadOnlyTable, ReadTransaction, ReadableTable};

use super::chunks::{hash_all, hex, split};
use super::schema::{decode_manifest, Manifest, CHUNKS, STEPS};
use super::{shield, CheckpointStore};
use crate::error::StorageContext;
use crate::{Error, GradientCheckpoint, Result};

/// A step's metadata, read without its blobs.
#[derive(Clone, Debug, PartialEq)]
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

/// What [`CheckpointStore::verify`] found.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct VerifyReport {
    /// Steps whose manifest and every chunk checked out.
    pub steps_ok: u64,
    /// Blob bytes hashed and found good.
    pub bytes_checked: u64,
    /// Each damaged step with the first problem found in it.
    pub damaged: Vec<(u64, Error)>,
}

impl VerifyReport {
    /// True when nothing is damaged.
    pub fn is_ok(&self) -> bool {
        self.damaged.is_empty()
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
            let steps = open_steps(&txn)?;
            let Some(bytes) = steps.get(step).context(|| read_ctx(step))? else {
                return Ok(None);
            };
            let manifest = decode_manifest(step, bytes.value())?;
            assemble(&txn, manifest).map(Some)
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
            let steps = open_steps(&txn)?;
            let Some(bytes) = steps.get(step).context(|| read_ctx(step))? else {
                return Ok(None);
            };
            let m = decode_manifest(step, bytes.value())?;
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

    /// Read every step and check every hash. Damage is reported per step in
    /// the [`VerifyReport`]; `Err` means the store could not be read at all.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// let report = store.verify()?;
    /// assert!(report.is_ok());
    /// assert_eq!(report.steps_ok, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn verify(&self) -> Result<VerifyReport> {
        let what = || "verifying".to_owned();
        self.shielded(None, &what, || {
            let txn = self.begin_read()?;
            let steps = open_steps(&txn)?;
            let mut report = VerifyReport::default();
            let ctx = || "reading table steps".to_owned();
            for entry in steps.range::<u64>(..).context(ctx)? {
                let (key, bytes) = match entry {
                    Ok(kv) => kv,
                    Err(e) => {
                        // The table itself is damaged past this point.
                        let err = Err::<(), _>(e).context(ctx).err();
                        if let Some(err) = err {
                            report.damaged.push((u64::MAX, err));
                        }
                        break;
                    }
                };
                let step = key.value();
                let what = || format!("verifying step {step}");
                let checked = shield(Some(step), &what, || {
                    decode_manifest(step, bytes.value()).and_then(|m| assemble(&txn, m))
                });
                match checked {
                    Ok(ckpt) => {
                        report.steps_ok += 1;
                        report.bytes_checked += ckpt.logical_bytes();
                    }
                    Err(e) => report.damaged.push((step, e)),
                }
            }
            Ok(report)
        })
    }
}

fn read_ctx(step: u64) -> String {
    format!("reading step {step} from table steps")
}

fn open_steps(txn: &ReadTransaction) -> Result<ReadOnlyTable<u64, &'static [u8]>> {
    txn.open_table(STEPS)
        .context(|| "opening table steps".to_owned())
}

/// Read a manifest's chunks into a checkpoint, checking every hash.
fn assemble(txn: &ReadTransaction, manifest: Manifest) -> Result<GradientCheckpoint> {
    let step = manifest.step;
    let chunks = txn
        .open_table(CHUNKS)
        .context(|| "opening table chunks".to_owned())?;
    let (mut ckpt, blobs) = manifest.into_parts();
    for (name, blob) in blobs {
        let len = usize::try_from(blob.len).map_err(|_| {
            Error::corrupt(Some(step), format!("blob {name:?} is too long to load"))
        })?;
        let mut data: Vec<u8> = Vec::new();
        data.try_reserve_exact(len).map_err(|e| {
            Error::corrupt(
                Some(step),
                format!("cannot allocate {len} bytes for blob {name:?}: {e}"),
            )
        })?;
        for id in &blob.chunks {
            let chunk = chunks
                .get(id)
                .context(|| format!("reading chunk {} of step {step}", hex(id)))?
                .ok_or_else(|| {
                    Error::corrupt(
                        Some(step),
                        format!("chunk {} of blob {name:?} is missing", hex(id)),
                    )
                })?;
            let bytes = chunk.value();
            if data.len() + bytes.len() > len {
                return Err(Error::corrupt(
                    Some(step),
                    format!("blob {name:?} is longer than its recorded {len} bytes"),
                ));
            }
            data.extend_from_slice(bytes);
        }
        if data.len() != len {
            return Err(Error::corrupt(
                Some(step),
                format!(
                    "blob {name:?} has {} bytes, its manifest says {len}",
                    data.len()
                ),
            ));
        }
        // Chunk boundaries are a function of the length, so the blob's own
        // slices must hash to the ids in order.
        let pieces: Vec<&[u8]> = split(&data).collect();
        if pieces.len() != blob.chunks.len() || hash_all(&pieces) != blob.chunks {
            return Err(Error::corrupt(
                Some(step),
                format!("blob {name:?} fails its hash check"),
            ));
        }
        ckpt.optimizer_state.insert(name, data);
    }
    Ok(ckpt)
}
