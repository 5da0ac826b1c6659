//! A step's manifest: the value the `steps` table holds for each step.
//!
//! A manifest is the BLAKE3 hash of the bytes that follow it, then one of
//! two encodings, told apart by their first byte:
//!
//! - **format 2**: the byte [`BINARY`], then the binary encoding below;
//!   **format 3** ([`BINARY_TYPED`]) is the same followed by a section
//!   that types some blobs as tensors. Only steps with tensors use it, so
//!   an older build reads every other step. **Format 4**
//!   ([`BINARY_RECORDED`]) is format 3 followed by the step's save record;
//!   only steps with one use it. Steps of the formats before it keep
//!   0.4.0's record among their metrics, and are read as if it were a
//!   record (`SaveRecord::from_legacy_metrics`).
//! - **format 1** (ckptstore 0.1, read only): JSON, starting with `{`
//!   ([`super::manifest_v1`]).
//!
//! Format 2, after the version byte; `varint` is unsigned LEB128 (at most 10
//! bytes), `str` a varint length and UTF-8 bytes, `opt<T>` a byte 0 (none) or
//! 1 followed by a `T`, and every count a varint:
//!
//! ```text
//! step varint, timestamp varint, loss_cid opt<str>
//! metrics: count, then per metric: name str, value f64 (8 bytes, LE bits)
//! nodes:   count, then per node: key (byte 0: the node's id; byte 1: a str),
//!          id str, op str, input_cids (count, str...), output_cid opt<str>,
//!          gradient_cid opt<str>, metadata (count, (key str, value str)...)
//! edges:   count, then per edge two ends, each varint: 0 and a str, or
//!          1 + the index of the node (in the order above) whose key it is
//! blobs:   count, then per blob: name str, len varint, then byte 0 and
//!          chunks (count, then per chunk its 32-byte BLAKE3 hash and its id
//!          varint) or byte 1 and the offset in the step's packed bytes
//! packed:  opt<len varint, 32-byte BLAKE3 hash of the packed bytes>
//! typed (formats 3, 4): count, then per tensor: name str (a blob's name),
//!          dtype byte (its code, see `Dtype`), shape (count, varint...)
//! record (format 4 only): staging opt<staging seconds f64, blocked
//!          seconds f64>, names: count, then per name a str
//! ```
//!
//! Nothing may follow. Decoding trusts nothing: every count is checked
//! against the bytes left before anything is allocated, and every blob's
//! length against its chunks or the packed bytes.

use std::collections::{BTreeMap, HashMap};

use super::codec::{Reader, Writer, HASH_LEN};
use super::layout::CHUNK_SIZE;
use crate::step::StepRef;
use crate::{
    ComputationGraphStore, ComputationNode, Dtype, Error, Result, SaveRecord, Staging, Tensor,
};

pub(crate) use super::codec::{hex, Hash};
pub(crate) use super::step::{BlobRef, ChunkRef, ChunkUse, Manifest, PackedRef, Placement, Typed};

/// The first byte of a format 2 manifest (after its hash).
pub(crate) const BINARY: u8 = 2;
/// The first byte of a format 3 manifest: format 2 with typed tensors.
pub(crate) const BINARY_TYPED: u8 = 3;
/// The first byte of a format 4 manifest: format 3 with a save record.
pub(crate) const BINARY_RECORDED: u8 = 4;
/// The first byte of a format 1 (JSON) manifest.
pub(crate) const JSON: u8 = b'{';
/// First bytes a later format may use: a build that finds one of these says
/// the manifest is newer than it, not that it is damaged.
const FUTURE: std::ops::RangeInclusive<u8> = 5..=31;
/// Bytes before the body: the hash, then the version byte.
const HEADER_LEN: usize = HASH_LEN + 1;

/// Smallest encodings, to bound counts before allocating: a metric is a
/// name (1) and an f64 (8); a node at least eight one-byte fields; an edge
/// two one-byte ends; a blob a name, a length, a kind and one more byte; a
/// chunk its hash and a one-byte id.
const MIN_METRIC: usize = 1 + 8;
const MIN_NODE: usize = 8;
const MIN_EDGE: usize = 2;
const MIN_BLOB: usize = 4;
const MIN_CHUNK: usize = HASH_LEN + 1;
/// A typed entry: a name, a dtype and a shape count.
const MIN_TYPED: usize = 3;
/// A name of the save record: its length byte.
const MIN_NAME: usize = 1;

/// Blob kinds in the encoding.
const KIND_CHUNKS: u8 = 0;
const KIND_PACKED: u8 = 1;

