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

/// Where the box at `offsets` of `lengths` lies in a stored chunk of sizes
/// `chunk` of `item`-byte elements: (first byte, bytes, the chunk's
/// strides in elements), or None if it is not inside (`ckptstore::BoxSpan`).
#[pyfunction]
pub(crate) fn dcp_box_span(
    chunk: Vec<u64>,
    offsets: Vec<u64>,
    lengths: Vec<u64>,
    item: u64,
) -> Option<(u64, u64, Vec<u64>)> {
    ckptstore::BoxSpan::of(&chunk, &offsets, &lengths, item).map(|s| (s.start, s.len, s.strides))
}
