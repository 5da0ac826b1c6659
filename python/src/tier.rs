//! `ckptstore.dcp.Tiers`' directory and rules (`ckptstore::tier`), for the
//! Python layer's collectives: a node's directory is a `TierDir`, a record
//! a frozen `TierRecord` (checked when made, pickled as its fields), a
//! holding (holder, kind, rank, step, digest). Every check of a file is
//! Rust's.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ckptstore::tier::{
    self, Cost, Evaluation, Held, Holding, Legacy, Record, StoreKind, StoreName, TierDir,
};
use ckptstore::ContentDigest;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::py_err;

/// A save's cost as `SaveCost`'s fields.
fn cost_fields(c: Cost) -> HashMap<String, f64> {
    #[allow(clippy::cast_precision_loss)] // bytes as Python floats, as SaveCost keeps them
    let bytes = |n: u64| n as f64;
    HashMap::from([
        ("blocked_seconds".to_owned(), c.blocked_seconds),
        ("staging_seconds".to_owned(), c.staging_seconds),
        ("durable_seconds".to_owned(), c.durable_seconds),
        ("bytes_new".to_owned(), bytes(c.bytes_new)),
        ("bytes_deduplicated".to_owned(), bytes(c.bytes_deduplicated)),
    ])
}

fn digest(hex: &str) -> PyResult<ContentDigest> {
    ContentDigest::from_hex(hex)
        .ok_or_else(|| PyValueError::new_err(format!("{hex:?} is not a content digest")))
}

/// A record's fields as `TierRecord(...)` takes them (sizes and metadata:
/// None but in a record of format 1).
struct RecordArgs {
    step: u64,
    saved_at: u64,
    seq: u64,
    ranks_per_node: u32,
    digests: Vec<String>,
    copies: Vec<Vec<u32>>,
    sizes: Option<Vec<BTreeMap<String, u64>>>,
    upload: bool,
    metadata: Option<String>,
    cost: Option<HashMap<String, f64>>,
}

fn record(f: RecordArgs) -> PyResult<Record> {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // byte counts kept as floats
    let cost = f.cost.map(|c| {
        let get = |k: &str| c.get(k).copied().unwrap_or(0.0);
        Cost {
            blocked_seconds: get("blocked_seconds"),
            staging_seconds: get("staging_seconds"),
            durable_seconds: get("durable_seconds"),
            bytes_new: get("bytes_new") as u64,
            bytes_deduplicated: get("bytes_deduplicated") as u64,
        }
    });
    let legacy = match (f.sizes, f.metadata) {
        (Some(sizes), Some(metadata)) => Some(Legacy { sizes, metadata }),
        (None, None) => None,
        _ => {
            return Err(PyValueError::new_err(
                "a record has both sizes and metadata (format 1) or neither",
            ))
        }
    };
    Ok(Record {
        step: f.step,
        saved_at: f.saved_at,
        seq: f.seq,
        ranks_per_node: f.ranks_per_node,
        digests: f
            .digests
            .iter()
            .map(|d| digest(d))
            .collect::<PyResult<_>>()?,
        copies: f.copies,
        upload: f.upload,
        cost,
        legacy,
    })
}

/// What one rank holds of the local tier: the shard of rank `rank` of
/// step `step` with content `digest`, in its store of `kind` ("own" or
/// "copy"), held by rank `holder` (`ckptstore::tier::Holding`).
#[pyclass(frozen, module = "ckptstore._ckptstore")]
pub(crate) struct TierHolding(Holding);

#[pymethods]
impl TierHolding {
    #[new]
    fn new(holder: u32, kind: &str, rank: u32, step: u64, digest_hex: &str) -> PyResult<Self> {
        Ok(TierHolding(Holding {
            holder,
            store: StoreName {
                kind: store_kind(kind)?,
                rank,
            },
            step,
            digest: digest(digest_hex)?,
        }))
    }