/// A tensor's entry in the typed section: its name, dtype and shape.
pub(crate) type TypedRef<'a> = (&'a str, Dtype, &'a [u64]);

/// Encode the manifest of `ckpt` whose blobs are placed as `blobs` and of
/// which `typed` (in name order) are tensors (format 2, or 3 when there are
/// tensors; hash first). A format 1 blob is refused.
pub(crate) fn encode_manifest<'a>(
    ckpt: impl Into<StepRef<'a>>,
    typed: &[TypedRef<'_>],
    blobs: &BTreeMap<String, BlobRef>,
    packed: Option<&PackedRef>,
) -> Result<Vec<u8>> {
    let ckpt = ckpt.into();
    let graph = ckpt.graph();
    let (nodes, edges) = graph.parts();
    let mut w = Writer(Vec::with_capacity(
        64 + nodes.len() * 128 + blobs.len() * 80,
    ));
    w.0.resize(HASH_LEN, 0);
    let record = ckpt.save_record();
    w.u8(if !record.is_empty() {
        BINARY_RECORDED
    } else if !typed.is_empty() {
        BINARY_TYPED
    } else {
        BINARY
    });
    w.varint(ckpt.step());
    w.varint(ckpt.timestamp());
    w.opt_str(ckpt.loss_cid());
    w.len(ckpt.metrics().len());
    for (name, value) in ckpt.metrics() {
        w.str(name);
        w.f64(*value);
    }
    encode_graph(&mut w, nodes, edges);
    w.len(blobs.len());
    for (name, blob) in blobs {
        w.str(name);
        w.varint(blob.len);
        match &blob.at {
            Placement::Packed { offset } => {
                w.u8(KIND_PACKED);
                w.varint(*offset);
            }
            Placement::Chunks(chunks) => {
                w.u8(KIND_CHUNKS);
                w.len(chunks.len());
                for c in chunks {
                    w.hash(&c.hash);
                    w.varint(c.id);
                }
            }
            Placement::Format1Chunks(_) => {
                return Err(Error::corrupt(
                    Some(ckpt.step()),
                    format!("blob {name:?} is placed in format 1 chunks, which are never written"),
                ))
            }
        }
    }
    match packed {
        None => w.u8(0),
        Some(p) => {
            w.u8(1);
            w.varint(p.len);
            w.hash(&p.hash);
        }
    }
    if !typed.is_empty() || !record.is_empty() {
        w.len(typed.len());
        for &(name, dtype, shape) in typed {
            w.str(name);
            w.u8(dtype.code());
            w.len(shape.len());
            for &d in shape {
                w.varint(d);
            }
        }
    }
    if !record.is_empty() {
        encode_record(&mut w, record);
    }
    let mut bytes = w.0;
    let hash = blake3::hash(&bytes[HASH_LEN..]);
    bytes[..HASH_LEN].copy_from_slice(hash.as_bytes());
    Ok(bytes)
}

fn encode_record(w: &mut Writer, record: &SaveRecord) {
    match record.staging {
        None => w.u8(0),
        Some(s) => {
            w.u8(1);
            w.f64(s.staging_seconds);
            w.f64(s.blocked_seconds);
        }
    }
    w.len(record.names.len());
    for name in &record.names {
        w.str(name);
    }
}

fn decode_record(r: &mut Reader<'_>) -> Result<SaveRecord> {
    let mut record = SaveRecord::default();
    match r.u8("staging flag")? {
        0 => {}
        1 => {
            let staging = r.f64("staging seconds")?;
            let blocked = r.f64("blocked seconds")?;
            let s = Staging::new(staging, blocked).ok_or_else(|| r.fail("staging seconds"))?;
            record.staging = Some(s);
        }
        _ => return Err(r.fail("staging flag")),
    }
    for _ in 0..r.count("name count", MIN_NAME)? {
        if !record.names.insert(r.str("name")?) {
            return Err(r.fail("a repeated name"));
        }
    }
    if record.is_empty() {
        return Err(r.fail("an empty save record"));
    }
    Ok(record)
}

fn encode_graph(
    w: &mut Writer,
    nodes: &HashMap<String, ComputationNode>,
    edges: &[(String, String)],
) {
    w.len(nodes.len());
    let mut index: HashMap<&str, u64> = HashMap::with_capacity(nodes.len());
    for (i, (key, node)) in (1u64..).zip(nodes) {
        index.insert(key, i);
        if *key == node.id {
            w.u8(0);
        } else {
            w.u8(1);
            w.str(key);
        }
        w.str(&node.id);
        w.str(&node.op);
        w.len(node.input_cids.len());
        for cid in &node.input_cids {
            w.str(cid);
        }
        w.opt_str(node.output_cid.as_deref());
        w.opt_str(node.gradient_cid.as_deref());
        w.len(node.metadata.len());
        for (k, v) in &node.metadata {
            w.str(k);
            w.str(v);
        }
    }
    w.len(edges.len());
    for (from, to) in edges {
        for end in [from, to] {
            if let Some(&i) = index.get(end.as_str()) {
                w.varint(i);
            } else {
                w.varint(0);
                w.str(end);
            }
        }
    }
}

