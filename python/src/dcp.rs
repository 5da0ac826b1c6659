//! The DCP metadata document `ckptstore.dcp` stores, and where a box a
//! load asks for lies in its stored chunk: both rules are the core's
//! (`ckptstore::DcpDocument`, `ckptstore::BoxSpan`); Python's `_document`
//! and `StorageReader` convert DCP's objects to and from these classes.

use std::collections::BTreeMap;

use ckptstore::{DcpDocument, DcpPathPart, DCP_FORMAT};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::py_err;

/// A stored box of a tensor: where it starts in the whole tensor, and
/// its sizes.
#[pyclass(frozen, eq, get_all, from_py_object, module = "ckptstore._ckptstore")]
#[derive(Clone, PartialEq)]
pub(crate) struct DcpChunk {
    offsets: Vec<u64>,
    sizes: Vec<u64>,
}

#[pymethods]
impl DcpChunk {
    #[new]
    fn new(offsets: Vec<u64>, sizes: Vec<u64>) -> Self {
        DcpChunk { offsets, sizes }
    }
}

/// A value of the state: a tensor (its dtype name, the element size of
/// a `torch.<name>` dtype, its shape, `requires_grad`, its stored boxes)
/// or, `bytes` true, a non-tensor value.
#[pyclass(frozen, eq, get_all, from_py_object, module = "ckptstore._ckptstore")]
#[derive(Clone, PartialEq)]
pub(crate) struct DcpEntry {
    dtype: Option<String>,
    itemsize: Option<u64>,
    size: Vec<u64>,
    requires_grad: bool,
    chunks: Vec<DcpChunk>,
    bytes: bool,
}

#[pymethods]
impl DcpEntry {
    /// A tensor: its dtype name (`itemsize`: the element size of a
    /// `torch.<name>` dtype), shape, `requires_grad` and stored boxes.
    #[staticmethod]
    fn tensor(
        dtype: String,
        itemsize: Option<u64>,
        size: Vec<u64>,
        requires_grad: bool,
        chunks: Vec<DcpChunk>,
    ) -> Self {
        let bytes = false;
        let dtype = Some(dtype);
        DcpEntry {
            dtype,
            itemsize,
            size,
            requires_grad,
            chunks,
            bytes,
        }
    }

    /// A non-tensor value (stored as bytes).
    #[staticmethod]
    fn non_tensor() -> Self {
        let (size, chunks) = (Vec::new(), Vec::new());
        DcpEntry {
            dtype: None,
            itemsize: None,
            size,
            requires_grad: false,
            chunks,
            bytes: true,
        }
    }
}

/// Where a stored item is: the item (fqn, box offset, DCP's index hint)
/// in rank `rank`'s entry `entry`.
#[pyclass(frozen, eq, get_all, from_py_object, module = "ckptstore._ckptstore")]
#[derive(Clone, PartialEq)]
pub(crate) struct DcpWhere {
    fqn: String,
    offset: Option<Vec<u64>>,
    index: Option<u64>,
    rank: u32,
    entry: String,
}

#[pymethods]
impl DcpWhere {
    #[new]
    fn new(
        fqn: String,
        offset: Option<Vec<u64>>,
        index: Option<u64>,
        rank: u32,
        entry: String,
    ) -> Self {
        DcpWhere {
            fqn,
            offset,
            index,
            rank,
            entry,
        }
    }
}

/// A key (str) or an index (int) of a planner's path.
#[derive(FromPyObject, IntoPyObject)]
enum Part {
    Index(i64),
    Key(String),
}

/// DCP's metadata as the JSON document `ckptstore.dcp` stores: DCP's
/// version, each value of the state by fqn, the default planners' data
/// (fqn -> the path of keys and indices in the nested state dict, in
/// order) and where each item is.
#[pyclass(frozen, module = "ckptstore._ckptstore", name = "DcpDocument")]
pub(crate) struct PyDcpDocument(DcpDocument);

#[pymethods]
impl PyDcpDocument {
    #[new]
    fn new(
        version: Option<String>,
        state_dict: BTreeMap<String, DcpEntry>,
        planner_data: Option<Bound<'_, PyDict>>,
        storage: Vec<DcpWhere>,
    ) -> PyResult<Self> {
        let planner_data = match planner_data {
            None => None,
            Some(d) => Some(
                d.iter()
                    .map(|(k, v)| {
                        let path: Vec<Part> = v.extract()?;
                        Ok((k.extract()?, path.into_iter().map(part_in).collect()))
                    })
                    .collect::<PyResult<_>>()?,
            ),
        };
        Ok(PyDcpDocument(DcpDocument {
            format: DCP_FORMAT,
            version,
            state_dict: state_dict
                .into_iter()
                .map(|(k, e)| (k, entry_in(e)))
                .collect(),
            planner_data,
            storage: storage.into_iter().map(where_in).collect(),
        }))
    }

