//! `ckptstore._ckptstore`: the Rust side of the Python package. The Python
//! layer (`pysrc/ckptstore/__init__.py`) turns numpy arrays into
//! (dtype name, shape, bytes) and back; this module holds the store and
//! releases the GIL while it hashes and does I/O.

use std::collections::BTreeMap;
use std::sync::Mutex;

use ckptstore::{
    CheckpointStore, CommitHandle, CommitInfo, ComputationGraphStore, Dtype, Error,
    GradientCheckpoint, Retention, StoreOptions, Tensor,
};
use pyo3::exceptions::{PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

pyo3::create_exception!(
    _ckptstore,
    CkptError,
    pyo3::exceptions::PyException,
    "A ckptstore error."
);
pyo3::create_exception!(
    _ckptstore,
    StepExistsError,
    CkptError,
    "The step is stored already."
);
pyo3::create_exception!(
    _ckptstore,
    CorruptError,
    CkptError,
    "Stored data failed its integrity check."
);
pyo3::create_exception!(
    _ckptstore,
    LockedError,
    CkptError,
    "Another process holds the store for writing."
);

/// The Python exception for a store error.
fn py_err(e: Error) -> PyErr {
    let msg = e.to_string();
    if e.is_locked() {
        return LockedError::new_err(msg);
    }
    if let Some(io) = e.os_error() {
        let errno = io.raw_os_error().unwrap_or(0);
        return PyOSError::new_err((errno, msg));
    }
    match e {
        Error::StepExists { .. } => StepExistsError::new_err(msg),
        Error::Corrupt { .. } | Error::Poisoned { .. } => CorruptError::new_err(msg),
        Error::InvalidTensor { .. }
        | Error::InvalidCheckpoint { .. }
        | Error::InvalidOptions(_) => PyValueError::new_err(msg),
        e if e.is_io() => PyOSError::new_err(msg),
        _ => CkptError::new_err(msg),
    }
}

/// What `save` did, for Python.
fn info_dict<'py>(py: Python<'py>, info: &CommitInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", info.step)?;
    d.set_item("bytes_written", info.bytes_written)?;
    d.set_item("bytes_reused", info.bytes_reused)?;
    d.set_item("logical_bytes", info.logical_bytes)?;
    d.set_item("removed", info.removed.clone())?;
    d.set_item("seconds", info.duration.as_secs_f64())?;
    Ok(d)
}

/// Build a checkpoint from Python values: tensors as (name, dtype, shape,
/// bytes), blobs as (name, bytes).
fn checkpoint(
    step: u64,
    tensors: Vec<(String, String, Vec<u64>, Vec<u8>)>,
    blobs: Vec<(String, Vec<u8>)>,
    metrics: BTreeMap<String, f64>,
) -> PyResult<GradientCheckpoint> {
    let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    ckpt.metrics = metrics;
    for (name, dtype, shape, data) in tensors {
        let dtype = Dtype::from_name(&dtype)
            .ok_or_else(|| PyTypeError::new_err(format!("{name:?}: unknown dtype {dtype}")))?;
        let tensor = Tensor::new(dtype, shape, data).map_err(py_err)?;
        ckpt.set_tensor(name, tensor);
    }
    for (name, data) in blobs {
        ckpt.set_optimizer_state(name, data);
    }
    Ok(ckpt)
}

/// An open store.
#[pyclass(module = "ckptstore._ckptstore", name = "RawStore")]
struct RawStore {
    store: Option<CheckpointStore>,
}

impl RawStore {
    fn get(&self) -> PyResult<&CheckpointStore> {
        self.store
            .as_ref()
            .ok_or_else(|| CkptError::new_err("the store is closed"))
    }
}

#[pymethods]
impl RawStore {
    #[new]
    #[pyo3(signature = (path, read_only=false))]
    fn new(py: Python<'_>, path: std::path::PathBuf, read_only: bool) -> PyResult<Self> {
        let store = py
            .detach(|| {
                if read_only {
                    StoreOptions::new().open_read_only(&path)
                } else {
                    StoreOptions::new().open(&path)
                }
            })
            .map_err(py_err)?;
        Ok(RawStore { store: Some(store) })
    }

