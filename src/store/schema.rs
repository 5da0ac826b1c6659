//! The on-disk layout: every redb table and the step manifest.
//!
//! | table    | key -> value        | holds                                        |
//! |----------|---------------------|----------------------------------------------|
//! | `meta`   | `&str -> &[u8]`     | format version, store id, creation time      |
//! | `steps`  | `u64 -> &[u8]`      | a step's manifest: hash + versioned JSON     |
//! | `chunks` | `[u8; 32] -> &[u8]` | raw blob bytes, keyed by their BLAKE3 hash   |
//! | `refs`   | `[u8; 32] -> u64`   | how many manifest entries use each chunk     |
//! | `summaries` | `u64 -> &[u8]`   | per step: time, metrics, sizes (small JSON)  |
//! | `pins`   | `u64 -> ()`         | steps retention and removal must not delete  |
//! | `packed` | `(u64, u32) -> &[u8]` | per step: its small blobs, concatenated    |
//!
//! A manifest value is the 32-byte BLAKE3 hash of the JSON that follows it,
//! so a damaged manifest is detected on read rather than trusted.

use std::collections::BTreeMap;

use redb::TableDefinition;
use serde::{Deserialize, Serialize};

use crate::{ComputationGraphStore, Error, GradientCheckpoint, Result};

/// Store-wide facts.
pub(crate) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
/// Step number -> manifest.
pub(crate) const STEPS: TableDefinition<u64, &[u8]> = TableDefinition::new("steps");
/// Chunk hash -> chunk bytes.
pub(crate) const CHUNKS: TableDefinition<&[u8; 32], &[u8]> = TableDefinition::new("chunks");
/// Chunk hash -> number of references from manifests.
pub(crate) const REFS: TableDefinition<&[u8; 32], u64> = TableDefinition::new("refs");

/// Step number -> [`StepSummary`](crate::StepSummary) JSON: what listings,
/// retention and metric queries read instead of whole manifests.
pub(crate) const SUMMARIES: TableDefinition<u64, &[u8]> = TableDefinition::new("summaries");
/// `(step, piece)` -> a piece of the step's packed small blobs.
pub(crate) const PACKED: TableDefinition<(u64, u32), &[u8]> = TableDefinition::new("packed");
/// Pinned steps: never deleted by retention, remove or rollback.
pub(crate) const PINS: TableDefinition<u64, ()> = TableDefinition::new("pins");

/// `meta` key of the bytes held in `chunks` (u64, little endian).
pub(crate) const META_STORED_BYTES: &str = "stored_bytes";
/// `meta` key of the number of chunks (u64, little endian).
pub(crate) const META_STORED_CHUNKS: &str = "stored_chunks";

/// `meta` key of the store's format version (u32, little endian).
pub(crate) const META_FORMAT: &str = "format_version";
/// `meta` key of the store's UUID (text).
pub(crate) const META_STORE_ID: &str = "store_id";
/// `meta` key of the creation time (u64 Unix seconds, little endian).
pub(crate) const META_CREATED: &str = "created_at";

/// The newest store and manifest format this build reads and the one it
/// writes.
pub(crate) const FORMAT_VERSION: u32 = 1;

/// A `u64` counter of the `meta` table (0 when absent or malformed).
pub(crate) fn meta_u64(
    meta: &impl redb::ReadableTable<&'static str, &'static [u8]>,
    key: &str,
) -> Result<u64> {
    Ok(meta
        .get(key)
        .map_err(|e| Error::Storage {
            context: format!("reading {key} from table meta"),
            source: e.into(),
        })?
        .and_then(|v| <[u8; 8]>::try_from(v.value()).ok())
        .map_or(0, u64::from_le_bytes))
}

/// A chunk's identity: the BLAKE3 hash of its bytes.
pub(crate) type ChunkId = [u8; 32];

/// How one optimizer blob is stored: its length, and either its chunks in
/// order or its offset in the step's packed small blobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct BlobRef {
    pub(crate) len: u64,
    #[serde(with = "hex_ids")]
    pub(crate) chunks: Vec<ChunkId>,
    /// Offset in the step's packed bytes ([`PACKED`]), for a small blob.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) packed: Option<u64>,
}