    /// The document of these bytes; CorruptError for bytes that are not one.
    #[staticmethod]
    fn decode(bytes: &[u8]) -> PyResult<Self> {
        DcpDocument::decode(None, bytes)
            .map(PyDcpDocument)
            .map_err(py_err)
    }

    /// The document's bytes.
    fn encode<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.0.encode().map_err(py_err)?;
        Ok(PyBytes::new(py, &bytes))
    }

    #[getter]
    fn version(&self) -> Option<String> {
        self.0.version.clone()
    }

    #[getter]
    fn state_dict(&self) -> BTreeMap<String, DcpEntry> {
        let entries = self.0.state_dict.iter();
        entries.map(|(k, e)| (k.clone(), entry_out(e))).collect()
    }

    #[getter]
    fn planner_data<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(data) = &self.0.planner_data else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        for (fqn, path) in data {
            let parts: Vec<Part> = path.iter().map(part_out).collect();
            d.set_item(fqn, PyList::new(py, parts)?)?;
        }
        Ok(Some(d))
    }

    #[getter]
    fn storage(&self) -> Vec<DcpWhere> {
        self.0.storage.iter().map(where_out).collect()
    }
}

fn entry_in(e: DcpEntry) -> ckptstore::DcpEntry {
    let chunks = e.chunks.into_iter();
    ckptstore::DcpEntry {
        dtype: e.dtype,
        itemsize: e.itemsize,
        size: e.size,
        requires_grad: e.requires_grad,
        chunks: chunks
            .map(|c| ckptstore::DcpChunk {
                offsets: c.offsets,
                sizes: c.sizes,
            })
            .collect(),
        bytes: e.bytes,
    }
}

fn entry_out(e: &ckptstore::DcpEntry) -> DcpEntry {
    let chunks = e.chunks.iter();
    DcpEntry {
        dtype: e.dtype.clone(),
        itemsize: e.itemsize,
        size: e.size.clone(),
        requires_grad: e.requires_grad,
        chunks: chunks
            .map(|c| DcpChunk::new(c.offsets.clone(), c.sizes.clone()))
            .collect(),
        bytes: e.bytes,
    }
}

fn where_in(w: DcpWhere) -> ckptstore::DcpWhere {
    ckptstore::DcpWhere {
        fqn: w.fqn,
        offset: w.offset,
        index: w.index,
        rank: w.rank,
        entry: w.entry,
    }
}

fn where_out(w: &ckptstore::DcpWhere) -> DcpWhere {
    let w = w.clone();
    DcpWhere::new(w.fqn, w.offset, w.index, w.rank, w.entry)
}

fn part_in(p: Part) -> DcpPathPart {
    match p {
        Part::Index(i) => DcpPathPart::Index(i),
        Part::Key(k) => DcpPathPart::Key(k),
    }
}

fn part_out(p: &DcpPathPart) -> Part {
    match p {
        DcpPathPart::Index(i) => Part::Index(*i),
        DcpPathPart::Key(k) => Part::Key(k.clone()),
    }
}

/// Where a box lies in a stored chunk (`ckptstore::BoxSpan`): its first
/// byte from the chunk's start, its bytes, the chunk's strides in
/// elements.
#[pyclass(frozen, get_all, module = "ckptstore._ckptstore")]
pub(crate) struct BoxSpan {
    start: u64,
    len: u64,
    strides: Vec<u64>,
}

/// Where the box at `offsets` of `lengths` lies in a stored chunk of sizes
/// `chunk` of `item`-byte elements, or None if it is not inside.
#[pyfunction]
pub(crate) fn dcp_box_span(
    chunk: Vec<u64>,
    offsets: Vec<u64>,
    lengths: Vec<u64>,
    item: u64,
) -> Option<BoxSpan> {
    ckptstore::BoxSpan::of(&chunk, &offsets, &lengths, item).map(|s| BoxSpan {
        start: s.start,
        len: s.len,
        strides: s.strides,
    })
}

/// Register the classes and the function.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DcpChunk>()?;
    m.add_class::<DcpEntry>()?;
    m.add_class::<DcpWhere>()?;
    m.add_class::<PyDcpDocument>()?;
    m.add_class::<BoxSpan>()?;
    m.add_function(pyo3::wrap_pyfunction!(dcp_box_span, m)?)?;
    Ok(())
}
