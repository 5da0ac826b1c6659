//! A background save, as Python sees it.

use std::sync::Mutex;

use ckptstore::{CommitHandle, CommitInfo};
use pyo3::prelude::*;

use crate::results;
use crate::{py_err, CkptError};

/// A background save.
#[pyclass(module = "ckptstore._ckptstore", name = "Handle")]
pub(crate) struct Handle {
    pending: Mutex<Option<CommitHandle>>,
    outcome: Mutex<Option<Result<CommitInfo, PyErr>>>,
}

impl Handle {
    pub(crate) fn new(handle: CommitHandle) -> Self {
        Handle {
            pending: Mutex::new(Some(handle)),
            outcome: Mutex::new(None),
        }
    }

    fn record(&self, outcome: ckptstore::Result<CommitInfo>) -> PyResult<()> {
        *lock(&self.outcome)? = Some(outcome.map_err(py_err));
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> PyResult<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| CkptError::new_err("handle lock poisoned"))
}

#[pymethods]
impl Handle {
    /// Whether the save has finished.
    fn done(&self) -> PyResult<bool> {
        let mut pending = lock(&self.pending)?;
        if let Some(h) = pending.take() {
            match h.try_wait() {
                Ok(outcome) => self.record(outcome)?,
                Err(h) => *pending = Some(h),
            }
        }
        Ok(pending.is_none())
    }

    /// Wait for the save: its info, or its error raised.
    fn result(&self, py: Python<'_>) -> PyResult<results::CommitInfo> {
        let handle = lock(&self.pending)?.take();
        if let Some(h) = handle {
            let outcome = py.detach(move || h.wait());
            self.record(outcome)?;
        }
        match lock(&self.outcome)?.as_ref() {
            Some(Ok(info)) => Ok(info.into()),
            Some(Err(e)) => Err(e.clone_ref(py)),
            None => Err(CkptError::new_err("the save has no outcome")),
        }
    }
}
