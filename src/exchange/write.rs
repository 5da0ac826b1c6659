//! Export of a step as a safetensors file, one tensor in memory at a time.
//!
//! The `safetensors` crate's writer takes each tensor's bytes through an
//! infallible `View::data()`, which would force reading every tensor from
//! the store before writing (or panicking on a read error); so the file is
//! written here: the header (built with `serde_json`), then each tensor's
//! bytes, read from the store just before they are written.

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::{json, Map, Value};

use super::{
    HEADER_ALIGN, KEY_BLOBS, KEY_GRAPH, KEY_LOSS_CID, KEY_METRICS, KEY_SAVE_RECORD, KEY_STEP,
    KEY_TIMESTAMP, METADATA,
};
use crate::engine::StepData;
use crate::{Dtype, Error, GradientCheckpoint, Result, StepInfo};

/// A tensor of a safetensors file to write: its name, dtype, shape and
/// length in bytes (`dtype x shape`, which the caller has checked).
pub(crate) struct Head {
    pub(crate) name: String,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<u64>,
    pub(crate) len: u64,
}

/// Write step `step` (its skeleton, its [`StepInfo`] and its data, all
/// from one read transaction, so that what is written is one version of
/// the step) to `path` as safetensors, durably.
pub(crate) fn write(
    step: u64,
    path: &Path,
    skeleton: &GradientCheckpoint,
    info: &StepInfo,
    data: &StepData<'_>,
) -> Result<()> {
    let mut entries: Vec<Head> = info
        .tensors
        .iter()
        .map(|(name, t)| Head {
            name: name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            len: t.bytes,
        })
        .chain(info.blobs.iter().map(|(name, &len)| Head {
            name: name.clone(),
            dtype: Dtype::U8,
            shape: vec![len],
            len,
        }))
        .collect();
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    if entries.iter().any(|e| e.name == METADATA) {
        return Err(Error::InvalidCheckpoint {
            step,
            reason: format!(
                "a blob or tensor named {METADATA:?} cannot be exported to safetensors"
            ),
        });
    }
    let mut metadata = BTreeMap::new();
    metadata.insert(KEY_STEP, step.to_string());
    metadata.insert(KEY_TIMESTAMP, skeleton.timestamp.to_string());
    if let Some(cid) = &skeleton.loss_cid {
        metadata.insert(KEY_LOSS_CID, cid.clone());
    }
    let json_err = |e: serde_json::Error| Error::Json {
        path: Some(path.to_owned()),
        source: Box::new(e),
    };
    metadata.insert(
        KEY_METRICS,
        serde_json::to_string(&skeleton.metrics).map_err(json_err)?,
    );
    metadata.insert(
        KEY_GRAPH,
        serde_json::to_string(&skeleton.graph).map_err(json_err)?,
    );
    if !skeleton.save_record.is_empty() {
        let record = serde_json::to_string(&skeleton.save_record).map_err(json_err)?;
        metadata.insert(KEY_SAVE_RECORD, record);
    }
    let blobs: Vec<&str> = info.blobs.keys().map(String::as_str).collect();
    metadata.insert(KEY_BLOBS, serde_json::to_string(&blobs).map_err(json_err)?);
    write_tensors(path, step, &metadata, &entries, &mut |e, bytes| {
        if data.read_into(&e.name, bytes)? {
            Ok(())
        } else {
            Err(Error::corrupt(
                Some(step),
                format!("its data has no {:?}", e.name),
            ))
        }
    })
}

