//! A global step opened for reading parts of its entries (what
//! `ckptstore.dcp` loads through).

use std::collections::BTreeMap;

use ckptstore::GlobalStep;
use pyo3::prelude::*;

/// A complete step's shards, their manifests checked; entries are read
/// through `RawRemote.read_pieces`.
#[pyclass(frozen, module = "ckptstore._ckptstore", name = "RawGlobalStep")]
pub(crate) struct RawGlobalStep {
    pub(crate) inner: GlobalStep,
}

/// An entry: (dtype name or None, shape or None, length in bytes).
type Entry = (Option<String>, Option<Vec<u64>>, u64);

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

    /// Rank `rank`'s entries by name.
    fn entries(&self, rank: u32) -> BTreeMap<String, Entry> {
        self.inner
            .entries(rank)
            .into_iter()
            .map(|(name, e)| {
                let (dtype, shape) = e.tensor.map_or((None, None), |(d, s)| (Some(d), Some(s)));
                (name, (dtype, shape, e.len))
            })
            .collect()
    }
}
