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

/// A tensor given as its bytes, for a dtype numpy may lack (`BF16`
/// without ml_dtypes, the `F8_*` types): a value of a saved state, like a
/// numpy array. `data` is any C-contiguous buffer of dtype x shape bytes;
/// `hashes`, the hashes of its chunks `copy_hashed` took as it copied
/// them there (a save then does not read the bytes again to hash them).
#[pyclass(frozen, get_all, module = "ckptstore", name = "Tensor")]
pub(crate) struct PyTensor {
    dtype: String,
    shape: Vec<u64>,
    data: Py<PyAny>,
    hashes: Option<Py<crate::arrays::ChunkHashes>>,
}

#[pymethods]
impl PyTensor {
    #[new]
    #[pyo3(signature = (dtype, shape, data, hashes=None))]
    fn new(
        dtype: String,
        shape: Vec<u64>,
        data: Bound<'_, PyAny>,
        hashes: Option<Py<crate::arrays::ChunkHashes>>,
    ) -> PyResult<Self> {
        if ckptstore::Dtype::from_name(&dtype).is_none() {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "unknown dtype {dtype:?}: a safetensors dtype name such as \"BF16\""
            )));
        }
        Ok(PyTensor {
            dtype,
            shape,
            data: data.unbind(),
            hashes,
        })
    }

    fn __repr__(&self) -> String {
        format!("Tensor(dtype={:?}, shape={:?})", self.dtype, self.shape)
    }
}

impl PyTensor {
    /// This tensor named `name`, its array bound.
    pub(crate) fn given<'py>(&self, py: Python<'py>, name: &str) -> Given<'py> {
        Given {
            name: name.to_owned(),
            dtype: self.dtype.clone(),
            shape: self.shape.clone(),
            data: self.data.bind(py).clone(),
            hashes: self.hashes.as_ref().map(|h| h.bind(py).borrow()),
        }
    }
}

/// A named tensor of a save or a load with its array bound, while the
/// array's memory is borrowed.
pub(crate) struct Given<'py> {
    pub(crate) name: String,
    pub(crate) dtype: String,
    pub(crate) shape: Vec<u64>,
    pub(crate) data: Bound<'py, PyAny>,
    pub(crate) hashes: Option<PyRef<'py, ChunkHashes>>,
}

/// Each of `tensors`, named, its array bound.
pub(crate) fn given<'py>(
    py: Python<'py>,
    tensors: &BTreeMap<String, Py<PyTensor>>,
) -> Vec<Given<'py>> {
    tensors
        .iter()
        .map(|(name, t)| t.get().given(py, name))
        .collect()
}

pub(crate) fn dtype(name: &str, dtype: &str) -> PyResult<Dtype> {
    Dtype::from_name(dtype)
        .ok_or_else(|| PyTypeError::new_err(format!("{name:?}: unknown dtype {dtype}")))
}

/// The tensors of a save, borrowing the arrays' memory (and their hashes).
pub(crate) fn borrowed<'a>(tensors: &'a [Given<'_>]) -> PyResult<BTreeMap<String, TensorRef<'a>>> {
    let mut out = BTreeMap::new();
    for g in tensors {
        let data = borrow_bytes(&g.data)?;
        let mut t = TensorRef::new(dtype(&g.name, &g.dtype)?, g.shape.clone(), data);
        if let Some(h) = &g.hashes {
            t = t.and_then(|t| t.with_hashes(&h.0));
        }
        let t = t.map_err(|e| PyValueError::new_err(format!("{:?}: {e}", g.name)))?;
        out.insert(g.name.clone(), t);
    }
    Ok(out)
}

/// Step `step` with `blobs`, `metrics` and `record`, no tensors.
pub(crate) fn step_of(
    step: u64,
    blobs: BTreeMap<String, Vec<u8>>,
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
    tensors: &[Given<'_>],
    blobs: BTreeMap<String, Vec<u8>>,
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
