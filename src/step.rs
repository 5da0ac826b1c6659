//! The neutral model of a step: named entries (untyped blobs and typed
//! tensors), metrics and the save record. The bucket's shards and the
//! Python binding speak it; [`GradientCheckpoint`] is the seed's view of
//! the same state (with a computation graph and a loss CID, and its JSON
//! file format), which the store and the formats that carry a graph
//! (the seed's JSON, safetensors exports) keep.

use std::collections::{BTreeMap, HashMap};

use crate::checkpoint::RESERVED_METRICS;
use crate::file::unix_now;
use crate::{
    ComputationGraphStore, Error, GradientCheckpoint, Result, SaveRecord, Tensor, MAX_TEXT_BYTES,
};

/// One entry of a [`Step`]: bytes without a type, or a typed tensor.
/// Blobs and tensors share one namespace: a name is one or the other.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    /// Untyped bytes (a framework's file, an optimizer's state, a DCP
    /// entry's serialized bytes).
    Blob(Vec<u8>),
    /// A typed tensor.
    Tensor(Tensor),
}

impl Entry {
    /// The entry's bytes (a tensor's elements, little-endian row-major).
    pub fn bytes(&self) -> &[u8] {
        match self {
            Entry::Blob(b) => b,
            Entry::Tensor(t) => &t.data,
        }
    }
}

/// The state one step holds, in no framework's words: its entries by
/// name, its metrics and how it was saved.
///
/// ```
/// use ckptstore::{Dtype, Entry, GradientCheckpoint, Step, Tensor};
///
/// let mut step = Step::new(3);
/// step.insert("meta", Entry::Blob(b"{}".to_vec()));
/// step.insert("w", Entry::Tensor(Tensor::new(Dtype::U8, vec![4], vec![1; 4])?));
/// assert_eq!(step.logical_bytes(), 6);
///
/// // The seed's view: the same entries, an empty graph, no loss CID.
/// let ckpt = GradientCheckpoint::from(step.clone());
/// assert_eq!(ckpt.tensors["w"].shape, vec![4]);
/// assert_eq!(ckpt.into_step(), step);
/// # Ok::<(), ckptstore::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Step {
    /// The step number.
    pub step: u64,
    /// Unix time in seconds when the step was made.
    pub timestamp: u64,
    /// The entries, by name.
    pub entries: BTreeMap<String, Entry>,
    /// Named scalar metrics.
    pub metrics: BTreeMap<String, f64>,
    /// How the step was saved.
    pub save_record: SaveRecord,
}

impl Step {
    /// An empty step `step`, stamped with the current time.
    pub fn new(step: u64) -> Step {
        Step {
            step,
            timestamp: unix_now(),
            entries: BTreeMap::new(),
            metrics: BTreeMap::new(),
            save_record: SaveRecord::default(),
        }
    }

    /// Put `entry` under `name`, replacing any entry of that name.
    pub fn insert(&mut self, name: impl Into<String>, entry: Entry) {
        self.entries.insert(name.into(), entry);
    }

    /// Remove the entry `name`; whether there was one.
    pub fn remove(&mut self, name: &str) -> bool {
        self.entries.remove(name).is_some()
    }

    /// Total bytes of the entries.
    pub fn logical_bytes(&self) -> u64 {
        self.entries.values().map(|e| e.bytes().len() as u64).sum()
    }
}

impl From<Step> for GradientCheckpoint {
    /// The seed's view of `s`: its blobs as optimizer state, its tensors,
    /// an empty computation graph and no loss CID.
    fn from(s: Step) -> GradientCheckpoint {
        let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), s.step);
        ckpt.timestamp = s.timestamp;
        ckpt.metrics = s.metrics;
        ckpt.save_record = s.save_record;
        let mut blobs = HashMap::new();
        for (name, entry) in s.entries {
            match entry {
                Entry::Blob(b) => {
                    blobs.insert(name, b);
                }
                Entry::Tensor(t) => {
                    ckpt.tensors.insert(name, t);
                }
            }
        }
        ckpt.optimizer_state = blobs;
        ckpt
    }
}

