//! Bytes between numpy and the store without copies: a save borrows each
//! array's memory through its `__array_interface__`; a load hands numpy a
//! [`Buffer`] that owns the bytes the store read, which the array views.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// The bytes of a C-contiguous array, borrowed for as long as `array` is.
///
/// The array must not be resized or freed while the slice lives (holding
/// `array` guarantees that) nor written to by another thread while the
/// store reads it (the Python layer documents that; `save_async` copies).
pub(crate) fn borrow_bytes<'a>(array: &'a Bound<'_, PyAny>) -> PyResult<&'a [u8]> {
    let (address, len, _read_only) = contiguous_memory(array)?;
    if len == 0 {
        return Ok(&[]);
    }
    // SAFETY: numpy's array interface says `len` bytes lie at `address`
    // (contiguous: no strides); `array` keeps them alive for 'a, and the
    // returned slice's lifetime is tied to that borrow of `array`.
    #[allow(unsafe_code)]
    let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, len) };
    Ok(bytes)
}

/// Writable views of `arrays` (each writable and C-contiguous), to be
/// filled in place; refused if any two overlap, so no two slices alias.
///
/// The memory is numpy's, not the `Bound`'s: a shared borrow of the array
/// object yields a mutable view of its elements, as numpy itself does.
/// Another thread writing the same arrays meanwhile is a data race; the
/// Python API documents that the arrays must be left alone during a load.
#[allow(clippy::mut_from_ref)]
pub(crate) fn borrow_disjoint_mut<'a>(
    arrays: &[&'a Bound<'_, PyAny>],
) -> PyResult<Vec<&'a mut [u8]>> {
    let mut spans = Vec::with_capacity(arrays.len());
    for array in arrays {
        let (address, len, read_only) = contiguous_memory(array)?;
        if read_only {
            return Err(PyValueError::new_err("an array to load into is read-only"));
        }
        spans.push((address, len));
    }
    let mut sorted: Vec<(usize, usize)> = spans.iter().copied().filter(|s| s.1 > 0).collect();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[1].0 < w[0].0 + w[0].1) {
        return Err(PyValueError::new_err(
            "two of the arrays to load into share memory",
        ));
    }
    let views = spans
        .into_iter()
        .map(|(address, len)| -> &'a mut [u8] {
            if len == 0 {
                return &mut [];
            }
            // SAFETY: numpy's array interface says `len` writable bytes lie
            // at `address` (contiguous, not read-only); the arrays, borrowed
            // for 'a, keep them alive; no two spans overlap (checked above),
            // so the slices do not alias one another.
            #[allow(unsafe_code)]
            unsafe {
                std::slice::from_raw_parts_mut(address as *mut u8, len)
            }
        })
        .collect();
    Ok(views)
}

/// (address, length in bytes, read-only) of a C-contiguous array, from its
/// `__array_interface__`.
fn contiguous_memory(array: &Bound<'_, PyAny>) -> PyResult<(usize, usize, bool)> {
    let iface = array
        .getattr("__array_interface__")
        .map_err(|_| PyTypeError::new_err("expected an array with __array_interface__"))?;
    let iface = iface.cast::<PyDict>()?;
    let item = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        iface
            .get_item(key)?
            .ok_or_else(|| PyValueError::new_err(format!("__array_interface__ lacks {key:?}")))
    };
    if iface.get_item("strides")?.is_some_and(|s| !s.is_none()) {
        return Err(PyValueError::new_err("the array is not C-contiguous"));
    }
    if iface.get_item("mask")?.is_some_and(|m| !m.is_none()) {
        return Err(PyValueError::new_err("masked arrays are not supported"));
    }
    let shape: Vec<usize> = item("shape")?.extract()?;
    let typestr: String = item("typestr")?.extract()?;
    let itemsize: usize = typestr
        .get(2..)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| PyValueError::new_err(format!("unknown typestr {typestr:?}")))?;
    let len = shape
        .iter()
        .try_fold(itemsize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| PyValueError::new_err("the array is too large"))?;
    let data = item("data")?;
    let (address, read_only): (usize, bool) = data.extract()?;
    if len > 0 && address == 0 {
        return Err(PyValueError::new_err("the array has no data pointer"));
    }
    if address.checked_add(len).is_none() {
        return Err(PyValueError::new_err("the array's memory wraps around"));
    }
    Ok((address, len, read_only))
}

/// Bytes the store read, owned here and viewed by numpy arrays (whose
/// `base` this is) through the array interface: a load copies nothing more.
#[pyclass(frozen, module = "ckptstore._ckptstore", name = "Buffer")]
pub(crate) struct Buffer {
    /// Never read or borrowed after construction: numpy writes through
    /// `address` (loaded arrays are writable, as torch expects).
    data: Vec<u8>,
    address: usize,
}

impl Buffer {
    pub(crate) fn new(mut data: Vec<u8>) -> Self {
        let address = data.as_mut_ptr() as usize;
        Buffer { data, address }
    }
}

#[pymethods]
impl Buffer {
    /// The numpy array interface (version 3): 1-D, uint8, writable.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", PyTuple::new(py, [self.data.len()])?)?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.address, false))?;
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.data.len()
    }
}

