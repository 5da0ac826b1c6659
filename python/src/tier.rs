//! `ckptstore.dcp.Tiers`' directory and rules (`ckptstore::tier`), for the
//! Python layer's collectives: a record crosses as a tuple of its fields
//! (`_tier_layout.Record`), a holding as (holder, kind, rank, step,
//! digest). Every check of a file is Rust's.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ckptstore::tier::{
    self, Cost, Evaluation, Held, Holding, Legacy, Record, StoreKind, StoreName, TierDir,
};
use ckptstore::ContentDigest;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::py_err;

/// A record's fields: step, saved_at, seq, ranks_per_node, digests,
/// copies, sizes, upload, metadata, cost (sizes and metadata: None but in
/// a record of format 1).
type RecordFields = (
    u64,
    u64,
    u64,
    u32,
    Vec<String>,
    Vec<Vec<u32>>,
    Option<Vec<BTreeMap<String, u64>>>,
    bool,
    Option<String>,
    Option<HashMap<String, f64>>,
);

/// (holder, "own" or "copy", source rank, step, digest).
type HoldingFields = (u32, String, u32, u64, String);

/// (order, (step, saved_at), missing ranks).
type EvaluationFields = ((u64, u64, u64), (u64, u64), Vec<u32>);

fn fields(r: &Record) -> RecordFields {
    let cost = r.cost.map(|c| {
        #[allow(clippy::cast_precision_loss)] // bytes as Python floats, as SaveCost keeps them
        let bytes = |n: u64| n as f64;
        HashMap::from([
            ("blocked_seconds".to_owned(), c.blocked_seconds),
            ("staging_seconds".to_owned(), c.staging_seconds),
            ("durable_seconds".to_owned(), c.durable_seconds),
            ("bytes_new".to_owned(), bytes(c.bytes_new)),
            ("bytes_deduplicated".to_owned(), bytes(c.bytes_deduplicated)),
        ])
    });
    (
        r.step,
        r.saved_at,
        r.seq,
        r.ranks_per_node,
        r.digests.iter().map(ToString::to_string).collect(),
        r.copies.clone(),
        r.legacy.as_ref().map(|l| l.sizes.clone()),
        r.upload,
        r.legacy.as_ref().map(|l| l.metadata.clone()),
        cost,
    )
}

fn digest(hex: &str) -> PyResult<ContentDigest> {
    ContentDigest::from_hex(hex)
        .ok_or_else(|| PyValueError::new_err(format!("{hex:?} is not a content digest")))
}

fn record(f: RecordFields) -> PyResult<Record> {
    let (step, saved_at, seq, ranks_per_node, digests, copies, sizes, upload, metadata, cost) = f;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // byte counts kept as floats
    let cost = cost.map(|c| {
        let get = |k: &str| c.get(k).copied().unwrap_or(0.0);
        Cost {
            blocked_seconds: get("blocked_seconds"),
            staging_seconds: get("staging_seconds"),
            durable_seconds: get("durable_seconds"),
            bytes_new: get("bytes_new") as u64,
            bytes_deduplicated: get("bytes_deduplicated") as u64,
        }
    });
    let legacy = match (sizes, metadata) {
        (Some(sizes), Some(metadata)) => Some(Legacy { sizes, metadata }),
        (None, None) => None,
        _ => {
            return Err(PyValueError::new_err(
                "a record has both sizes and metadata (format 1) or neither",
            ))
        }
    };
    Ok(Record {
        step,
        saved_at,
        seq,
        ranks_per_node,
        digests: digests.iter().map(|d| digest(d)).collect::<PyResult<_>>()?,
        copies,
        upload,
        cost,
        legacy,
    })
}

fn holdings(held: Vec<HoldingFields>) -> PyResult<Vec<Holding>> {
    held.into_iter()
        .map(|(holder, kind, rank, step, hex)| {
            let kind = match kind.as_str() {
                "own" => StoreKind::Own,
                "copy" => StoreKind::Copies,
                other => return Err(PyValueError::new_err(format!("a store of kind {other:?}"))),
            };
            Ok(Holding {
                holder,
                store: StoreName { kind, rank },
                step,
                digest: digest(&hex)?,
            })
        })
        .collect()
}

/// The records of a node's directory (of rank `rank` only, if given), as
/// tuples of their fields; and why each refused file was refused.
#[pyfunction]
#[pyo3(signature = (directory, rank=None))]
pub(crate) fn tier_records(
    py: Python<'_>,
    directory: String,
    rank: Option<u32>,
) -> PyResult<(Vec<RecordFields>, Vec<String>)> {
    let (records, refused) = py
        .detach(|| TierDir::new(directory).records(rank))
        .map_err(py_err)?;
    Ok((
        records.iter().map(|(_, r)| fields(r)).collect(),
        refused.iter().map(ToString::to_string).collect(),
    ))
}

/// Write rank `rank`'s record durably (refused unless a reader takes it).
#[pyfunction]
pub(crate) fn tier_write_record(
    py: Python<'_>,
    directory: String,
    rank: u32,
    record: RecordFields,
) -> PyResult<()> {
    let record = self::record(record)?;
    py.detach(|| TierDir::new(directory).write_record(rank, &record))
        .map_err(py_err)
}

