//! Conversions between Python's values and the crate's: the tensors and
//! blobs of a save, a checkpoint as a dict, a retention policy. The store
//! and the remote classes both use them.

use std::collections::BTreeMap;

use ckptstore::{Dtype, Entry, GradientCheckpoint, Retention, Step, Tensor, TensorRef};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::{borrow_bytes, Buffer, ChunkHashes};
use crate::py_err;

/// A tensor from Python: name, store dtype name, shape, and an array whose
/// memory holds the elements.
pub(crate) type PyTensor<'py> = (String, String, Vec<u64>, Bound<'py, PyAny>);

/// A tensor to save: a [`PyTensor`] and the hashes of its chunks when they
/// were taken as it was copied.
pub(crate) type PySaved<'py> = (
    String,
    String,
    Vec<u64>,
    Bound<'py, PyAny>,
    Option<PyRef<'py, ChunkHashes>>,
);

pub(crate) fn dtype(name: &str, dtype: &str) -> PyResult<Dtype> {
    Dtype::from_name(dtype)
        .ok_or_else(|| PyTypeError::new_err(format!("{name:?}: unknown dtype {dtype}")))
}

/// The tensors of a save, borrowing the arrays' memory (and their hashes).
pub(crate) fn borrowed<'a>(
    tensors: &'a [PySaved<'_>],
) -> PyResult<BTreeMap<String, TensorRef<'a>>> {
    let mut out = BTreeMap::new();
    for (name, dt, shape, array, hashes) in tensors {
        let data = borrow_bytes(array)?;
        let mut t = TensorRef::new(dtype(name, dt)?, shape.clone(), data);
        if let Some(h) = hashes {
            t = t.and_then(|t| t.with_hashes(&h.0));
        }
        let t = t.map_err(|e| PyValueError::new_err(format!("{name:?}: {e}")))?;
        if out.insert(name.clone(), t).is_some() {
            return Err(PyValueError::new_err(format!("{name:?} is given twice")));
        }
    }
    Ok(out)
}

/// Step `step` with `blobs`, `metrics` and `record`, no tensors.
pub(crate) fn step_of(
    step: u64,
    blobs: Vec<(String, Vec<u8>)>,
    metrics: BTreeMap<String, f64>,
    record: Option<&crate::record::SaveRecord>,
) -> Step {
    let mut s = Step::new(step);
    s.metrics = metrics;
    s.save_record = crate::record::of(record);
    for (name, data) in blobs {
        s.insert(name, Entry::Blob(data));
    }
    s
}

/// Step `step` holding copies of the arrays.
pub(crate) fn owned(
    step: u64,
    tensors: &[PySaved<'_>],
    blobs: Vec<(String, Vec<u8>)>,
    metrics: BTreeMap<String, f64>,
    record: Option<&crate::record::SaveRecord>,
) -> PyResult<Step> {
    let mut s = step_of(step, blobs, metrics, record);
    for (name, t) in borrowed(tensors)? {
        let tensor =
            Tensor::new(t.dtype(), t.shape().to_vec(), t.data().to_vec()).map_err(py_err)?;
        s.insert(name, Entry::Tensor(tensor));
    }
    Ok(s)
}

/// A checkpoint as a dict ([`step_dict`] with its loss CID).
pub(crate) fn ckpt_dict(
    py: Python<'_>,
    mut ckpt: GradientCheckpoint,
) -> PyResult<Bound<'_, PyDict>> {
    let loss_cid = ckpt.loss_cid.take();
    step_dict(py, ckpt.into_step(), loss_cid)
}

/// A step as a dict (step, timestamp, loss_cid, metrics, tensors:
/// name -> (dtype, shape, Buffer), blobs: name -> Buffer); arrays view the
/// bytes read, without a copy.
pub(crate) fn step_dict(
    py: Python<'_>,
    s: Step,
    loss_cid: Option<String>,
) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", s.step)?;
    d.set_item("timestamp", s.timestamp)?;
    d.set_item("loss_cid", loss_cid)?;
    d.set_item("metrics", s.metrics)?;
    let tensors = PyDict::new(py);
    let blobs = PyDict::new(py);
    for (name, entry) in s.entries {
        match entry {
            Entry::Tensor(t) => {
                let data = Bound::new(py, Buffer::new(t.data))?;
                tensors.set_item(name, (t.dtype.name(), t.shape, data))?;
            }
            Entry::Blob(b) => blobs.set_item(name, Bound::new(py, Buffer::new(b))?)?,
        }
    }
    d.set_item("tensors", tensors)?;
    d.set_item("blobs", blobs)?;
    Ok(d)
}

/// A retention policy from `gc`'s arguments.
pub(crate) fn policy(
    keep_last: Option<usize>,
    keep_every: Option<u64>,
    allow_deleting_all: bool,
) -> PyResult<Retention> {
    if keep_last == Some(0) && keep_every.is_none() && !allow_deleting_all {
        return Err(PyValueError::new_err(
            "keep_last=0 keeps no step: pass allow_deleting_all=True to delete every step",
        ));
    }
    let mut policy = Retention::new();
    if allow_deleting_all {
        policy = policy.allow_deleting_all();
    }
    if let Some(n) = keep_last {
        policy = policy.keep_last(n);
    }
    if let Some(n) = keep_every {
        policy = policy.keep_every(n);
    }
    if policy.is_empty() {
        return Err(PyValueError::new_err("gc needs keep_last or keep_every"));
    }
    Ok(policy)
}
