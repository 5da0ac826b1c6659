//! A global step opened for reading parts of its entries (what
//! `ckptstore.dcp` loads through).

use ckptstore::GlobalStep;
use pyo3::prelude::*;

/// A complete step opened on its commit's manifest; its shards' entries
/// are listed by `RawRemote.entries` and read by `RawRemote.read_pieces`.
#[pyclass(frozen, module = "ckptstore._ckptstore", name = "RawGlobalStep")]
pub(crate) struct RawGlobalStep {
    pub(crate) inner: GlobalStep,
}

#[pymethods]
impl RawGlobalStep {
    #[getter]
    fn step(&self) -> u64 {
        self.inner.step()
    }

    /// The commit it was opened from.
    #[getter]
    fn commit(&self) -> String {
        self.inner.commit().to_owned()
    }

    #[getter]
    fn world_size(&self) -> u32 {
        self.inner.world_size()
    }
}