/// A step's small blobs, concatenated and stored under the step in
/// [`PACKED`] (cut as [`chunk_lengths`](super::chunks::chunk_lengths) says,
/// under keys `(step, 0..)`): one sequential write instead of a
/// content-addressed insert per small blob.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct PackedRef {
    pub(crate) len: u64,
    #[serde(with = "hex_id")]
    pub(crate) hash: ChunkId,
}

/// A step's manifest as written: borrows the checkpoint, so encoding copies
/// no graph.
#[derive(Serialize)]
struct ManifestOut<'a> {
    format: u32,
    step: u64,
    timestamp: u64,
    loss_cid: &'a Option<String>,
    metrics: &'a BTreeMap<String, f64>,
    graph: &'a ComputationGraphStore,
    blobs: &'a BTreeMap<String, BlobRef>,
    #[serde(skip_serializing_if = "Option::is_none")]
    packed: Option<&'a PackedRef>,
}

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

    /// Every chunk reference, once per use.
    pub(crate) fn chunk_refs(&self) -> impl Iterator<Item = &ChunkId> {
        self.blobs.values().flat_map(|b| b.chunks.iter())
    }
}

/// Encode a manifest: hash, then JSON.
pub(crate) fn encode_manifest(
    ckpt: &GradientCheckpoint,
    blobs: &BTreeMap<String, BlobRef>,
    packed: Option<&PackedRef>,
) -> Result<Vec<u8>> {
    let out = ManifestOut {
        format: FORMAT_VERSION,
        step: ckpt.step,
        timestamp: ckpt.timestamp,
        loss_cid: &ckpt.loss_cid,
        metrics: &ckpt.metrics,
        graph: &ckpt.graph,
        blobs,
        packed,
    };
    let mut bytes = vec![0u8; 32];
    serde_json::to_writer(&mut bytes, &out).map_err(|e| Error::InvalidCheckpoint {
        step: ckpt.step,
        reason: format!("its manifest does not encode as JSON: {e}"),
    })?;
    let hash = blake3::hash(&bytes[32..]);
    bytes[..32].copy_from_slice(hash.as_bytes());
    Ok(bytes)
}

/// Decode and check a manifest read from the `steps` table under `step`.
///
/// Fails with [`Error::Corrupt`] on a hash mismatch, undecodable JSON or a
/// manifest whose step is not its key, and with [`Error::UnsupportedFormat`]
/// for a manifest of a newer format.
pub(crate) fn decode_manifest(step: u64, bytes: &[u8]) -> Result<Manifest> {
    if bytes.len() < 32 {
        return Err(Error::corrupt(
            Some(step),
            format!("manifest is {} bytes, shorter than its hash", bytes.len()),
        ));
    }
    let (hash, json) = bytes.split_at(32);
    if blake3::hash(json).as_bytes() != hash {
        return Err(Error::corrupt(Some(step), "manifest hash mismatch"));
    }
    decode_manifest_json(step, json)
}

/// Decode manifest JSON whose hash has been checked (or that is fuzzed).
pub(crate) fn decode_manifest_json(step: u64, json: &[u8]) -> Result<Manifest> {
    #[derive(Deserialize)]
    struct Version {
        format: u32,
    }
    let version: Version = serde_json::from_slice(json)
        .map_err(|e| Error::corrupt(Some(step), format!("manifest does not decode: {e}")))?;
    if version.format > FORMAT_VERSION {
        return Err(Error::UnsupportedFormat {
            what: format!("manifest of step {step}"),
            found: version.format,
            supported: FORMAT_VERSION,
        });
    }
    let manifest: Manifest = serde_json::from_slice(json)
        .map_err(|e| Error::corrupt(Some(step), format!("manifest does not decode: {e}")))?;
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

/// One hash as a lowercase hex string in JSON.
mod hex_id {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serializer};

    use super::ChunkId;

    pub(crate) fn serialize<S: Serializer>(id: &ChunkId, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&blake3::Hash::from_bytes(*id).to_hex())
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ChunkId, D::Error> {
        let text = std::borrow::Cow::<'de, str>::deserialize(d)?;
        blake3::Hash::from_hex(text.as_bytes())
            .map(|h| *h.as_bytes())
            .map_err(D::Error::custom)
    }
}

