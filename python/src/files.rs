//! The crate's durable file writes, for the Python layer's own files (the
//! markers `ckptstore.lightning` leaves where Lightning expects a
//! checkpoint file): no durable write is spelled again in Python.

use std::path::PathBuf;

use pyo3::prelude::*;

use crate::py_err;

/// Write `data` at `path` whole or not at all, durably
/// (`ckptstore::write_durably`: a temporary file `.NAME.tmpPID-UUID`
/// beside it, fsynced, renamed, the directory fsynced).
#[pyfunction]
pub(crate) fn write_durably(py: Python<'_>, path: PathBuf, data: &[u8]) -> PyResult<()> {
    py.detach(|| ckptstore::write_durably(&path, data))
        .map_err(py_err)
}

/// Remove `path` if it is there, and fsync its directory.
#[pyfunction]
pub(crate) fn remove_durably(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    py.detach(|| ckptstore::remove_durably(&path))
        .map_err(py_err)
}