    fn __repr__(&self) -> String {
        let h = &self.0;
        format!(
            "TierHolding(holder={}, rank={}, step={})",
            h.holder, h.store.rank, h.step
        )
    }
}

fn holdings(held: &[PyRef<'_, TierHolding>]) -> Vec<Holding> {
    held.iter().map(|h| h.0).collect()
}

/// A save of the local tier evaluated against what the job holds
/// (`ckptstore::tier::Evaluation`): which save (`step`, `saved_at`), its
/// place in the order of saves, and the ranks whose shard no rank holds
/// (empty: it can be restored whole). Pickled (ranks gather them).
#[pyclass(frozen, eq, module = "ckptstore._ckptstore")]
#[derive(PartialEq)]
pub(crate) struct TierEvaluation(Evaluation);

#[pymethods]
impl TierEvaluation {
    #[new]
    fn new(step: u64, saved_at: u64, order: [u64; 3], missing: Vec<u32>) -> Self {
        TierEvaluation(Evaluation {
            key: (step, saved_at),
            order: (order[0], order[1], order[2]),
            missing,
        })
    }

    #[getter]
    fn step(&self) -> u64 {
        self.0.key.0
    }
    #[getter]
    fn saved_at(&self) -> u64 {
        self.0.key.1
    }
    #[getter]
    fn missing(&self) -> Vec<u32> {
        self.0.missing.clone()
    }

    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
        let py = slf.py();
        let e = &slf.get().0;
        let order = [e.order.0, e.order.1, e.order.2];
        let args = (e.key.0, e.key.1, order, e.missing.clone()).into_pyobject(py)?;
        Ok((slf.get_type().into_any().unbind(), args.into_any().unbind()))
    }
}

/// A record of a save on the local tier (`ckptstore::tier::Record`),
/// frozen: checked when made, read field by field, pickled as its fields
/// (ranks hand records to each other).
#[pyclass(frozen, eq, module = "ckptstore._ckptstore", name = "TierRecord")]
#[derive(PartialEq)]
pub(crate) struct TierRecord(Record);

#[pymethods]
impl TierRecord {
    /// For each rank of this save, the ranks holding its shard (own
    /// stores first, then copies, by rank), by what each rank holds.
    fn holders(&self, held: Vec<PyRef<'_, TierHolding>>) -> Vec<Vec<u32>> {
        let held = holdings(&held);
        Held::new(&held).all_holders(&self.0)
    }

    #[new]
    #[pyo3(signature = (step, saved_at, ranks_per_node, digests, copies, upload, sizes=None, metadata=None, cost=None, seq=0))]
    #[allow(clippy::too_many_arguments)] // the record's fields, by name
    fn new(
        step: u64,
        saved_at: u64,
        ranks_per_node: u32,
        digests: Vec<String>,
        copies: Vec<Vec<u32>>,
        upload: bool,
        sizes: Option<Vec<BTreeMap<String, u64>>>,
        metadata: Option<String>,
        cost: Option<HashMap<String, f64>>,
        seq: u64,
    ) -> PyResult<Self> {
        record(RecordArgs {
            step,
            saved_at,
            seq,
            ranks_per_node,
            digests,
            copies,
            sizes,
            upload,
            metadata,
            cost,
        })
        .map(TierRecord)
    }