impl GradientCheckpoint {
    /// This checkpoint's state as a [`Step`]: its optimizer blobs and
    /// tensors as entries, its metrics and record. The computation graph
    /// and the loss CID are not a step's: they are left behind (take
    /// them first where they matter).
    pub fn into_step(self) -> Step {
        let blobs = self.optimizer_state.into_iter();
        let tensors = self.tensors.into_iter();
        let entries = blobs
            .map(|(n, b)| (n, Entry::Blob(b)))
            .chain(tensors.map(|(n, t)| (n, Entry::Tensor(t))))
            .collect();
        Step {
            step: self.step,
            timestamp: self.timestamp,
            entries,
            metrics: self.metrics,
            save_record: self.save_record,
        }
    }

    /// Put `entry` under `name` (a blob as optimizer state), replacing
    /// any blob or tensor of that name.
    pub fn set_entry(&mut self, name: impl Into<String>, entry: Entry) {
        let name = name.into();
        self.remove_entry(&name);
        match entry {
            Entry::Blob(b) => {
                self.optimizer_state.insert(name, b);
            }
            Entry::Tensor(t) => {
                self.tensors.insert(name, t);
            }
        }
    }

    /// Check that the checkpoint can be stored and read back exactly: JSON
    /// has no NaN or infinity, so every metric must be finite; no metric is
    /// named with the library's prefix (a step without a save record would
    /// read two such metrics as the record 0.4.0 kept there); metadata
    /// strings (loss CID, names) are at most [`MAX_TEXT_BYTES`] long, the
    /// cap a bucket's readers hold them to.
    pub(crate) fn validate(&self) -> Result<()> {
        StepRef::Seed(self).validate()
    }

    /// The bytes of the blob named `name`, if there is one.
    pub fn blob(&self, name: &str) -> Option<&[u8]> {
        self.optimizer_state.get(name).map(Vec::as_slice)
    }
}

/// A step as a commit or an upload reads it: the store's checkpoint or a
/// neutral [`Step`] (a shard), borrowed.
#[derive(Clone, Copy)]
pub(crate) enum StepRef<'a> {
    /// A checkpoint of the store's API.
    Seed(&'a GradientCheckpoint),
    /// A neutral step: no graph, no loss CID.
    Neutral(&'a Step),
}

/// A blob or tensor as a plan cuts it: its name, bytes and, for a tensor,
/// its dtype and shape.
pub(crate) type EntryRef<'a> = (&'a String, &'a [u8], Option<(crate::Dtype, &'a [u64])>);

impl<'a> StepRef<'a> {
    pub(crate) fn step(self) -> u64 {
        match self {
            StepRef::Seed(c) => c.step,
            StepRef::Neutral(s) => s.step,
        }
    }

    pub(crate) fn timestamp(self) -> u64 {
        match self {
            StepRef::Seed(c) => c.timestamp,
            StepRef::Neutral(s) => s.timestamp,
        }
    }

    pub(crate) fn loss_cid(self) -> Option<&'a str> {
        match self {
            StepRef::Seed(c) => c.loss_cid.as_deref(),
            StepRef::Neutral(_) => None,
        }
    }

    pub(crate) fn metrics(self) -> &'a BTreeMap<String, f64> {
        match self {
            StepRef::Seed(c) => &c.metrics,
            StepRef::Neutral(s) => &s.metrics,
        }
    }

    pub(crate) fn save_record(self) -> &'a SaveRecord {
        match self {
            StepRef::Seed(c) => &c.save_record,
            StepRef::Neutral(s) => &s.save_record,
        }
    }

    /// The computation graph (a neutral step's is empty).
    pub(crate) fn graph(self) -> std::borrow::Cow<'a, ComputationGraphStore> {
        match self {
            StepRef::Seed(c) => std::borrow::Cow::Borrowed(&c.graph),
            StepRef::Neutral(_) => std::borrow::Cow::Owned(ComputationGraphStore::new()),
        }
    }

    /// Every blob and tensor, in no order.
    pub(crate) fn entries(self) -> Box<dyn Iterator<Item = EntryRef<'a>> + 'a> {
        let typed = |t: &'a Tensor| Some((t.dtype, t.shape.as_slice()));
        match self {
            StepRef::Seed(c) => Box::new(
                c.optimizer_state
                    .iter()
                    .map(|(n, b)| (n, b.as_slice(), None))
                    .chain(
                        c.tensors
                            .iter()
                            .map(move |(n, t)| (n, t.data.as_slice(), typed(t))),
                    ),
            ),
            StepRef::Neutral(s) => Box::new(s.entries.iter().map(move |(n, e)| match e {
                Entry::Blob(b) => (n, b.as_slice(), None),
                Entry::Tensor(t) => (n, t.data.as_slice(), typed(t)),
            })),
        }
    }

    /// Whether a blob or tensor is named `name`.
    pub(crate) fn contains(self, name: &str) -> bool {
        match self {
            StepRef::Seed(c) => {
                c.optimizer_state.contains_key(name) || c.tensors.contains_key(name)
            }
            StepRef::Neutral(s) => s.entries.contains_key(name),
        }
    }

    /// Bytes of the blobs and tensors.
    pub(crate) fn logical_bytes(self) -> u64 {
        match self {
            StepRef::Seed(c) => c.logical_bytes(),
            StepRef::Neutral(s) => s.logical_bytes(),
        }
    }

    /// How many entries are untyped blobs.
    pub(crate) fn blob_count(self) -> usize {
        self.entries().filter(|e| e.2.is_none()).count()
    }
}