/// Decode and check a manifest read from the `steps` table under `step`.
///
/// Fails with [`Error::Corrupt`] on a hash mismatch, an undecodable body or
/// a manifest whose step is not its key, and with
/// [`Error::UnsupportedFormat`] for a manifest of a newer format.
pub(crate) fn decode_manifest(step: u64, bytes: &[u8]) -> Result<Manifest> {
    if bytes.len() < HEADER_LEN {
        return Err(Error::corrupt(
            Some(step),
            format!(
                "manifest is {} bytes, too short for its hash and version",
                bytes.len()
            ),
        ));
    }
    let (hash, body) = bytes.split_at(HASH_LEN);
    if blake3::hash(body).as_bytes() != hash {
        return Err(Error::corrupt(Some(step), "manifest hash mismatch"));
    }
    decode_body(step, body)
}

/// Decode a manifest body whose hash has been checked (or that is fuzzed).
pub(crate) fn decode_body(step: u64, body: &[u8]) -> Result<Manifest> {
    let manifest = match body.first() {
        Some(&(BINARY | BINARY_TYPED | BINARY_RECORDED)) => decode_binary(step, body)?,
        Some(&JSON) => super::manifest_v1::decode(step, body)?,
        Some(&v) if FUTURE.contains(&v) => {
            return Err(Error::UnsupportedFormat {
                what: format!("manifest of step {step}"),
                found: u32::from(v),
                supported: super::FORMAT_VERSION,
            })
        }
        _ => return Err(Error::corrupt(Some(step), "manifest of no known format")),
    };
    check(step, manifest)
}

/// A format 2 (binary) manifest, version byte first.
fn decode_binary(step: u64, body: &[u8]) -> Result<Manifest> {
    let mut r = Reader::new(body, 1, step);
    let stored_step = r.varint("step")?;
    let timestamp = r.varint("timestamp")?;
    let loss_cid = r.opt_str("loss CID")?;
    let mut metrics = BTreeMap::new();
    for _ in 0..r.count("metric count", MIN_METRIC)? {
        let name = r.str("metric name")?;
        metrics.insert(name, r.f64("metric value")?);
    }
    let graph = decode_graph(&mut r)?;
    let mut blobs = BTreeMap::new();
    for _ in 0..r.count("blob count", MIN_BLOB)? {
        let name = r.str("blob name")?;
        let blob = decode_blob(&mut r)?;
        if blobs.insert(name, blob).is_some() {
            return Err(r.fail("a repeated blob name"));
        }
    }
    let packed = match r.u8("packed flag")? {
        0 => None,
        1 => Some(PackedRef {
            len: r.varint("packed length")?,
            hash: r.hash("packed hash")?,
        }),
        _ => return Err(r.fail("packed flag")),
    };
    let version = body.first().copied();
    let typed = if version == Some(BINARY) {
        Typed::new()
    } else {
        decode_typed(&mut r)?
    };
    let save_record = if version == Some(BINARY_RECORDED) {
        decode_record(&mut r)?
    } else {
        SaveRecord::from_legacy_metrics(&mut metrics, |n| blobs.contains_key(n))
    };
    if !r.at_end() {
        return Err(r.fail("bytes after the end"));
    }
    Ok(Manifest {
        step: stored_step,
        timestamp,
        loss_cid,
        metrics,
        graph,
        blobs,
        packed,
        typed,
        save_record,
    })
}

fn decode_typed(r: &mut Reader<'_>) -> Result<Typed> {
    let mut typed = Typed::new();
    for _ in 0..r.count("tensor count", MIN_TYPED)? {
        let name = r.str("tensor name")?;
        let dtype =
            Dtype::from_code(r.u8("tensor dtype")?).ok_or_else(|| r.fail("tensor dtype"))?;
        let mut shape = Vec::new();
        for _ in 0..r.count("tensor rank", 1)? {
            shape.push(r.varint("tensor dimension")?);
        }
        if typed.insert(name, (dtype, shape)).is_some() {
            return Err(r.fail("a repeated tensor name"));
        }
    }
    Ok(typed)
}

