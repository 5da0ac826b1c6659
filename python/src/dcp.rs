//! The DCP metadata document `ckptstore.dcp` stores, and where a box a
//! load asks for lies in its stored chunk: both rules are the core's
//! (`ckptstore::DcpDocument`, `ckptstore::BoxSpan`); Python's `_dcp_json`
//! and `StorageReader` convert DCP's objects to and from these values.

use ckptstore::{DcpChunk, DcpDocument, DcpEntry, DcpPathPart, DcpWhere, DCP_FORMAT};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::py_err;

/// A value of the state: (dtype, itemsize, size, requires_grad, chunks as
/// (offsets, sizes)) for a tensor; None for a non-tensor value.
pub(crate) type Entry = Option<(
    String,
    Option<u64>,
    Vec<u64>,
    bool,
    Vec<(Vec<u64>, Vec<u64>)>,
)>;
/// Where a stored item is: (fqn, offset, index, rank, entry).
pub(crate) type Where = (String, Option<Vec<u64>>, Option<u64>, u32, String);
/// The document's values: (version, state dict, planner data, storage).
pub(crate) type Document = (
    Option<String>,
    Vec<(String, Entry)>,
    Option<Vec<(String, Vec<Part>)>>,
    Vec<Where>,
);

/// A key (str) or an index (int) of a planner's path.
#[derive(FromPyObject, IntoPyObject)]
pub(crate) enum Part {
    Index(i64),
    Key(String),
}

/// The JSON document of DCP's metadata given as plain values.
#[pyfunction]
pub(crate) fn dcp_metadata_encode<'py>(
    py: Python<'py>,
    version: Option<String>,
    state_dict: Vec<(String, Entry)>,
    planner_data: Option<Vec<(String, Vec<Part>)>>,
    storage: Vec<Where>,
) -> PyResult<Bound<'py, PyBytes>> {
    let doc = DcpDocument {
        format: DCP_FORMAT,
        version,
        state_dict: state_dict
            .into_iter()
            .map(|(fqn, e)| (fqn, entry_in(e)))
            .collect(),
        planner_data: planner_data.map(|p| {
            p.into_iter()
                .map(|(fqn, path)| (fqn, path.into_iter().map(part_in).collect()))
                .collect()
        }),
        storage: storage
            .into_iter()
            .map(|(fqn, offset, index, rank, entry)| DcpWhere {
                fqn,
                offset,
                index,
                rank,
                entry,
            })
            .collect(),
    };
    let bytes = doc.encode().map_err(py_err)?;
    Ok(PyBytes::new(py, &bytes))
}

/// The plain values of a JSON document of DCP's metadata; CorruptError
/// for bytes that are not one.
#[pyfunction]
pub(crate) fn dcp_metadata_decode(bytes: &[u8]) -> PyResult<Document> {
    let doc = DcpDocument::decode(None, bytes).map_err(py_err)?;
    let state_dict = doc
        .state_dict
        .into_iter()
        .map(|(fqn, e)| (fqn, entry_out(e)))
        .collect();
    let planner = doc.planner_data.map(|p| {
        p.into_iter()
            .map(|(fqn, path)| (fqn, path.into_iter().map(part_out).collect()))
            .collect()
    });
    let storage = doc
        .storage
        .into_iter()
        .map(|w| (w.fqn, w.offset, w.index, w.rank, w.entry))
        .collect();
    Ok((doc.version, state_dict, planner, storage))
}

fn entry_in(e: Entry) -> DcpEntry {
    match e {
        None => DcpEntry {
            bytes: true,
            ..DcpEntry::default()
        },
        Some((dtype, itemsize, size, requires_grad, chunks)) => DcpEntry {
            dtype: Some(dtype),
            itemsize,
            size,
            requires_grad,
            chunks: chunks
                .into_iter()
                .map(|(offsets, sizes)| DcpChunk { offsets, sizes })
                .collect(),
            bytes: false,
        },
    }
}

fn entry_out(e: DcpEntry) -> Entry {
    if e.bytes {
        return None;
    }
    let chunks = e.chunks.into_iter().map(|c| (c.offsets, c.sizes)).collect();
    Some((
        e.dtype.unwrap_or_default(),
        e.itemsize,
        e.size,
        e.requires_grad,
        chunks,
    ))
}

fn part_in(p: Part) -> DcpPathPart {
    match p {
        Part::Index(i) => DcpPathPart::Index(i),
        Part::Key(k) => DcpPathPart::Key(k),
    }
}

fn part_out(p: DcpPathPart) -> Part {
    match p {
        DcpPathPart::Index(i) => Part::Index(i),
        DcpPathPart::Key(k) => Part::Key(k),
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
