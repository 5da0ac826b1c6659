//! A step's manifest: the value the `steps` table holds for each step.
//!
//! A manifest is the 32-byte BLAKE3 hash of the bytes that follow it, then
//! one of two encodings, told apart by their first byte:
//!
//! - **format 2** (written since 0.2): the byte `2`, then a compact binary
//!   encoding (below). A 1,000-node graph encodes in a fifth of the time of
//!   its JSON and takes under half the bytes; a read decodes it 5x faster.
//! - **format 1** (ckptstore 0.1, read only): JSON, starting with `{`.
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
//! ```
//!
//! Nothing may follow. Decoding trusts nothing: every count is checked
//! against the bytes left before anything is allocated, and every blob's
//! length against its chunks or the packed bytes.

use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;

use super::schema::{BlobRef, ChunkId, PackedRef};
use crate::{ComputationGraphStore, ComputationNode, Error, GradientCheckpoint, Result};

/// The first byte of a format 2 manifest (after its hash).
const BINARY: u8 = 2;
/// The first byte of a format 1 (JSON) manifest.
const JSON: u8 = b'{';
/// First bytes a later format may use: a build that finds one of these says
/// the manifest is newer than it, not that it is damaged.
const FUTURE: std::ops::RangeInclusive<u8> = 3..=31;

/// A step's manifest as read.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct Manifest {
    pub(crate) step: u64,
    pub(crate) timestamp: u64,
    pub(crate) loss_cid: Option<String>,
    #[serde(default)]
    pub(crate) metrics: BTreeMap<String, f64>,
    pub(crate) graph: ComputationGraphStore,
    pub(crate) blobs: BTreeMap<String, BlobRef>,
    #[serde(default)]
    pub(crate) packed: Option<PackedRef>,
}

impl Manifest {
    /// The checkpoint this manifest describes, with empty blobs to be filled.
    pub(crate) fn into_parts(self) -> (GradientCheckpoint, BTreeMap<String, BlobRef>) {
        let ckpt = GradientCheckpoint {
            graph: self.graph,
            step: self.step,
            loss_cid: self.loss_cid,
            optimizer_state: Default::default(),
            timestamp: self.timestamp,
            metrics: self.metrics,
        };
        (ckpt, self.blobs)
    }

    /// Every chunk reference, once per use: its hash, and its id (`None`
    /// for a format 1 chunk, stored by hash).
    pub(crate) fn chunk_refs(&self) -> impl Iterator<Item = (&ChunkId, Option<u64>)> {
        self.blobs.values().flat_map(|b| {
            b.chunks
                .iter()
                .enumerate()
                .map(|(i, hash)| (hash, b.ids.as_ref().and_then(|ids| ids.get(i).copied())))
        })
    }
}

/// Encode the manifest of `ckpt` whose blobs are stored as `blobs` (format
/// 2, hash first).
pub(crate) fn encode_manifest(
    ckpt: &GradientCheckpoint,
    blobs: &BTreeMap<String, BlobRef>,
    packed: Option<&PackedRef>,
) -> Vec<u8> {
    let (nodes, edges) = ckpt.graph.parts();
    let mut w = Writer(Vec::with_capacity(
        64 + nodes.len() * 128 + blobs.len() * 80,
    ));
    w.0.resize(32, 0);
    w.0.push(BINARY);
    w.varint(ckpt.step);
    w.varint(ckpt.timestamp);
    w.opt_str(ckpt.loss_cid.as_deref());
    w.len(ckpt.metrics.len());
    for (name, value) in &ckpt.metrics {
        w.str(name);
        w.0.extend_from_slice(&value.to_bits().to_le_bytes());
    }

    w.len(nodes.len());
    let mut index: HashMap<&str, u64> = HashMap::with_capacity(nodes.len());
    for (i, (key, node)) in (1u64..).zip(nodes) {
        index.insert(key, i);
        if *key == node.id {
            w.0.push(0);
        } else {
            w.0.push(1);
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
            match index.get(end.as_str()) {
                Some(&i) => w.varint(i),
                None => {
                    w.varint(0);
                    w.str(end);
                }
            }
        }
    }

    w.len(blobs.len());
    for (name, blob) in blobs {
        w.str(name);
        w.varint(blob.len);
        match blob.packed {
            Some(offset) => {
                w.0.push(1);
                w.varint(offset);
            }
            None => {
                w.0.push(0);
                w.len(blob.chunks.len());
                let ids = blob.ids.as_deref().unwrap_or_default();
                for (i, hash) in blob.chunks.iter().enumerate() {
                    w.0.extend_from_slice(hash);
                    // Every blob put() encodes has an id per chunk.
                    w.varint(ids.get(i).copied().unwrap_or(u64::MAX));
                }
            }
        }
    }
    match packed {
        None => w.0.push(0),
        Some(p) => {
            w.0.push(1);
            w.varint(p.len);
            w.0.extend_from_slice(&p.hash);
        }
    }

    let mut bytes = w.0;
    let hash = blake3::hash(&bytes[32..]);
    bytes[..32].copy_from_slice(hash.as_bytes());
    bytes
}