/// The BLAKE3 hash (hex) of each array's bytes (C-contiguous arrays), on
/// up to as many threads as there are cores, the GIL released: how bytes
/// that crossed a process boundary are checked against what was sent.
#[pyfunction]
pub(crate) fn hash_arrays(py: Python<'_>, arrays: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    let slices = arrays
        .iter()
        .map(borrow_bytes)
        .collect::<PyResult<Vec<&[u8]>>>()?;
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    Ok(py.detach(|| {
        let mut out = vec![String::new(); slices.len()];
        let per = slices.len().div_ceil(threads.max(1)).max(1);
        std::thread::scope(|scope| {
            for (part, hashes) in slices.chunks(per).zip(out.chunks_mut(per)) {
                scope.spawn(move || {
                    for (bytes, hash) in part.iter().zip(hashes.iter_mut()) {
                        *hash = blake3::hash(bytes).to_hex().to_string();
                    }
                });
            }
        });
        out
    }))
}

/// The BLAKE3 hashes of an array's chunks, taken as it was copied
/// (`copy_hashed`): given with the array to a save (`Tensor(..., hashes=)`),
/// they spare the save a second pass over its bytes. Pickled as its bytes,
/// to go with the array to another process.
#[pyclass(frozen, module = "ckptstore._ckptstore", name = "ChunkHashes")]
pub(crate) struct ChunkHashes(pub(crate) ckptstore::ChunkHashes);

#[pymethods]
impl ChunkHashes {
    /// The hashes of `nbytes` bytes from `to_bytes()`.
    #[staticmethod]
    fn from_bytes(nbytes: u64, hashes: &[u8]) -> PyResult<Self> {
        ckptstore::ChunkHashes::from_bytes(nbytes, hashes)
            .map(ChunkHashes)
            .map_err(crate::py_err)
    }

    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, pyo3::types::PyBytes> {
        pyo3::types::PyBytes::new(py, &self.0.to_bytes())
    }

    /// How many bytes were hashed.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.0.bytes()
    }

    /// Pickled as `from_bytes` and its arguments.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
        let py = slf.py();
        let this = slf.get();
        let rebuild = py.get_type::<ChunkHashes>().getattr("from_bytes")?;
        let args = (this.0.bytes(), this.to_bytes(py)).into_pyobject(py)?;
        Ok((rebuild.unbind(), args.into_any().unbind()))
    }

    fn __eq__(&self, other: &Self) -> bool {
        self.0 == other.0
    }

    fn __repr__(&self) -> String {
        format!("ChunkHashes(nbytes={})", self.0.bytes())
    }
}

/// Chunk hashes of `nbytes` bytes taken a piece at a time, in order, as
/// the pieces become ready (a device's copy landing): every piece but the
/// last `PIECE_ALIGN` bytes or a multiple.
#[pyclass(module = "ckptstore._ckptstore", name = "ChunkHasher")]
pub(crate) struct ChunkHasher(Option<ckptstore::ChunkHasher>);

#[pymethods]
impl ChunkHasher {
    #[classattr]
    const PIECE_ALIGN: usize = ckptstore::ChunkHasher::PIECE_ALIGN;

    #[new]
    fn new(nbytes: u64) -> Self {
        ChunkHasher(Some(ckptstore::ChunkHasher::new(nbytes)))
    }

    /// Hash the next piece (a C-contiguous array) on every core, the GIL
    /// released.
    fn update(&mut self, py: Python<'_>, piece: Bound<'_, PyAny>) -> PyResult<()> {
        let bytes = borrow_bytes(&piece)?;
        let hasher = self
            .0
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("the hasher is finished"))?;
        let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        py.detach(|| hasher.update(bytes, threads))
            .map_err(crate::py_err)
    }

    /// The hashes of the whole.
    fn finish(&mut self) -> PyResult<ChunkHashes> {
        let hasher = self
            .0
            .take()
            .ok_or_else(|| PyValueError::new_err("the hasher is finished"))?;
        hasher.finish().map(ChunkHashes).map_err(crate::py_err)
    }
}

/// Copy each of `sources` into the destination beside it (C-contiguous
/// arrays of the same number of bytes; the destinations writable and apart
/// from every other array given) on every core, the GIL released, hashing
/// each chunk of each destination in the same pass: the destinations'
/// hashes.
#[pyfunction]
pub(crate) fn copy_hashed(
    py: Python<'_>,
    sources: Vec<Bound<'_, PyAny>>,
    destinations: Vec<Bound<'_, PyAny>>,
) -> PyResult<Vec<ChunkHashes>> {
    if sources.len() != destinations.len() {
        return Err(PyValueError::new_err(format!(
            "copy_hashed: {} sources and {} destinations",
            sources.len(),
            destinations.len()
        )));
    }
    let sources = sources
        .iter()
        .map(borrow_bytes)
        .collect::<PyResult<Vec<&[u8]>>>()?;
    let dst_arrays: Vec<&Bound<'_, PyAny>> = destinations.iter().collect();
    let destinations = borrow_disjoint_mut(&dst_arrays)?;
    let spans = |v: &[&[u8]]| -> Vec<(usize, usize)> {
        v.iter().map(|s| (s.as_ptr() as usize, s.len())).collect()
    };
    let dst_spans: Vec<&[u8]> = destinations.iter().map(|d| &d[..]).collect();
    let (src, dst) = (spans(&sources), spans(&dst_spans));
    if src.iter().any(|&(a, n)| {
        dst.iter()
            .any(|&(b, m)| n > 0 && m > 0 && a < b + m && b < a + n)
    }) {
        return Err(PyValueError::new_err(
            "a destination of copy_hashed shares memory with a source",
        ));
    }
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let pairs: Vec<(&[u8], &mut [u8])> = sources.into_iter().zip(destinations).collect();
    let hashes = py
        .detach(|| ckptstore::ChunkHashes::copy_all(pairs, threads))
        .map_err(crate::py_err)?;
    Ok(hashes.into_iter().map(ChunkHashes).collect())
}