    #[getter]
    fn step(&self) -> u64 {
        self.0.step
    }
    #[getter]
    fn saved_at(&self) -> u64 {
        self.0.saved_at
    }
    #[getter]
    fn seq(&self) -> u64 {
        self.0.seq
    }
    #[getter]
    fn ranks_per_node(&self) -> u32 {
        self.0.ranks_per_node
    }
    #[getter]
    fn digests(&self) -> Vec<String> {
        self.0.digests.iter().map(ToString::to_string).collect()
    }
    #[getter]
    fn copies(&self) -> Vec<Vec<u32>> {
        self.0.copies.clone()
    }
    #[getter]
    fn upload(&self) -> bool {
        self.0.upload
    }
    #[getter]
    fn sizes(&self) -> Option<Vec<BTreeMap<String, u64>>> {
        self.0.legacy.as_ref().map(|l| l.sizes.clone())
    }
    #[getter]
    fn metadata(&self) -> Option<String> {
        self.0.legacy.as_ref().map(|l| l.metadata.clone())
    }
    #[getter]
    fn cost(&self) -> Option<HashMap<String, f64>> {
        self.0.cost.map(cost_fields)
    }
    #[getter]
    fn world_size(&self) -> u32 {
        self.0.world_size()
    }
    /// Which save of which step: (step, saved_at).
    #[getter]
    fn key(&self) -> (u64, u64) {
        self.0.key()
    }

    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
        let py = slf.py();
        let this = slf.get();
        let r = &this.0;
        let args = (
            r.step,
            r.saved_at,
            r.ranks_per_node,
            this.digests(),
            r.copies.clone(),
            r.upload,
            this.sizes(),
            this.metadata(),
            this.cost(),
            r.seq,
        )
            .into_pyobject(py)?;
        Ok((slf.get_type().into_any().unbind(), args.into_any().unbind()))
    }

    fn __repr__(&self) -> String {
        format!(
            "TierRecord(step={}, saved_at={}, seq={}, world_size={}, upload={})",
            self.0.step,
            self.0.saved_at,
            self.0.seq,
            self.0.world_size(),
            if self.0.upload { "True" } else { "False" }
        )
    }
}

/// A store of a node's tier directory: of `kind` ("own": rank `rank`'s
/// own shards; "copy": copies of them), at `path`.
#[pyclass(frozen, get_all, module = "ckptstore._ckptstore")]
pub(crate) struct TierStore {
    kind: String,
    rank: u32,
    path: String,
}

/// A node's directory of the local tier (`ckptstore::tier::TierDir`):
/// its records, marks and stores, every rule Rust's.
#[pyclass(frozen, module = "ckptstore._ckptstore", name = "TierDir")]
pub(crate) struct PyTierDir(TierDir);

#[pymethods]
impl PyTierDir {
    #[new]
    fn new(path: String) -> Self {
        PyTierDir(TierDir::new(path))
    }

    /// The save to restore among every rank's evaluations (of `step`
    /// only, if given), and the saves made after it that cannot be
    /// restored.
    #[staticmethod]
    #[pyo3(signature = (evaluations, step=None))]
    fn pick(
        evaluations: Vec<PyRef<'_, TierEvaluation>>,
        step: Option<u64>,
    ) -> (Option<TierEvaluation>, Vec<TierEvaluation>) {
        let all: Vec<Evaluation> = evaluations.iter().map(|e| e.0.clone()).collect();
        let (best, newer) = tier::pick(&all, step);
        let newer = newer.into_iter().map(TierEvaluation).collect();
        (best.map(TierEvaluation), newer)
    }

    #[getter]
    fn path(&self) -> String {
        self.0.path().to_string_lossy().into_owned()
    }

    /// The records (of rank `rank` only, if given); and why each refused
    /// file was refused.
    #[pyo3(signature = (rank=None))]
    fn records(
        &self,
        py: Python<'_>,
        rank: Option<u32>,
    ) -> PyResult<(Vec<TierRecord>, Vec<String>)> {
        let (records, refused) = py.detach(|| self.0.records(rank)).map_err(py_err)?;
        Ok((
            records.into_iter().map(|(_, r)| TierRecord(r)).collect(),
            refused.iter().map(ToString::to_string).collect(),
        ))
    }

    /// Write rank `rank`'s record durably (refused unless a reader takes it).
    fn write_record(&self, py: Python<'_>, rank: u32, record: &TierRecord) -> PyResult<()> {
        py.detach(|| self.0.write_record(rank, &record.0))
            .map_err(py_err)
    }

