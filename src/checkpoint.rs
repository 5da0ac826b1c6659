//! The training state that one step commits, and its JSON file format.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::file::{unix_now, write_durably};
use crate::{ComputationGraphStore, Dtype, Error, Result, SaveRecord, Tensor};

/// A snapshot of training state at one optimizer step.
///
/// Its serde form is the original checkpoint file format: the fields below,
/// with each optimizer blob as a JSON array of numbers. `metrics` is an
/// addition that is left out of the JSON when empty, so files without it (all
/// files of the original format) load, and files with none are unchanged.
///
/// ```
/// use ckptstore::{ComputationGraphStore, GradientCheckpoint};
///
/// let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 7)
///     .with_loss_cid("cid_loss")
///     .with_metric("loss", 0.25);
/// ckpt.set_optimizer_state("adam_m", vec![1, 2, 3]);
/// assert_eq!(ckpt.step, 7);
/// assert_eq!(ckpt.optimizer_state["adam_m"], vec![1, 2, 3]);
/// assert_eq!(ckpt.logical_bytes(), 3);
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GradientCheckpoint {
    /// The computation graph at the time of the checkpoint.
    pub graph: ComputationGraphStore,
    /// Optimizer step counter; the store's key.
    pub step: u64,
    /// CID of the loss tensor (`None` before the first loss is computed).
    pub loss_cid: Option<String>,
    /// Raw optimizer state blobs, keyed by parameter name.
    pub optimizer_state: HashMap<String, Vec<u8>>,
    /// Unix time in seconds when the checkpoint was made.
    pub timestamp: u64,
    /// Named scalar metrics (loss, accuracy, ...), used by retention
    /// policies and queries.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, f64>,
    /// Typed tensors (parameters, optimizer moments...), by name. A name
    /// may not also be an optimizer blob. Left out of the JSON when empty.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tensors: BTreeMap<String, Tensor>,
    /// How the step was saved (a staged save's cost, a framework's names
    /// for it). Left out of the JSON when empty.
    #[serde(default, skip_serializing_if = "SaveRecord::is_empty")]
    pub save_record: SaveRecord,
}

impl GradientCheckpoint {
    /// A checkpoint of `graph` at `step`, stamped with the current time.
    pub fn new(graph: ComputationGraphStore, step: u64) -> Self {
        GradientCheckpoint {
            graph,
            step,
            loss_cid: None,
            optimizer_state: HashMap::new(),
            timestamp: unix_now(),
            metrics: BTreeMap::new(),
            tensors: BTreeMap::new(),
            save_record: SaveRecord::default(),
        }
    }

    /// Attach the CID of the current loss tensor.
    pub fn with_loss_cid(mut self, cid: impl Into<String>) -> Self {
        self.loss_cid = Some(cid.into());
        self
    }

    /// Attach a named metric.
    pub fn with_metric(mut self, name: impl Into<String>, value: f64) -> Self {
        self.metrics.insert(name.into(), value);
        self
    }

    /// Store a raw optimizer state blob for `param`, replacing any earlier one.
    pub fn set_optimizer_state(&mut self, param: impl Into<String>, state: Vec<u8>) {
        self.optimizer_state.insert(param.into(), state);
    }

    /// Store a typed tensor under `name`, replacing any earlier one.
    ///
    /// ```
    /// use ckptstore::{ComputationGraphStore, Dtype, GradientCheckpoint, Tensor};
    /// let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
    /// ckpt.set_tensor("w", Tensor::new(Dtype::F32, vec![2], vec![0; 8])?);
    /// assert_eq!(ckpt.tensors["w"].shape, vec![2]);
    /// assert_eq!(ckpt.logical_bytes(), 8);
    /// # Ok::<(), ckptstore::Error>(())
    /// ```
    pub fn set_tensor(&mut self, name: impl Into<String>, tensor: Tensor) {
        self.tensors.insert(name.into(), tensor);
    }

    /// Remove the blob or tensor named `name` (blobs and tensors share
    /// one namespace); whether there was one.
    pub fn remove_entry(&mut self, name: &str) -> bool {
        self.optimizer_state.remove(name).is_some() || self.tensors.remove(name).is_some()
    }

    /// Total bytes of state: optimizer blobs and tensor data.
    pub fn logical_bytes(&self) -> u64 {
        let blobs: u64 = self.optimizer_state.values().map(|b| b.len() as u64).sum();
        let tensors: u64 = self.tensors.values().map(|t| t.data.len() as u64).sum();
        blobs + tensors
    }