/// Decode and check a manifest read from the `steps` table under `step`.
///
/// Fails with [`Error::Corrupt`] on a hash mismatch, an undecodable body or
/// a manifest whose step is not its key, and with
/// [`Error::UnsupportedFormat`] for a manifest of a newer format.
pub(crate) fn decode_manifest(step: u64, bytes: &[u8]) -> Result<Manifest> {
    if bytes.len() < 33 {
        return Err(Error::corrupt(
            Some(step),
            format!(
                "manifest is {} bytes, too short for its hash and version",
                bytes.len()
            ),
        ));
    }
    let (hash, body) = bytes.split_at(32);
    if blake3::hash(body).as_bytes() != hash {
        return Err(Error::corrupt(Some(step), "manifest hash mismatch"));
    }
    decode_body(step, body)
}

/// Decode a manifest body whose hash has been checked (or that is fuzzed).
pub(crate) fn decode_body(step: u64, body: &[u8]) -> Result<Manifest> {
    let manifest = match body.first() {
        Some(&BINARY) => decode_binary(step, body)?,
        Some(&JSON) => decode_json(step, body)?,
        Some(&v) if FUTURE.contains(&v) => {
            return Err(Error::UnsupportedFormat {
                what: format!("manifest of step {step}"),
                found: u32::from(v),
                supported: super::schema::FORMAT_VERSION,
            })
        }
        _ => return Err(Error::corrupt(Some(step), "manifest of no known format")),
    };
    check(step, manifest)
}

/// A format 1 (JSON) manifest.
fn decode_json(step: u64, json: &[u8]) -> Result<Manifest> {
    #[derive(Deserialize)]
    struct Version {
        format: u32,
    }
    let version: Version = serde_json::from_slice(json)
        .map_err(|e| Error::corrupt(Some(step), format!("manifest does not decode: {e}")))?;
    if version.format != 1 {
        return Err(Error::UnsupportedFormat {
            what: format!("manifest of step {step}"),
            found: version.format,
            supported: super::schema::FORMAT_VERSION,
        });
    }
    serde_json::from_slice(json)
        .map_err(|e| Error::corrupt(Some(step), format!("manifest does not decode: {e}")))
}

