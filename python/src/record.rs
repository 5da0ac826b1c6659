//! `SaveRecord`: how a step was saved (a staged save's cost, the names a
//! framework saved it under), read from a step's info and given to a save.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// How a step was saved: a typed attribute of the step, apart from its
/// metrics. `staging_seconds` and `blocked_seconds` are both given (a
/// staged save's cost) or both None; `names` are the names a framework
/// saved the step under (`lightning:<path>`).
#[pyclass(frozen, eq, module = "ckptstore")]
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct SaveRecord(pub(crate) ckptstore::SaveRecord);

#[pymethods]
impl SaveRecord {
    #[new]
    #[pyo3(signature = (*, staging_seconds = None, blocked_seconds = None, names = Vec::new()))]
    fn new(
        staging_seconds: Option<f64>,
        blocked_seconds: Option<f64>,
        names: Vec<String>,
    ) -> PyResult<Self> {
        let mut record = ckptstore::SaveRecord::default();
        match (staging_seconds, blocked_seconds) {
            (None, None) => {}
            (Some(s), Some(b)) => {
                let staging = ckptstore::Staging::new(s, b).ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "staging_seconds={s} and blocked_seconds={b}: each must be finite \
                         and not negative"
                    ))
                })?;
                record = record.with_staging(staging);
            }
            _ => {
                return Err(PyValueError::new_err(
                    "staging_seconds and blocked_seconds are given together or not at all",
                ))
            }
        }
        for name in names {
            record = record.with_name(name);
        }
        Ok(SaveRecord(record))
    }

    /// Seconds a staged save spent copying the state; None for another.
    #[getter]
    fn staging_seconds(&self) -> Option<f64> {
        self.0.staging.map(|s| s.staging_seconds)
    }

    /// Seconds a staged save blocked the training loop; None for another.
    #[getter]
    fn blocked_seconds(&self) -> Option<f64> {
        self.0.staging.map(|s| s.blocked_seconds)
    }

    /// The names a framework saved the step under, sorted.
    #[getter]
    fn names(&self) -> Vec<String> {
        self.0.names.iter().cloned().collect()
    }

    /// Whether it records anything.
    fn __bool__(&self) -> bool {
        !self.0.is_empty()
    }

    fn __repr__(&self) -> String {
        format!(
            "SaveRecord(staging_seconds={:?}, blocked_seconds={:?}, names={:?})",
            self.staging_seconds(),
            self.blocked_seconds(),
            self.names()
        )
    }
}

/// The core's record of an optional one given from Python.
pub(crate) fn of(record: Option<&SaveRecord>) -> ckptstore::SaveRecord {
    record.map(|r| r.0.clone()).unwrap_or_default()
}
