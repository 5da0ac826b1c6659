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
    let (address, _read_only): (usize, bool) = data.extract()?;
    if len == 0 {
        return Ok(&[]);
    }
    if address == 0 {
        return Err(PyValueError::new_err("the array has no data pointer"));
    }
    // SAFETY: numpy's array interface says `len` bytes lie at `address`
    // (contiguous: no strides); `array` keeps them alive for 'a, and the
    // returned slice's lifetime is tied to that borrow of `array`.
    #[allow(unsafe_code)]
    let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, len) };
    Ok(bytes)
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
