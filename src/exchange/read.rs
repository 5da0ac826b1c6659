//! Import of a safetensors file: the header is parsed and validated with
//! the `safetensors` crate (offsets contiguous, no overlap or gap, sizes
//! matching dtype x shape, known dtypes), after checks of our own that
//! bound every length by the file before anything is allocated, and refuse
//! duplicate names (which a JSON map would silently merge).

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::io::Read;
use std::path::Path;

use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};

use super::{
    KEY_BLOBS, KEY_GRAPH, KEY_LOSS_CID, KEY_METRICS, KEY_SAVE_RECORD, KEY_TIMESTAMP, LEN_PREFIX,
    MAX_HEADER, METADATA,
};
use crate::checkpoint::Incoming;
use crate::{ComputationGraphStore, Dtype, Error, GradientCheckpoint, Result};

/// A checked header: the step's metadata, and each blob or tensor in the
/// order its bytes follow.
pub(crate) struct Header {
    pub(crate) skeleton: GradientCheckpoint,
    pub(crate) entries: Vec<Incoming>,
}

/// An open file, positioned at its data.
pub(crate) struct Source {
    pub(crate) header: Header,
    pub(crate) input: std::io::BufReader<std::fs::File>,
}

/// Open the safetensors file at `path` as step `step` and check its header.
pub(crate) fn open(path: &Path, step: u64) -> Result<Source> {
    let (mut input, len) = open_file(path)?;
    let header = read_header(&mut input, len, step).map_err(|e| in_file(path, e))?;
    Ok(Source { header, input })
}

/// The file at `path`, buffered, and its length.
fn open_file(path: &Path) -> Result<(std::io::BufReader<std::fs::File>, u64)> {
    let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let len = file
        .metadata()
        .map_err(|e| Error::io("read", path, e))?
        .len();
    Ok((std::io::BufReader::new(file), len))
}

/// Read the next entry's bytes.
pub(crate) fn read_entry(
    input: &mut impl Read,
    entry: &Incoming,
) -> std::result::Result<Vec<u8>, Parse> {
    // The length was checked against the file's when the header was read.
    let len = usize::try_from(entry.len).map_err(|_| bad("a tensor too large to load"))?;
    let mut data = vec![0u8; len];
    input.read_exact(&mut data)?;
    Ok(data)
}

impl GradientCheckpoint {
    /// Read a safetensors file as step `step`: its tensors, and for a file
    /// [`CheckpointStore::export_safetensors`](crate::CheckpointStore::export_safetensors)
    /// wrote, the rest of the step it came from (see there).
    ///
    /// # Errors
    /// [`Error::InvalidSafetensors`] naming the file and the problem.
    pub fn load_safetensors(path: &Path, step: u64) -> Result<Self> {
        let (mut input, len) = open_file(path)?;
        parse(&mut input, len, step).map_err(|e| in_file(path, e))
    }
}

/// A parse error as the crate's error, naming the file.
pub(crate) fn in_file(path: &Path, e: Parse) -> Error {
    match e {
        Parse::Bad(reason) => Error::InvalidSafetensors {
            path: path.to_owned(),
            reason,
        },
        Parse::Io(e) => Error::io("read", path, e),
    }
}

/// Why parsing failed.
#[derive(Debug)]
pub(crate) enum Parse {
    Bad(String),
    Io(std::io::Error),
}

impl From<std::io::Error> for Parse {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Parse::Bad("the file ends before its data does".into())
        } else {
            Parse::Io(e)
        }
    }
}

fn bad(reason: impl Into<String>) -> Parse {
    Parse::Bad(reason.into())
}

/// Parse a safetensors stream of `len` bytes into a checkpoint of `step`.
pub(crate) fn parse(
    input: &mut impl Read,
    len: u64,
    step: u64,
) -> std::result::Result<GradientCheckpoint, Parse> {
    let Header {
        mut skeleton,
        entries,
    } = read_header(input, len, step)?;
    for entry in &entries {
        let data = read_entry(input, entry)?;
        entry
            .place(&mut skeleton, data)
            .map_err(|e| bad(e.to_string()))?;
    }
    Ok(skeleton)
}

