//! What a read of parts of entries names, and where those bytes lie, as
//! classes: a `Piece` of a rank's shard in a bucket, a `Range` of an
//! entry in a store, a `ChunkSlice` of a chunk. No tuple carries them
//! across the binding.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Bytes `offset..offset + length` of entry `name` of rank `rank`'s
/// shard of a global step.
#[pyclass(frozen, eq, hash, get_all, module = "ckptstore")]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Piece {
    rank: u32,
    name: String,
    offset: u64,
    length: u64,
}

#[pymethods]
impl Piece {
    #[new]
    fn new(rank: u32, name: String, offset: u64, length: u64) -> Self {
        Piece {
            rank,
            name,
            offset,
            length,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Piece(rank={}, name={:?}, offset={}, length={})",
            self.rank, self.name, self.offset, self.length
        )
    }
}

impl Piece {
    /// As the crate takes it.
    pub(crate) fn as_crate(&self) -> ckptstore::Piece<'_> {
        (self.rank, &self.name, self.offset, self.length)
    }
}

/// Bytes `offset..offset + length` of entry `name` of a step in a store.
#[pyclass(frozen, eq, hash, get_all, module = "ckptstore")]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Range {
    name: String,
    offset: u64,
    length: u64,
}

#[pymethods]
impl Range {
    #[new]
    fn new(name: String, offset: u64, length: u64) -> Self {
        Range {
            name,
            offset,
            length,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Range(name={:?}, offset={}, length={})",
            self.name, self.offset, self.length
        )
    }
}

impl Range {
    /// As the crate takes it: (name, offset, length).
    pub(crate) fn as_crate(&self) -> (&str, u64, u64) {
        (&self.name, self.offset, self.length)
    }

    /// Where the bytes start.
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// The entry's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

/// Where bytes of a range lie in one chunk: the chunk's BLAKE3 hash and
/// length, and the bytes `a..b` of it (`ckptstore::ChunkSlice`).
#[pyclass(frozen, eq, module = "ckptstore")]
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChunkSlice(pub(crate) ckptstore::ChunkSlice);

#[pymethods]
impl ChunkSlice {
    #[getter]
    fn hash<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.0.hash)
    }
    #[getter]
    fn len(&self) -> u64 {
        self.0.len
    }
    #[getter]
    fn a(&self) -> u64 {
        self.0.a
    }
    #[getter]
    fn b(&self) -> u64 {
        self.0.b
    }

    fn __repr__(&self) -> String {
        format!(
            "ChunkSlice(len={}, a={}, b={})",
            self.0.len, self.0.a, self.0.b
        )
    }
}

/// Each range's slices, as Python takes them.
pub(crate) fn for_python(ranges: Vec<Vec<ckptstore::ChunkSlice>>) -> Vec<Vec<ChunkSlice>> {
    ranges
        .into_iter()
        .map(|slices| slices.into_iter().map(ChunkSlice).collect())
        .collect()
}

/// Register the classes.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Piece>()?;
    m.add_class::<Range>()?;
    m.add_class::<ChunkSlice>()?;
    Ok(())
}