fn decode_blob(r: &mut Reader<'_>) -> Result<BlobRef> {
    let len = r.varint("blob length")?;
    let at = match r.u8("blob kind")? {
        KIND_CHUNKS => {
            let n = r.count("chunk count", MIN_CHUNK)?;
            let mut chunks = Vec::with_capacity(n);
            for _ in 0..n {
                let hash = r.hash("chunk hash")?;
                chunks.push(ChunkRef {
                    hash,
                    id: r.varint("chunk id")?,
                });
            }
            Placement::Chunks(chunks)
        }
        KIND_PACKED => Placement::Packed {
            offset: r.varint("packed offset")?,
        },
        _ => return Err(r.fail("blob kind")),
    };
    Ok(BlobRef { len, at })
}

fn decode_graph(r: &mut Reader<'_>) -> Result<ComputationGraphStore> {
    let n = r.count("node count", MIN_NODE)?;
    let mut keys: Vec<String> = Vec::with_capacity(n);
    let mut nodes: HashMap<String, ComputationNode> = HashMap::with_capacity(n);
    for _ in 0..n {
        let key = match r.u8("node key kind")? {
            0 => None,
            1 => Some(r.str("node key")?),
            _ => return Err(r.fail("node key kind")),
        };
        let node = decode_node(r)?;
        let key = key.unwrap_or_else(|| node.id.clone());
        if nodes.insert(key.clone(), node).is_some() {
            return Err(r.fail("a repeated node key"));
        }
        keys.push(key);
    }
    let mut edges = Vec::with_capacity(r.count("edge count", MIN_EDGE)?);
    for _ in 0..edges.capacity() {
        let mut end = || -> Result<String> {
            match r.varint("edge end")? {
                0 => r.str("edge end"),
                i => usize::try_from(i - 1)
                    .ok()
                    .and_then(|i| keys.get(i))
                    .cloned()
                    .ok_or_else(|| r.fail("an edge to no node")),
            }
        };
        let from = end()?;
        edges.push((from, end()?));
    }
    Ok(ComputationGraphStore::from_parts(nodes, edges))
}

fn decode_node(r: &mut Reader<'_>) -> Result<ComputationNode> {
    let id = r.str("node id")?;
    let op = r.str("node op")?;
    let mut input_cids = Vec::new();
    for _ in 0..r.count("input count", 1)? {
        input_cids.push(r.str("input CID")?);
    }
    let output_cid = r.opt_str("output CID")?;
    let gradient_cid = r.opt_str("gradient CID")?;
    let mut metadata = HashMap::new();
    for _ in 0..r.count("metadata count", 2)? {
        let k = r.str("metadata key")?;
        metadata.insert(k, r.str("metadata value")?);
    }
    Ok(ComputationNode {
        id,
        op,
        input_cids,
        output_cid,
        gradient_cid,
        metadata,
    })
}

/// Checks every decoded manifest passes, whatever its format: it is the
/// step it is stored as, and every blob lies within its chunks or the
/// step's packed bytes.
fn check(step: u64, manifest: Manifest) -> Result<Manifest> {
    if manifest.step != step {
        return Err(Error::corrupt(
            Some(step),
            format!(
                "manifest names step {} but is stored as {step}",
                manifest.step
            ),
        ));
    }
    for (name, (dtype, shape)) in &manifest.typed {
        let want = Tensor::expected_bytes(*dtype, shape)
            .map_err(|e| Error::corrupt(Some(step), format!("tensor {name:?}: {e}")))?;
        match manifest.blobs.get(name) {
            Some(b) if b.len == want => {}
            _ => {
                return Err(Error::corrupt(
                    Some(step),
                    format!("tensor {name:?} has no data of its {want} bytes"),
                ))
            }
        }
    }
    let packed_len = manifest.packed.as_ref().map_or(0, |p| p.len);
    for (name, blob) in &manifest.blobs {
        let chunks = match &blob.at {
            Placement::Packed { offset } => {
                if offset
                    .checked_add(blob.len)
                    .is_none_or(|end| end > packed_len)
                {
                    return Err(Error::corrupt(
                        Some(step),
                        format!("blob {name:?} lies outside the step's {packed_len} packed bytes"),
                    ));
                }
                continue;
            }
            Placement::Chunks(c) => c.len(),
            Placement::Format1Chunks(h) => h.len(),
        };
        if blob.len > chunks as u64 * CHUNK_SIZE as u64 {
            return Err(Error::corrupt(
                Some(step),
                format!(
                    "blob {name:?} claims {} bytes but has only {chunks} chunks",
                    blob.len
                ),
            ));
        }
    }
    Ok(manifest)
}

#[cfg(test)]
mod tests;
