//! Verified slices for Python: a rank handed bytes of a step by another
//! checks them against the chunk hashes of the bucket or store
//! (`ckptstore::SliceCheck`).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arrays::borrow_bytes;
use crate::pieces::{for_python, ChunkSlice, Range};

/// The length of the proof of bytes `a..b` of a chunk of `len` bytes.
#[pyfunction]
pub(crate) fn slice_proof_len(len: u64, a: u64, b: u64) -> PyResult<usize> {
    ckptstore::slice_proof_len(len, a, b).map_err(crate::py_err)
}

/// A check of bytes `a..b` of a chunk of `len` bytes and BLAKE3 hash
/// `hash`, given the slice's proof; fed the bytes in order.
#[pyclass(module = "ckptstore._ckptstore", name = "SliceCheck")]
pub(crate) struct SliceCheck(Option<ckptstore::SliceCheck>);

#[pymethods]
impl SliceCheck {
    #[new]
    fn new(hash: &[u8], len: u64, a: u64, b: u64, proof: Bound<'_, PyAny>) -> PyResult<Self> {
        let hash: [u8; 32] = hash
            .try_into()
            .map_err(|_| PyValueError::new_err("a chunk's hash is 32 bytes"))?;
        let proof = borrow_bytes(&proof)?;
        let check = ckptstore::SliceCheck::new(hash, len, a, b, proof).map_err(crate::py_err)?;
        Ok(SliceCheck(Some(check)))
    }

    /// Hash the next bytes of the slice (a C-contiguous array).
    fn update(&mut self, py: Python<'_>, piece: Bound<'_, PyAny>) -> PyResult<()> {
        let bytes = borrow_bytes(&piece)?;
        let check = self
            .0
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("the check is finished"))?;
        py.detach(|| check.update(bytes));
        Ok(())
    }

    /// Whether the bytes fed were the slice, hashing to the chunk's hash.
    fn finish(&mut self) -> PyResult<bool> {
        let check = self
            .0
            .take()
            .ok_or_else(|| PyValueError::new_err("the check is finished"))?;
        Ok(check.finish())
    }
}

/// Where the entries of one save of a step lie in its chunks, from the
/// bytes `Store.chunk_map` gave on another rank, checked against the
/// save's content digest (hex).
#[pyclass(module = "ckptstore._ckptstore", name = "ChunkMap", frozen)]
pub(crate) struct ChunkMap(ckptstore::ChunkMap);

#[pymethods]
impl ChunkMap {
    #[new]
    fn new(step: u64, sent: &[u8], digest: &str) -> PyResult<Self> {
        let digest = ckptstore::ContentDigest::from_hex(digest)
            .ok_or_else(|| PyValueError::new_err(format!("{digest:?} is not a content digest")))?;
        let map = ckptstore::ChunkMap::decode(step, sent, &digest).map_err(crate::py_err)?;
        Ok(ChunkMap(map))
    }

    /// The slices of each of `ranges`, in order.
    fn slices(&self, ranges: Vec<PyRef<'_, Range>>) -> PyResult<Vec<Vec<ChunkSlice>>> {
        let found = ranges
            .iter()
            .map(|r| {
                let (name, start, len) = r.as_crate();
                self.0.slices(name, start, len)
            })
            .collect::<ckptstore::Result<Vec<_>>>()
            .map_err(crate::py_err)?;
        Ok(for_python(found))
    }
}