    /// Write the checkpoint to `path` in the original JSON file format
    /// (pretty-printed).
    ///
    /// Unlike the original, this is durable: the JSON goes to a temporary file
    /// beside `path`, which is fsynced, renamed over `path`, and then the
    /// directory is fsynced. On any failure the temporary file is removed and
    /// `path` is untouched. A non-finite metric is refused
    /// ([`Error::InvalidCheckpoint`]): JSON cannot hold it. This is for import and export; a
    /// [`CheckpointStore`](crate::CheckpointStore) is faster and safer.
    ///
    /// ```
    /// # use ckptstore::{ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// let path = dir.path().join("step-3.json");
    /// let ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 3);
    /// ckpt.save(&path)?;
    /// assert_eq!(GradientCheckpoint::load(&path)?, ckpt);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn save(&self, path: &Path) -> Result<()> {
        self.validate()?;
        let bytes = serde_json::to_vec_pretty(self).map_err(|source| Error::Json {
            path: Some(path.to_owned()),
            source: Box::new(source),
        })?;
        write_durably(path, &bytes)
    }

    /// Read a checkpoint from a JSON file written by [`save`](Self::save) or
    /// by the original file-based implementation.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = fs::read(path).map_err(|e| Error::io("read", path, e))?;
        Self::from_json(&bytes).map_err(|e| match e {
            Error::Json { source, .. } => Error::Json {
                path: Some(path.to_owned()),
                source,
            },
            e => e,
        })
    }

    /// Decode a checkpoint from JSON bytes in the original file format.
    ///
    /// # Errors
    /// [`Error::Json`] when the bytes are not such a checkpoint.
    pub fn from_json(bytes: &[u8]) -> Result<Self> {
        serde_json::from_slice(bytes).map_err(|source| Error::Json {
            path: None,
            source: Box::new(source),
        })
    }
}

/// The prefix of metric names the library keeps for itself: 0.4.0 recorded
/// a save's cost as metrics under it, which a step without a save record
/// still reads as its record. Refused in a checkpoint to store.
pub(crate) const RESERVED_METRICS: &str = "ckptstore.";

/// The longest metadata string a checkpoint may carry (its loss CID, a
/// blob, tensor or metric name), in bytes.
pub const MAX_TEXT_BYTES: usize = 64 << 10;

/// One blob or tensor of a streamed commit, before its bytes are read.
pub(crate) struct Incoming {
    pub(crate) name: String,
    pub(crate) len: u64,
    /// A tensor's dtype and shape; `None` for an optimizer blob.
    pub(crate) tensor: Option<(Dtype, Vec<u64>)>,
}

impl Incoming {
    /// Put this blob or tensor, with its bytes `data`, into `ckpt`.
    pub(crate) fn place(&self, ckpt: &mut GradientCheckpoint, data: Vec<u8>) -> Result<()> {
        match &self.tensor {
            Some((dtype, shape)) => {
                let tensor = Tensor::new(*dtype, shape.clone(), data).map_err(|e| match e {
                    Error::InvalidTensor { reason, .. } => Error::InvalidTensor {
                        name: Some(self.name.clone()),
                        reason,
                    },
                    e => e,
                })?;
                ckpt.tensors.insert(self.name.clone(), tensor);
            }
            None => {
                ckpt.optimizer_state.insert(self.name.clone(), data);
            }
        }
        Ok(())
    }
}

/// A step as 0.4.0 wrote it, for the tests of reading one: its save's
/// cost and Lightning's name among its metrics, beside a run's own; and
/// the record it reads as.
#[cfg(test)]
pub(crate) mod legacy {
    use crate::{ComputationGraphStore, GradientCheckpoint, SaveRecord, Staging};

    pub(crate) fn step_0_4_0(step: u64) -> GradientCheckpoint {
        let mut old = GradientCheckpoint::new(ComputationGraphStore::new(), step)
            .with_metric("loss", 0.25)
            .with_metric("ckptstore.staging_s", 0.75)
            .with_metric("ckptstore.blocked_s", 0.125)
            .with_metric("lightning:checkpoints/last.ckpt", 1.0);
        old.set_optimizer_state("w", vec![7; 64]);
        old.set_optimizer_state("lightning:checkpoints/last.ckpt", b"{}".to_vec());
        old
    }

    pub(crate) fn record() -> SaveRecord {
        SaveRecord::default()
            .with_staging(Staging::new(0.75, 0.125).expect("finite"))
            .with_name("lightning:checkpoints/last.ckpt")
    }
}