/// A format 2 (binary) manifest, version byte first.
fn decode_binary(step: u64, body: &[u8]) -> Result<Manifest> {
    let mut r = Reader {
        bytes: body,
        at: 1,
        step,
    };
    let stored_step = r.varint("step")?;
    let timestamp = r.varint("timestamp")?;
    let loss_cid = r.opt_str("loss CID")?;
    let mut metrics = BTreeMap::new();
    for _ in 0..r.count("metric count", 9)? {
        let name = r.str("metric name")?;
        let bits = r.take(8, "metric value")?;
        let bits: [u8; 8] = bits.try_into().map_err(|_| r.fail("metric value"))?;
        metrics.insert(name, f64::from_bits(u64::from_le_bytes(bits)));
    }

    let n = r.count("node count", 8)?;
    let mut keys: Vec<String> = Vec::with_capacity(n);
    let mut nodes: HashMap<String, ComputationNode> = HashMap::with_capacity(n);
    for _ in 0..n {
        let key = match r.u8("node key kind")? {
            0 => None,
            1 => Some(r.str("node key")?),
            _ => return Err(r.fail("node key kind")),
        };
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
        let key = key.unwrap_or_else(|| id.clone());
        let node = ComputationNode {
            id,
            op,
            input_cids,
            output_cid,
            gradient_cid,
            metadata,
        };
        if nodes.insert(key.clone(), node).is_some() {
            return Err(r.fail("a repeated node key"));
        }
        keys.push(key);
    }
    let mut edges = Vec::with_capacity(r.count("edge count", 2)?);
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

    let mut blobs = BTreeMap::new();
    for _ in 0..r.count("blob count", 4)? {
        let name = r.str("blob name")?;
        let len = r.varint("blob length")?;
        let blob = match r.u8("blob kind")? {
            0 => {
                let n = r.count("chunk count", 33)?;
                let mut chunks = Vec::with_capacity(n);
                let mut ids = Vec::with_capacity(n);
                for _ in 0..n {
                    chunks.push(r.id("chunk hash")?);
                    ids.push(r.varint("chunk id")?);
                }
                BlobRef {
                    len,
                    chunks,
                    ids: Some(ids),
                    packed: None,
                }
            }
            1 => BlobRef {
                len,
                chunks: Vec::new(),
                ids: Some(Vec::new()),
                packed: Some(r.varint("packed offset")?),
            },
            _ => return Err(r.fail("blob kind")),
        };
        if blobs.insert(name, blob).is_some() {
            return Err(r.fail("a repeated blob name"));
        }
    }
    let packed = match r.u8("packed flag")? {
        0 => None,
        1 => Some(PackedRef {
            len: r.varint("packed length")?,
            hash: r.id("packed hash")?,
        }),
        _ => return Err(r.fail("packed flag")),
    };
    if r.at != body.len() {
        return Err(r.fail("bytes after the end"));
    }
    Ok(Manifest {
        step: stored_step,
        timestamp,
        loss_cid,
        metrics,
        graph: ComputationGraphStore::from_parts(nodes, edges),
        blobs,
        packed,
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
    let packed_len = manifest.packed.as_ref().map_or(0, |p| p.len);
    for (name, blob) in &manifest.blobs {
        if let Some(offset) = blob.packed {
            if !blob.chunks.is_empty()
                || offset
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
        let max = blob.chunks.len() as u64 * super::chunks::CHUNK_SIZE as u64;
        if blob.len > max {
            return Err(Error::corrupt(
                Some(step),
                format!(
                    "blob {name:?} claims {} bytes but has only {} chunks",
                    blob.len,
                    blob.chunks.len()
                ),
            ));
        }
    }
    Ok(manifest)
}

/// Appends the encoding's parts.
struct Writer(Vec<u8>);

impl Writer {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn len(&mut self, n: usize) {
        self.varint(n as u64);
    }

    fn str(&mut self, s: &str) {
        self.len(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }

    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            None => self.0.push(0),
            Some(s) => {
                self.0.push(1);
                self.str(s);
            }
        }
    }
}

/// Reads the encoding's parts, failing with [`Error::Corrupt`] that names
/// the step, the part and the byte offset.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    step: u64,
}

impl<'a> Reader<'a> {
    fn fail(&self, what: &str) -> Error {
        Error::corrupt(
            Some(self.step),
            format!("manifest: bad {what} at byte {}", self.at),
        )
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        let b = *self.bytes.get(self.at).ok_or_else(|| self.fail(what))?;
        self.at += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).ok_or_else(|| self.fail(what))?;
        let bytes = self
            .bytes
            .get(self.at..end)
            .ok_or_else(|| self.fail(what))?;
        self.at = end;
        Ok(bytes)
    }

    fn varint(&mut self, what: &str) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8(what)?;
            // The tenth byte may carry only the top bit of a u64.
            if shift == 63 && b > 1 {
                return Err(self.fail(what));
            }
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.fail(what))
    }

    /// A count of items each at least `min_bytes` long: never more than the
    /// bytes left could hold, so no allocation exceeds the input's size.
    fn count(&mut self, what: &str, min_bytes: usize) -> Result<usize> {
        let n = self.varint(what)?;
        let left = (self.bytes.len() - self.at) as u64;
        if n.saturating_mul(min_bytes as u64) > left {
            return Err(self.fail(what));
        }
        Ok(n as usize)
    }

    fn str(&mut self, what: &str) -> Result<String> {
        let n = self.count(what, 1)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.fail(what))
    }

    fn opt_str(&mut self, what: &str) -> Result<Option<String>> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => self.str(what).map(Some),
            _ => Err(self.fail(what)),
        }
    }

    fn id(&mut self, what: &str) -> Result<ChunkId> {
        let bytes = self.take(32, what)?;
        bytes.try_into().map_err(|_| self.fail(what))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (GradientCheckpoint, BTreeMap<String, BlobRef>, PackedRef) {
        let mut graph = ComputationGraphStore::new();
        let a = graph.add_node(ComputationNode::new("load", vec![]).with_meta("dtype", "f32"));
        graph.record_output(&a, "cid_x").expect("node exists");
        let b = graph.add_node(ComputationNode::new("relu", vec!["cid_x".into()]));
        graph.record_gradient(&b, "cid_g").expect("node exists");
        let mut ckpt = GradientCheckpoint::new(graph, 9).with_loss_cid("cid_loss");
        ckpt.metrics.insert("loss".into(), 1.0 / 11.0);
        ckpt.metrics.insert("acc".into(), -0.0);
        let mut blobs = BTreeMap::new();
        blobs.insert(
            "w".to_owned(),
            BlobRef {
                len: 3,
                chunks: vec![[7u8; 32], [8u8; 32]],
                ids: Some(vec![4, 300]),
                packed: None,
            },
        );
        blobs.insert(
            "tiny".to_owned(),
            BlobRef {
                len: 2,
                chunks: Vec::new(),
                ids: Some(Vec::new()),
                packed: Some(1),
            },
        );
        let packed = PackedRef {
            len: 3,
            hash: [9u8; 32],
        };
        (ckpt, blobs, packed)
    }

    /// A format 1 manifest, as ckptstore 0.1 wrote it.
    pub(super) fn encode_v1(
        ckpt: &GradientCheckpoint,
        blobs: &BTreeMap<String, BlobRef>,
        packed: Option<&PackedRef>,
    ) -> Vec<u8> {
        let mut json = serde_json::json!({
            "format": 1,
            "step": ckpt.step,
            "timestamp": ckpt.timestamp,
            "loss_cid": ckpt.loss_cid,
            "metrics": ckpt.metrics,
            "graph": ckpt.graph,
            "blobs": blobs,
        });
        if let Some(p) = packed {
            json["packed"] = serde_json::to_value(p).expect("encodes");
        }
        let body = serde_json::to_vec(&json).expect("encodes");
        let mut bytes = blake3::hash(&body).as_bytes().to_vec();
        bytes.extend_from_slice(&body);
        bytes
    }

    fn assert_same(m: &Manifest, ckpt: &GradientCheckpoint, blobs: &BTreeMap<String, BlobRef>) {
        assert_eq!(m.step, ckpt.step);
        assert_eq!(m.timestamp, ckpt.timestamp);
        assert_eq!(m.loss_cid, ckpt.loss_cid);
        assert_eq!(m.graph, ckpt.graph);
        assert_eq!(&m.blobs, blobs);
        assert_eq!(m.metrics.len(), ckpt.metrics.len());
        for (k, v) in &ckpt.metrics {
            assert_eq!(m.metrics[k].to_bits(), v.to_bits(), "metric {k}");
        }
    }

    #[test]
    fn both_formats_round_trip() -> Result<()> {
        let (ckpt, blobs, packed) = sample();
        // Format 1 blobs have no chunk ids: their chunks are found by hash.
        let mut v1_blobs = blobs.clone();
        v1_blobs.values_mut().for_each(|b| b.ids = None);
        for (bytes, blobs) in [
            (encode_manifest(&ckpt, &blobs, Some(&packed)), &blobs),
            (encode_v1(&ckpt, &blobs, Some(&packed)), &v1_blobs),
        ] {
            let m = decode_manifest(9, &bytes)?;
            assert_same(&m, &ckpt, blobs);
            assert_eq!(m.packed, Some(packed.clone()));
        }
        Ok(())
    }

    #[test]
    fn a_node_stored_under_another_key_and_dangling_edges_survive() -> Result<()> {
        let mut nodes = HashMap::new();
        let node = ComputationNode::new("matmul", vec!["cid_a".into()]);
        nodes.insert("not-its-id".to_owned(), node);
        let edges = vec![
            ("not-its-id".to_owned(), "gone".to_owned()),
            ("gone".to_owned(), "not-its-id".to_owned()),
        ];
        let graph = ComputationGraphStore::from_parts(nodes, edges);
        let ckpt = GradientCheckpoint::new(graph, 3);
        let m = decode_manifest(3, &encode_manifest(&ckpt, &BTreeMap::new(), None))?;
        assert_eq!(m.graph, ckpt.graph);
        Ok(())
    }

    #[test]
    fn damage_is_detected() {
        let (ckpt, blobs, packed) = sample();
        let bytes = encode_manifest(&ckpt, &blobs, Some(&packed));
        let mut damaged = bytes.clone();
        let last = damaged.len() - 2;
        damaged[last] ^= 1;
        assert!(matches!(
            decode_manifest(9, &damaged),
            Err(Error::Corrupt { step: Some(9), .. })
        ));
        assert!(matches!(
            decode_manifest(10, &bytes),
            Err(Error::Corrupt { step: Some(10), .. })
        ));
        for cut in [0, 5, 32, 33, bytes.len() - 1] {
            assert!(decode_manifest(9, &bytes[..cut]).is_err(), "cut at {cut}");
            assert!(
                decode_body(9, &bytes[32..cut.max(32)]).is_err(),
                "cut at {cut}"
            );
        }
        let mut longer = bytes[32..].to_vec();
        longer.push(0);
        assert!(matches!(
            decode_body(9, &longer),
            Err(Error::Corrupt { step: Some(9), .. })
        ));
    }

    #[test]
    fn blob_longer_than_its_chunks_is_rejected() {
        let json = br#"{"format":1,"step":1,"timestamp":0,"loss_cid":null,
            "graph":{"nodes":{},"edges":[]},
            "blobs":{"w":{"len":18446744073709551615,"chunks":[]}}}"#;
        assert!(matches!(decode_body(1, json), Err(Error::Corrupt { .. })));
        let mut blobs = BTreeMap::new();
        blobs.insert(
            "w".to_owned(),
            BlobRef {
                len: u64::MAX,
                chunks: vec![[1u8; 32]],
                ids: Some(vec![0]),
                packed: None,
            },
        );
        let ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
        let bytes = encode_manifest(&ckpt, &blobs, None);
        let e = decode_manifest(1, &bytes).expect_err("too long");
        assert!(e.to_string().contains("claims"), "{e}");
    }

    #[test]
    fn newer_manifest_formats_are_refused() {
        for body in [&br#"{"format":99,"step":1}"#[..], &[3u8, 1, 0][..]] {
            assert!(matches!(
                decode_body(1, body),
                Err(Error::UnsupportedFormat { .. })
            ));
        }
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    fn valid_body() -> Vec<u8> {
        let mut graph = ComputationGraphStore::new();
        let a = graph.add_node(ComputationNode::new("load", vec![]));
        graph.record_output(&a, "cid_x").expect("node exists");
        graph.add_node(ComputationNode::new("relu", vec!["cid_x".into()]));
        let mut ckpt = GradientCheckpoint::new(graph, 5);
        ckpt.metrics.insert("loss".into(), 0.5);
        let mut blobs = BTreeMap::new();
        blobs.insert(
            "w".to_owned(),
            BlobRef {
                len: 10,
                chunks: vec![[1u8; 32]],
                ids: Some(vec![0]),
                packed: None,
            },
        );
        blobs.insert(
            "b".to_owned(),
            BlobRef {
                len: 2,
                chunks: Vec::new(),
                ids: Some(Vec::new()),
                packed: Some(0),
            },
        );
        let packed = PackedRef {
            len: 2,
            hash: [2u8; 32],
        };
        encode_manifest(&ckpt, &blobs, Some(&packed))[32..].to_vec()
    }

    fn assert_consistent(m: &Manifest) -> std::result::Result<(), TestCaseError> {
        prop_assert_eq!(m.step, 5);
        let packed = m.packed.as_ref().map_or(0, |p| p.len);
        for blob in m.blobs.values() {
            match blob.packed {
                Some(at) => prop_assert!(at + blob.len <= packed),
                None => prop_assert!(
                    blob.len <= blob.chunks.len() as u64 * crate::store::chunks::CHUNK_SIZE as u64
                ),
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            if std::env::var_os("CKPT_LONG").is_some() { 50_000 } else { 2_000 }
        ))]

        /// Arbitrary bytes never panic the decoder, in either format.
        #[test]
        fn arbitrary_bytes_do_not_panic(
            kind in prop::sample::select(vec![None, Some(BINARY), Some(JSON)]),
            bytes in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            let mut body = bytes;
            if let Some(k) = kind {
                body.insert(0, k);
            }
            let _ = decode_manifest(5, &body);
            if let Ok(m) = decode_body(5, &body) {
                assert_consistent(&m)?;
            }
        }

        /// Mutations of a valid manifest (hash bypassed) decode to a
        /// consistent manifest or fail; with the hash in place any change
        /// is caught.
        #[test]
        fn mutated_manifests_decode_consistently_or_fail(
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)
        ) {
            let valid = valid_body();
            let mut body = valid.clone();
            for (at, byte) in edits {
                let i = at.index(body.len());
                body[i] = byte;
            }
            if let Ok(m) = decode_body(5, &body) {
                assert_consistent(&m)?;
            }
            if body != valid {
                let mut hashed = blake3::hash(&valid).as_bytes().to_vec();
                hashed.extend_from_slice(&body);
                prop_assert!(decode_manifest(5, &hashed).is_err());
            }
        }
    }
}