    /// Commit a step; durable when it returns.
    fn save<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        tensors: Vec<(String, String, Vec<u64>, Vec<u8>)>,
        blobs: Vec<(String, Vec<u8>)>,
        metrics: BTreeMap<String, f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ckpt = checkpoint(step, tensors, blobs, metrics)?;
        let store = self.get()?;
        let info = py.detach(|| store.commit(&ckpt)).map_err(py_err)?;
        info_dict(py, &info)
    }

    /// Queue a step for commit in the background.
    fn save_async(
        &self,
        step: u64,
        tensors: Vec<(String, String, Vec<u64>, Vec<u8>)>,
        blobs: Vec<(String, Vec<u8>)>,
        metrics: BTreeMap<String, f64>,
    ) -> PyResult<Handle> {
        let ckpt = checkpoint(step, tensors, blobs, metrics)?;
        let handle = self.get()?.commit_async(ckpt).map_err(py_err)?;
        Ok(Handle {
            pending: Mutex::new(Some(handle)),
            outcome: Mutex::new(None),
        })
    }

    /// Wait for every background save.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.get()?;
        py.detach(|| store.flush()).map_err(py_err)
    }

    /// A step as (step, timestamp, loss_cid, metrics, tensors, blobs), or
    /// None: the latest if `step` is None.
    #[pyo3(signature = (step=None))]
    #[allow(clippy::type_complexity)]
    fn load<'py>(
        &self,
        py: Python<'py>,
        step: Option<u64>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let store = self.get()?;
        let ckpt = py
            .detach(|| match step {
                Some(s) => store.get(s),
                None => store.latest(),
            })
            .map_err(py_err)?;
        let Some(ckpt) = ckpt else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("step", ckpt.step)?;
        d.set_item("timestamp", ckpt.timestamp)?;
        d.set_item("loss_cid", ckpt.loss_cid)?;
        d.set_item("metrics", ckpt.metrics)?;
        let tensors = PyDict::new(py);
        for (name, t) in ckpt.tensors {
            let bytes = PyBytes::new(py, &t.data);
            tensors.set_item(name, (t.dtype.name(), t.shape, bytes))?;
        }
        d.set_item("tensors", tensors)?;
        let blobs = PyDict::new(py);
        for (name, b) in ckpt.optimizer_state {
            blobs.set_item(name, PyBytes::new(py, &b))?;
        }
        d.set_item("blobs", blobs)?;
        Ok(Some(d))
    }

    fn steps(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        let store = self.get()?;
        py.detach(|| store.steps()).map_err(py_err)
    }

    fn latest_step(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        let store = self.get()?;
        py.detach(|| store.latest_step()).map_err(py_err)
    }

    fn remove(&self, py: Python<'_>, step: u64) -> PyResult<bool> {
        let store = self.get()?;
        py.detach(|| store.remove(step)).map_err(py_err)
    }

    /// Apply a retention policy now; the steps removed.
    #[pyo3(signature = (keep_last=None, keep_every=None))]
    fn gc(
        &self,
        py: Python<'_>,
        keep_last: Option<usize>,
        keep_every: Option<u64>,
    ) -> PyResult<Vec<u64>> {
        let mut policy = Retention::new();
        if let Some(n) = keep_last {
            policy = policy.keep_last(n);
        }
        if let Some(n) = keep_every {
            policy = policy.keep_every(n);
        }
        if policy.is_empty() {
            return Err(PyValueError::new_err("gc needs keep_last or keep_every"));
        }
        let store = self.get()?;
        py.detach(|| store.apply_retention(&policy)).map_err(py_err)
    }

    /// (ok, steps_ok, bytes_checked, damaged steps)
    fn verify(&self, py: Python<'_>) -> PyResult<(bool, u64, u64, Vec<u64>)> {
        let store = self.get()?;
        let report = py.detach(|| store.verify()).map_err(py_err)?;
        let damaged = report.damaged.iter().map(|(s, _)| *s).collect();
        Ok((
            report.is_ok(),
            report.steps_ok,
            report.bytes_checked,
            damaged,
        ))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let store = self.get()?;
        let s = py.detach(|| store.stats()).map_err(py_err)?;
        let d = PyDict::new(py);
        d.set_item("steps", s.steps)?;
        d.set_item("logical_bytes", s.logical_bytes)?;
        d.set_item("stored_bytes", s.stored_bytes)?;
        d.set_item("chunks", s.chunks)?;
        d.set_item("file_bytes", s.file_bytes)?;
        d.set_item("dedup_ratio", s.dedup_ratio())?;
        Ok(d)
    }

    /// Finish background saves and close the store.
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        let result = match &self.store {
            Some(store) => py.detach(|| store.flush()).map_err(py_err),
            None => Ok(()),
        };
        if let Some(store) = self.store.take() {
            py.detach(move || drop(store));
        }
        result
    }
}

/// A background save.
#[pyclass(module = "ckptstore._ckptstore", name = "Handle")]
struct Handle {
    pending: Mutex<Option<CommitHandle>>,
    outcome: Mutex<Option<Result<CommitInfo, PyErr>>>,
}

#[pymethods]
impl Handle {
    /// Whether the save has finished.
    fn done(&self) -> PyResult<bool> {
        let mut pending = self
            .pending
            .lock()
            .map_err(|_| CkptError::new_err("handle lock poisoned"))?;
        if let Some(h) = pending.take() {
            match h.try_wait() {
                Ok(outcome) => self.record(outcome)?,
                Err(h) => *pending = Some(h),
            }
        }
        Ok(pending.is_none())
    }

    /// Wait for the save: its info, or its error raised.
    fn result<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let handle = self
            .pending
            .lock()
            .map_err(|_| CkptError::new_err("handle lock poisoned"))?
            .take();
        if let Some(h) = handle {
            let outcome = py.detach(move || h.wait());
            self.record(outcome)?;
        }
        let outcome = self
            .outcome
            .lock()
            .map_err(|_| CkptError::new_err("handle lock poisoned"))?;
        match outcome.as_ref() {
            Some(Ok(info)) => info_dict(py, info),
            Some(Err(e)) => Err(e.clone_ref(py)),
            None => Err(CkptError::new_err("the save has no outcome")),
        }
    }
}

impl Handle {
    fn record(&self, outcome: ckptstore::Result<CommitInfo>) -> PyResult<()> {
        let mut slot = self
            .outcome
            .lock()
            .map_err(|_| CkptError::new_err("handle lock poisoned"))?;
        *slot = Some(outcome.map_err(py_err));
        Ok(())
    }
}

/// The module.
#[pymodule]
fn _ckptstore(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RawStore>()?;
    m.add_class::<Handle>()?;
    m.add("Error", m.py().get_type::<CkptError>())?;
    m.add("StepExistsError", m.py().get_type::<StepExistsError>())?;
    m.add("CorruptError", m.py().get_type::<CorruptError>())?;
    m.add("LockedError", m.py().get_type::<LockedError>())?;
    Ok(())
}
