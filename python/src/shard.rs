//! A shard write as Python gives it: the types `RawRemote.write_shard`
//! takes, each the Python face of the crate's (`ShardId` of the write's
//! step, rank and world; `ShardUpload`, how far it goes; and its source,
//! `ShardValues` in Python's memory or a `StoreStep`). No choice crosses
//! the binding as a string or a flag.

use std::collections::BTreeMap;

use ckptstore::{SaveId, ShardHash};
use pyo3::prelude::*;

use crate::convert::{given, Given, PyTensor};
use crate::record::SaveRecord;
use crate::store::RawStore;

/// Rank `rank`'s shard of global step `step` of `world` ranks.
#[pyclass(frozen, eq, get_all, module = "ckptstore")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ShardId {
    step: u64,
    rank: u32,
    world: u32,
}

#[pymethods]
impl ShardId {
    #[new]
    fn new(step: u64, rank: u32, world: u32) -> Self {
        ShardId { step, rank, world }
    }

    fn __repr__(&self) -> String {
        format!(
            "ShardId(step={}, rank={}, world={})",
            self.step, self.rank, self.world
        )
    }
}

impl ShardId {
    /// The step.
    pub(crate) fn step(self) -> u64 {
        self.step
    }

    /// As the crate's `ShardWrite::new` takes it.
    pub(crate) fn triple(self) -> (u64, u32, u32) {
        (self.step, self.rank, self.world)
    }
}

/// How far a shard's write goes (`ckptstore::ShardUpload`): its chunks
/// only (`ChunksOnly`: its shard follows later, beside the other ranks'
/// data), its shard (`Manifest`: a coordinator completes the step), its
/// shard and the step's commit once every rank's is there (`Complete`;
/// `RankLocal(save)` for ranks that never coordinate: only with shards of
/// save `save`, an identity alike on its ranks; `RankLocalShard(save)`:
/// its shard of that save only, the ranks completing the step through the
/// job's rendezvous store), or its shard and the step completed with
/// exactly `shards` (`Commit`: every rank's shard name, by rank; this
/// rank's entry is not read; `CommitReported`: the same, the names
/// trusted as the ranks reported them once their uploads returned, no
/// other shard read).
#[pyclass(frozen, eq, module = "ckptstore")]
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ShardUpload {
    ChunksOnly {},
    Manifest {},
    Complete {},
    RankLocal { save: String },
    RankLocalShard { save: String },
    Commit { shards: Vec<String> },
    CommitReported { shards: Vec<String> },
}

impl ShardUpload {
    /// The crate's, for a write of shard `id` (a commit's shard names
    /// decoded; this rank's entry is not read).
    pub(crate) fn to_crate(&self, id: ShardId) -> ckptstore::Result<ckptstore::ShardUpload> {
        Ok(match self {
            ShardUpload::ChunksOnly {} => ckptstore::ShardUpload::ChunksOnly,
            ShardUpload::Manifest {} => ckptstore::ShardUpload::Manifest,
            ShardUpload::Complete {} => ckptstore::ShardUpload::Complete,
            ShardUpload::RankLocal { save } => ckptstore::ShardUpload::RankLocal(SaveId::of(save)),
            ShardUpload::RankLocalShard { save } => {
                ckptstore::ShardUpload::RankLocalShard(SaveId::of(save))
            }
            ShardUpload::Commit { shards } => ckptstore::ShardUpload::Commit(named(id, shards)?),
            ShardUpload::CommitReported { shards } => {
                ckptstore::ShardUpload::CommitReported(named(id, shards)?)
            }
        })
    }
}

/// Every rank's shard name, by rank, decoded; shard `id`'s own entry is
/// not read.
fn named(id: ShardId, shards: &[String]) -> ckptstore::Result<Vec<Option<ShardHash>>> {
    (0u32..)
        .zip(shards)
        .map(|(rank, name)| {
            (rank != id.rank)
                .then(|| shard_hash(id.step, rank, name))
                .transpose()
        })
        .collect()
}

/// Rank `rank`'s shard name as Python gives it (its hash in hex), decoded.
pub(crate) fn shard_hash(step: u64, rank: u32, name: &str) -> ckptstore::Result<ShardHash> {
    ShardHash::from_hex(name).ok_or_else(|| ckptstore::Error::InvalidCheckpoint {
        step,
        reason: format!("shard {rank}: {name:?} is not a hash"),
    })
}

/// A shard's bytes in Python's memory: `tensors` by name (`Tensor`s:
/// hashed and uploaded from the arrays' own memory), `blobs` by name,
/// `metrics` and `record`.
#[pyclass(frozen, module = "ckptstore")]
pub(crate) struct ShardValues {
    pub(crate) tensors: BTreeMap<String, Py<PyTensor>>,
    pub(crate) blobs: BTreeMap<String, Vec<u8>>,
    pub(crate) metrics: BTreeMap<String, f64>,
    pub(crate) record: Option<Py<SaveRecord>>,
}

#[pymethods]
impl ShardValues {
    #[new]
    #[pyo3(signature = (tensors=BTreeMap::new(), blobs=BTreeMap::new(), metrics=BTreeMap::new(), record=None))]
    fn new(
        tensors: BTreeMap<String, Py<PyTensor>>,
        blobs: BTreeMap<String, Vec<u8>>,
        metrics: BTreeMap<String, f64>,
        record: Option<Py<SaveRecord>>,
    ) -> Self {
        ShardValues {
            tensors,
            blobs,
            metrics,
            record,
        }
    }
}

impl ShardValues {
    /// The tensors, as the conversions take them.
    pub(crate) fn saved<'py>(&self, py: Python<'py>) -> Vec<Given<'py>> {
        given(py, &self.tensors)
    }
}

/// A shard's bytes in a store: step `ShardId.step` of `store`, less the
/// entries named in `drop`, with the blobs `add`, read and hashed in Rust
/// (its bytes never reach Python).
#[pyclass(frozen, module = "ckptstore")]
pub(crate) struct StoreStep {
    pub(crate) store: Py<RawStore>,
    pub(crate) drop: Vec<String>,
    pub(crate) add: Vec<(String, Vec<u8>)>,
}

#[pymethods]
impl StoreStep {
    #[new]
    #[pyo3(signature = (store, drop=Vec::new(), add=BTreeMap::new()))]
    fn new(store: Py<RawStore>, drop: Vec<String>, add: BTreeMap<String, Vec<u8>>) -> Self {
        let add = add.into_iter().collect();
        StoreStep { store, drop, add }
    }
}