impl<'a> From<&'a GradientCheckpoint> for StepRef<'a> {
    fn from(c: &'a GradientCheckpoint) -> StepRef<'a> {
        StepRef::Seed(c)
    }
}

impl<'a> From<&'a Step> for StepRef<'a> {
    fn from(s: &'a Step) -> StepRef<'a> {
        StepRef::Neutral(s)
    }
}

impl StepRef<'_> {
    /// Check that the step can be stored and read back exactly
    /// ([`GradientCheckpoint`]'s rules: finite metrics, none under the
    /// library's prefix, names and the loss CID at most
    /// [`MAX_TEXT_BYTES`](crate::MAX_TEXT_BYTES) long, one kind per name,
    /// tensors whose bytes fit their shape, a valid save record).
    pub(crate) fn validate(self) -> Result<()> {
        let step = self.step();
        let invalid = |reason: String| Error::InvalidCheckpoint { step, reason };
        let entries = self.entries().map(|(n, _, t)| {
            let what = if t.is_some() {
                "a tensor name"
            } else {
                "a blob name"
            };
            (what, n.as_str())
        });
        let names = self.metrics().keys().map(|n| ("a metric name", n.as_str()));
        let record = self.save_record().names.iter();
        let names = names
            .chain(entries)
            .chain(record.map(|n| ("a name of its save record", n.as_str())))
            .chain(self.loss_cid().map(|c| ("the loss CID", c)));
        for (what, text) in names {
            if text.len() > MAX_TEXT_BYTES {
                let len = text.len();
                return Err(invalid(format!(
                    "{what} is {len} bytes long (at most {MAX_TEXT_BYTES})"
                )));
            }
        }
        let metrics = self.metrics();
        if let Some(name) = metrics.keys().find(|n| n.starts_with(RESERVED_METRICS)) {
            return Err(invalid(format!(
                "metric {name:?}: names beginning {RESERVED_METRICS:?} are the library's \
                 (0.4.0 kept a save's cost under them; the step's save record holds it now)"
            )));
        }
        if let Some((name, v)) = metrics.iter().find(|(_, v)| !v.is_finite()) {
            return Err(invalid(format!(
                "metric {name:?} is {v}; metrics must be finite"
            )));
        }
        if let StepRef::Seed(c) = self {
            if let Some(name) = c
                .tensors
                .keys()
                .find(|n| c.optimizer_state.contains_key(*n))
            {
                return Err(invalid(format!(
                    "{name:?} is both a tensor and an optimizer blob; a name must be one"
                )));
            }
        }
        for (name, data, typed) in self.entries() {
            if let Some((dtype, shape)) = typed {
                Tensor::check_len(dtype, shape, data.len()).map_err(|reason| {
                    Error::InvalidTensor {
                        name: Some(name.clone()),
                        reason,
                    }
                })?;
            }
        }
        self.save_record().check(step)
    }
}