/// Write a safetensors file of `heads` (in this order) and `metadata` to
/// `path`, durably, each tensor's bytes as `fill` puts them in a buffer of
/// its length (one buffer of the largest length, reused: its pages are
/// faulted in once). A failure of `fill` is returned as it is, and leaves
/// no file.
pub(crate) fn write_tensors(
    path: &Path,
    step: u64,
    metadata: &BTreeMap<&str, String>,
    heads: &[Head],
    fill: &mut dyn FnMut(&Head, &mut [u8]) -> Result<()>,
) -> Result<()> {
    let header = header(metadata, heads).map_err(|e| Error::Json {
        path: Some(path.to_owned()),
        source: Box::new(e),
    })?;
    let largest = heads.iter().map(|e| e.len).max().unwrap_or(0);
    let mut buffer = vec![
        0u8;
        usize::try_from(largest).map_err(|_| Error::InvalidCheckpoint {
            step,
            reason: format!("a tensor of {largest} bytes does not fit in memory"),
        })?
    ];
    // A failure to fill a tensor keeps its own kind, not the file's.
    let mut failed = None;
    let written = crate::file::write_durably_with(path, |file| {
        let mut out = BufWriter::new(file);
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        for e in heads {
            // `len` fits: it is at most `largest`.
            let bytes = &mut buffer[..usize::try_from(e.len).unwrap_or(usize::MAX)];
            if let Err(e) = fill(e, bytes) {
                failed = Some(e);
                return Err(std::io::Error::other("filling a tensor failed"));
            }
            out.write_all(bytes)?;
        }
        out.flush()
    });
    match failed {
        Some(e) => Err(e),
        None => written,
    }
}

/// A tensor to export: its name, dtype and shape as stored, and how to
/// read its bytes as stored.
pub(crate) struct Source<'a> {
    pub(crate) name: String,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<u64>,
    pub(crate) fill: Fill<'a>,
}

/// Puts a tensor's bytes, as stored, in a buffer of their length.
pub(crate) type Fill<'a> = Box<dyn FnMut(&mut [u8]) -> Result<()> + 'a>;

/// Write the whole tensors of a DCP step, `sources` (in this order), to
/// `path` as one safetensors file, one tensor in memory at a time; the
/// names written. Where a bucket's or a store's step is consolidated.
pub(crate) fn write_whole(
    path: &Path,
    step: u64,
    mut sources: Vec<Source<'_>>,
) -> Result<Vec<String>> {
    let heads = sources
        .iter()
        .map(|s| {
            let len = crate::Tensor::expected_bytes(s.dtype, &s.shape)
                .map_err(|e| Error::corrupt(Some(step), format!("{}: {e}", s.name)))?;
            Ok(Head {
                name: s.name.clone(),
                dtype: s.dtype,
                shape: s.shape.clone(),
                len,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut metadata = BTreeMap::new();
    metadata.insert("ckptstore.step", step.to_string());
    metadata.insert(
        "ckptstore.source",
        "torch.distributed.checkpoint".to_owned(),
    );
    let mut next = sources.iter_mut();
    write_tensors(path, step, &metadata, &heads, &mut |_, out| {
        let source = next.next().ok_or_else(|| {
            Error::corrupt(Some(step), "more tensors written than chosen".to_owned())
        })?;
        (source.fill)(out)
    })?;
    Ok(heads.into_iter().map(|h| h.name).collect())
}

/// The header: `__metadata__` and each tensor at consecutive offsets, in
/// the order given, padded with spaces to a multiple of 8 bytes.
fn header(metadata: &BTreeMap<&str, String>, entries: &[Head]) -> serde_json::Result<Vec<u8>> {
    let mut map = Map::new();
    map.insert(METADATA.to_owned(), serde_json::to_value(metadata)?);
    let mut at = 0u64;
    for e in entries {
        let value: Value = json!({
            "dtype": e.dtype.name(),
            "shape": e.shape,
            "data_offsets": [at, at + e.len],
        });
        map.insert(e.name.clone(), value);
        at += e.len;
    }
    let mut bytes = serde_json::to_vec(&Value::Object(map))?;
    let padded = bytes.len().div_ceil(HEADER_ALIGN) * HEADER_ALIGN;
    bytes.resize(padded, b' ');
    Ok(bytes)
}