/// Remove rank `rank`'s record of `step` and the step's in-bucket mark.
#[pyfunction]
pub(crate) fn tier_remove_record(
    py: Python<'_>,
    directory: String,
    step: u64,
    rank: u32,
) -> PyResult<()> {
    py.detach(|| TierDir::new(directory).remove_record(step, rank))
        .map_err(py_err)
}

/// Mark the save `key` (step, saved_at) whole in the bucket, durably.
#[pyfunction]
pub(crate) fn tier_mark_in_bucket(
    py: Python<'_>,
    directory: String,
    key: (u64, u64),
) -> PyResult<()> {
    py.detach(|| TierDir::new(directory).mark_in_bucket(key))
        .map_err(py_err)
}

/// Whether the save `key` (step, saved_at) is marked whole in the bucket.
#[pyfunction]
pub(crate) fn tier_in_bucket(py: Python<'_>, directory: String, key: (u64, u64)) -> PyResult<bool> {
    py.detach(|| TierDir::new(directory).in_bucket(key))
        .map_err(py_err)
}

/// Where a node's directory keeps the store of `kind` ("own" or "copy")
/// of rank `rank`.
#[pyfunction]
pub(crate) fn tier_store_path(directory: String, kind: &str, rank: u32) -> PyResult<String> {
    let kind = match kind {
        "own" => StoreKind::Own,
        "copy" => StoreKind::Copies,
        other => return Err(PyValueError::new_err(format!("a store of kind {other:?}"))),
    };
    let path = TierDir::new(directory).store_path(StoreName { kind, rank });
    Ok(path.to_string_lossy().into_owned())
}

/// The stores of a node's directory: (kind "own" or "copy", rank, path).
#[pyfunction]
pub(crate) fn tier_stores(directory: String) -> PyResult<Vec<(String, u32, String)>> {
    let dir = TierDir::new(directory);
    Ok(dir
        .stores()
        .map_err(py_err)?
        .into_iter()
        .map(|name| {
            let kind = if name.kind == StoreKind::Own {
                "own"
            } else {
                "copy"
            };
            (
                kind.to_owned(),
                name.rank,
                dir.store_path(name).to_string_lossy().into_owned(),
            )
        })
        .collect())
}

/// The steps rank `rank` keeps after a save (`ckptstore::tier::retain`
/// over its records and the directory's in-bucket marks).
#[pyfunction]
pub(crate) fn tier_retain(
    py: Python<'_>,
    directory: String,
    rank: u32,
    keep: usize,
) -> PyResult<Vec<u64>> {
    py.detach(|| {
        let dir = TierDir::new(directory);
        let (records, _) = dir.records(Some(rank))?;
        let records: Vec<Record> = records.into_iter().map(|(_, r)| r).collect();
        let mut marked = BTreeSet::new();
        for r in &records {
            if dir.in_bucket(r.key())? {
                marked.insert(r.key());
            }
        }
        let kept = tier::retain(&records, keep, |r| marked.contains(&r.key()));
        Ok(kept.into_iter().collect())
    })
    .map_err(py_err)
}

/// Each record of `directory` evaluated against what the job holds.
#[pyfunction]
pub(crate) fn tier_evaluate(
    py: Python<'_>,
    directory: String,
    held: Vec<HoldingFields>,
) -> PyResult<Vec<EvaluationFields>> {
    let held = holdings(held)?;
    py.detach(|| {
        let (records, _) = TierDir::new(directory).records(None)?;
        let index = Held::new(&held);
        Ok(records
            .iter()
            .map(|(_, r)| {
                let e = index.evaluate(r);
                (e.order, e.key, e.missing)
            })
            .collect())
    })
    .map_err(py_err)
}

/// The save to restore among every rank's evaluations (of `step` only, if
/// given), and the saves made after it that cannot be restored.
#[pyfunction]
#[pyo3(signature = (evaluations, step=None))]
pub(crate) fn tier_pick(
    evaluations: Vec<EvaluationFields>,
    step: Option<u64>,
) -> (Option<EvaluationFields>, Vec<EvaluationFields>) {
    let all: Vec<Evaluation> = evaluations
        .into_iter()
        .map(|(order, key, missing)| Evaluation {
            key,
            order,
            missing,
        })
        .collect();
    let (best, newer) = tier::pick(&all, step);
    let out = |e: Evaluation| (e.order, e.key, e.missing);
    (best.map(out), newer.into_iter().map(out).collect())
}

/// For each rank of the save `record`, the ranks holding its shard (own
/// stores first, then copies, by rank).
#[pyfunction]
pub(crate) fn tier_holders(
    record: RecordFields,
    held: Vec<HoldingFields>,
) -> PyResult<Vec<Vec<u32>>> {
    let record = self::record(record)?;
    let held = holdings(held)?;
    Ok(Held::new(&held).all_holders(&record))
}

/// Register the functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(pyo3::wrap_pyfunction!(tier_records, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(tier_write_record, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(tier_remove_record, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(tier_mark_in_bucket, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(tier_in_bucket, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(tier_stores, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(tier_store_path, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(tier_retain, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(tier_evaluate, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(tier_pick, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(tier_holders, m)?)?;
    Ok(())
}