    /// Remove rank `rank`'s record of `step` and the step's in-bucket mark.
    fn remove_record(&self, py: Python<'_>, step: u64, rank: u32) -> PyResult<()> {
        py.detach(|| self.0.remove_record(step, rank))
            .map_err(py_err)
    }

    /// Retire `steps` for rank `rank`, whose node holds `node_ranks`: its
    /// records, the steps' marks, and records of the steps by ranks the
    /// node no longer holds (`TierDir::retire`).
    fn retire(
        &self,
        py: Python<'_>,
        steps: Vec<u64>,
        rank: u32,
        node_ranks: Vec<u32>,
    ) -> PyResult<()> {
        py.detach(|| self.0.retire(&steps, rank, &node_ranks))
            .map_err(py_err)
    }

    /// Mark the save `key` (step, saved_at) whole in the bucket, durably.
    fn mark_in_bucket(&self, py: Python<'_>, key: (u64, u64)) -> PyResult<()> {
        py.detach(|| self.0.mark_in_bucket(key)).map_err(py_err)
    }

    /// Whether the save `key` (step, saved_at) is marked whole in the bucket.
    fn in_bucket(&self, py: Python<'_>, key: (u64, u64)) -> PyResult<bool> {
        py.detach(|| self.0.in_bucket(key)).map_err(py_err)
    }

    /// Where the store of `kind` ("own" or "copy") of rank `rank` is.
    fn store_path(&self, kind: &str, rank: u32) -> PyResult<String> {
        let path = self.0.store_path(StoreName {
            kind: store_kind(kind)?,
            rank,
        });
        Ok(path.to_string_lossy().into_owned())
    }

    /// The stores, in name order.
    fn stores(&self) -> PyResult<Vec<TierStore>> {
        let names = self.0.stores().map_err(py_err)?;
        let store = |name: StoreName| TierStore {
            kind: if name.kind == StoreKind::Own {
                "own"
            } else {
                "copy"
            }
            .to_owned(),
            rank: name.rank,
            path: self.0.store_path(name).to_string_lossy().into_owned(),
        };
        Ok(names.into_iter().map(store).collect())
    }

    /// The steps a rank whose records are `records` keeps after a save
    /// (`ckptstore::tier::retain` over them and the directory's in-bucket
    /// marks): those of its `keep` saves made last and those still to be
    /// uploaded.
    fn retain(
        &self,
        py: Python<'_>,
        records: Vec<PyRef<'_, TierRecord>>,
        keep: usize,
    ) -> PyResult<Vec<u64>> {
        let records: Vec<Record> = records.iter().map(|r| r.0.clone()).collect();
        py.detach(|| {
            let mut marked = BTreeSet::new();
            for r in &records {
                if self.0.in_bucket(r.key())? {
                    marked.insert(r.key());
                }
            }
            let kept = tier::retain(&records, keep, |r| marked.contains(&r.key()));
            Ok(kept.into_iter().collect())
        })
        .map_err(py_err)
    }

    /// Each record evaluated against what the job holds.
    fn evaluate(
        &self,
        py: Python<'_>,
        held: Vec<PyRef<'_, TierHolding>>,
    ) -> PyResult<Vec<TierEvaluation>> {
        let held = holdings(&held);
        py.detach(|| {
            let (records, _) = self.0.records(None)?;
            let index = Held::new(&held);
            let all = records.iter().map(|(_, r)| index.evaluate(r));
            Ok(all.map(TierEvaluation).collect())
        })
        .map_err(py_err)
    }
}

fn store_kind(kind: &str) -> PyResult<StoreKind> {
    match kind {
        "own" => Ok(StoreKind::Own),
        "copy" => Ok(StoreKind::Copies),
        other => Err(PyValueError::new_err(format!("a store of kind {other:?}"))),
    }
}

/// Register the classes.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TierRecord>()?;
    m.add_class::<TierHolding>()?;
    m.add_class::<TierStore>()?;
    m.add_class::<TierEvaluation>()?;
    m.add_class::<PyTierDir>()?;
    Ok(())
}