/// Chunk ids as lowercase hex strings in JSON.
mod hex_ids {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serializer};

    use super::ChunkId;

    pub(crate) fn serialize<S: Serializer>(ids: &[ChunkId], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(
            ids.iter()
                .map(|id| blake3::Hash::from_bytes(*id).to_hex().to_string()),
        )
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<ChunkId>, D::Error> {
        let texts: Vec<std::borrow::Cow<'de, str>> = Vec::deserialize(d)?;
        texts
            .iter()
            .map(|t| {
                blake3::Hash::from_hex(t.as_bytes())
                    .map(|h| *h.as_bytes())
                    .map_err(D::Error::custom)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_round_trips_and_detects_damage() -> Result<()> {
        let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 9);
        ckpt.metrics.insert("loss".into(), 1.5);
        let mut blobs = BTreeMap::new();
        blobs.insert(
            "w".to_owned(),
            BlobRef {
                len: 3,
                chunks: vec![[7u8; 32]],
                packed: None,
            },
        );
        let bytes = encode_manifest(&ckpt, &blobs, None)?;
        let m = decode_manifest(9, &bytes)?;
        assert_eq!(m.blobs, blobs);
        assert_eq!(m.metrics["loss"], 1.5);

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
        assert!(decode_manifest(9, &bytes[..5]).is_err());
        Ok(())
    }

    #[test]
    fn blob_longer_than_its_chunks_is_rejected() {
        let json = br#"{"format":1,"step":1,"timestamp":0,"loss_cid":null,
            "graph":{"nodes":{},"edges":[]},
            "blobs":{"w":{"len":18446744073709551615,"chunks":[]}}}"#;
        assert!(matches!(
            decode_manifest_json(1, json),
            Err(Error::Corrupt { .. })
        ));
    }

    #[test]
    fn newer_manifest_format_is_refused() {
        let json = br#"{"format":99,"step":1}"#;
        assert!(matches!(
            decode_manifest_json(1, json),
            Err(Error::UnsupportedFormat { found: 99, .. })
        ));
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    fn valid_manifest() -> Vec<u8> {
        let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 5);
        ckpt.metrics.insert("loss".into(), 0.5);
        let mut blobs = BTreeMap::new();
        blobs.insert(
            "w".to_owned(),
            BlobRef {
                len: 10,
                chunks: vec![[1u8; 32]],
                packed: None,
            },
        );
        encode_manifest(&ckpt, &blobs, None).expect("encodes")
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            if std::env::var_os("CKPT_LONG").is_some() { 50_000 } else { 2_000 }
        ))]

        /// Arbitrary bytes never panic the decoder.
        #[test]
        fn arbitrary_bytes_do_not_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = decode_manifest(5, &bytes);
            let _ = decode_manifest_json(5, &bytes);
        }

        /// Mutations of a valid manifest JSON (hash bypassed) either decode
        /// to a manifest whose lengths are within its chunks, or fail.
        #[test]
        fn mutated_manifests_decode_consistently_or_fail(
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)
        ) {
            let mut json = valid_manifest()[32..].to_vec();
            for (at, byte) in edits {
                let i = at.index(json.len());
                json[i] = byte;
            }
            if let Ok(m) = decode_manifest_json(5, &json) {
                prop_assert_eq!(m.step, 5);
                for blob in m.blobs.values() {
                    prop_assert!(blob.len <= blob.chunks.len() as u64 * crate::store::chunks::CHUNK_SIZE as u64);
                }
            }
            // With the hash in front, any change is caught.
            let mut hashed = valid_manifest();
            let tail = hashed.len() - 1;
            hashed[tail] ^= 0x20;
            prop_assert!(decode_manifest(5, &hashed).is_err());
        }
    }
}