/// Read and check the header of a safetensors stream of `len` bytes.
fn read_header(input: &mut impl Read, len: u64, step: u64) -> std::result::Result<Header, Parse> {
    if len < LEN_PREFIX {
        return Err(bad(format!(
            "{len} bytes: too short for the 8-byte header length"
        )));
    }
    let mut prefix = [0u8; 8];
    input.read_exact(&mut prefix)?;
    let n = u64::from_le_bytes(prefix);
    if n > MAX_HEADER {
        return Err(bad(format!(
            "header of {n} bytes, more than the {MAX_HEADER} allowed"
        )));
    }
    if n > len - LEN_PREFIX {
        return Err(bad(format!("header of {n} bytes in a file of {len}")));
    }
    let mut header = vec![0u8; usize::try_from(n).map_err(|_| bad("header too long"))?];
    input.read_exact(&mut header)?;
    let header =
        std::str::from_utf8(&header).map_err(|e| bad(format!("header is not UTF-8: {e}")))?;
    check_unique_keys(header)?;
    let metadata: safetensors::tensor::Metadata =
        serde_json::from_str(header).map_err(|e| bad(format!("invalid header: {e}")))?;
    let data_len = metadata.data_len() as u64;
    if LEN_PREFIX + n + data_len != len {
        return Err(bad(format!(
            "the header describes {data_len} bytes of data, the file has {}",
            len - LEN_PREFIX - n
        )));
    }
    let skeleton = skeleton(metadata.metadata().as_ref(), step)?;
    let blob_names = blob_names(metadata.metadata().as_ref())?;
    let mut entries = Vec::new();
    // In offset order, so the file is read once, front to back.
    for name in metadata.offset_keys() {
        let info = metadata
            .info(&name)
            .ok_or_else(|| bad(format!("tensor {name:?} vanished")))?;
        let dtype = dtype_of(info.dtype)?;
        let (start, end) = info.data_offsets;
        let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
        let blob = blob_names.contains(&name) && dtype == Dtype::U8 && shape.len() == 1;
        entries.push(Incoming {
            name,
            len: (end - start) as u64,
            tensor: (!blob).then_some((dtype, shape)),
        });
    }
    Ok(Header { skeleton, entries })
}

/// The checkpoint's fields other than its data, from `__metadata__` (a
/// file of another writer has none: an empty graph, the current time).
fn skeleton(
    meta: Option<&std::collections::HashMap<String, String>>,
    step: u64,
) -> std::result::Result<GradientCheckpoint, Parse> {
    let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    let Some(meta) = meta else {
        return Ok(ckpt);
    };
    if let Some(t) = meta.get(KEY_TIMESTAMP) {
        ckpt.timestamp = t
            .parse()
            .map_err(|_| bad(format!("{KEY_TIMESTAMP} {t:?} is not a number")))?;
    }
    ckpt.loss_cid = meta.get(KEY_LOSS_CID).cloned();
    if let Some(m) = meta.get(KEY_METRICS) {
        ckpt.metrics = serde_json::from_str::<BTreeMap<String, f64>>(m)
            .map_err(|e| bad(format!("{KEY_METRICS}: {e}")))?;
    }
    if let Some(r) = meta.get(KEY_SAVE_RECORD) {
        ckpt.save_record =
            serde_json::from_str(r).map_err(|e| bad(format!("{KEY_SAVE_RECORD}: {e}")))?;
    }
    if let Some(g) = meta.get(KEY_GRAPH) {
        ckpt.graph = serde_json::from_str(g).map_err(|e| bad(format!("{KEY_GRAPH}: {e}")))?;
    }
    Ok(ckpt)
}

fn blob_names(
    meta: Option<&std::collections::HashMap<String, String>>,
) -> std::result::Result<HashSet<String>, Parse> {
    match meta.and_then(|m| m.get(KEY_BLOBS)) {
        None => Ok(HashSet::new()),
        Some(b) => serde_json::from_str(b).map_err(|e| bad(format!("{KEY_BLOBS}: {e}"))),
    }
}

fn dtype_of(d: safetensors::Dtype) -> std::result::Result<Dtype, Parse> {
    let name = format!("{d:?}");
    Dtype::from_name(&name).ok_or_else(|| bad(format!("dtype {name} is not supported")))
}

/// Refuse a header that names a key twice.
fn check_unique_keys(header: &str) -> std::result::Result<(), Parse> {
    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(
            self,
            mut map: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut seen = HashSet::new();
            while let Some(key) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                if !seen.insert(key.clone()) {
                    return Ok(Some(key));
                }
            }
            Ok(None)
        }
    }
    let mut de = serde_json::Deserializer::from_str(header);
    match de.deserialize_map(Keys) {
        Ok(Some(dup)) if dup == METADATA => Err(bad("__metadata__ is given twice")),
        Ok(Some(dup)) => Err(bad(format!("tensor {dup:?} is named twice"))),
        Ok(None) => Ok(()),
        Err(e) => Err(bad(format!("invalid header: {e}"))),
    }
}
