//! Format 1 manifests (ckptstore 0.1): JSON, decoded for reading only.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer};

use super::codec::Hash;
use super::step::{BlobRef, Manifest, PackedRef, Placement, Typed};
use crate::{ComputationGraphStore, Error, Result};

#[derive(Deserialize)]
struct Version {
    format: u32,
}

#[derive(Deserialize)]
struct V1Manifest {
    step: u64,
    timestamp: u64,
    loss_cid: Option<String>,
    #[serde(default)]
    metrics: BTreeMap<String, f64>,
    graph: ComputationGraphStore,
    blobs: BTreeMap<String, V1Blob>,
    #[serde(default)]
    packed: Option<V1Packed>,
}

#[derive(Deserialize)]
struct V1Blob {
    len: u64,
    #[serde(deserialize_with = "hex_hashes")]
    chunks: Vec<Hash>,
    #[serde(default)]
    packed: Option<u64>,
}

#[derive(Deserialize)]
struct V1Packed {
    len: u64,
    #[serde(deserialize_with = "hex_hash")]
    hash: Hash,
}

/// Decode a format 1 (JSON) manifest body.
pub(crate) fn decode(step: u64, json: &[u8]) -> Result<Manifest> {
    let bad =
        |e: serde_json::Error| Error::corrupt(Some(step), format!("manifest does not decode: {e}"));
    let version: Version = serde_json::from_slice(json).map_err(bad)?;
    if version.format != 1 {
        return Err(Error::UnsupportedFormat {
            what: format!("manifest of step {step}"),
            found: version.format,
            supported: super::FORMAT_VERSION,
        });
    }
    let m: V1Manifest = serde_json::from_slice(json).map_err(bad)?;
    let mut blobs = BTreeMap::new();
    for (name, b) in m.blobs {
        let at = match b.packed {
            Some(_) if !b.chunks.is_empty() => {
                return Err(Error::corrupt(
                    Some(step),
                    format!("blob {name:?} is both packed and chunked"),
                ))
            }
            Some(offset) => Placement::Packed { offset },
            None => Placement::Format1Chunks(b.chunks),
        };
        blobs.insert(name, BlobRef { len: b.len, at });
    }
    Ok(Manifest {
        step: m.step,
        timestamp: m.timestamp,
        loss_cid: m.loss_cid,
        metrics: m.metrics,
        graph: m.graph,
        blobs,
        packed: m.packed.map(|p| PackedRef {
            len: p.len,
            hash: p.hash,
        }),
        typed: Typed::new(),
        save_record: crate::SaveRecord::default(),
    })
}

/// A hash in format 1's JSON, read as format 1 always read it (either
/// case of hex digits), so that no store that opened before fails to now;
/// everything written since uses `crate::hex`'s one form.
fn parse_hex<E: serde::de::Error>(text: &str) -> std::result::Result<Hash, E> {
    blake3::Hash::from_hex(text.as_bytes())
        .map(|h| *h.as_bytes())
        .map_err(E::custom)
}

fn hex_hash<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Hash, D::Error> {
    let text = std::borrow::Cow::<'de, str>::deserialize(d)?;
    parse_hex(&text)
}

fn hex_hashes<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<Hash>, D::Error> {
    let texts: Vec<std::borrow::Cow<'de, str>> = Vec::deserialize(d)?;
    texts.iter().map(|t| parse_hex(t)).collect()
}

#[cfg(test)]
pub(crate) fn encode(manifest_json: &serde_json::Value) -> Vec<u8> {
    let body = serde_json::to_vec(manifest_json).expect("encodes");
    let mut bytes = blake3::hash(&body).as_bytes().to_vec();
    bytes.extend_from_slice(&body);
    bytes
}
