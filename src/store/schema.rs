//! The on-disk layout: every redb table and what its values hold.
//!
//! | table    | key -> value        | holds                                        |
//! |----------|---------------------|----------------------------------------------|
//! | `meta`   | `&str -> &[u8]`     | format version, store id, creation time      |
//! | `steps`  | `u64 -> &[u8]`      | a step's manifest (see `manifest.rs`)        |
//! | `chunk_data` | `u64 -> &[u8]`  | raw blob bytes by chunk id (ascending)      |
//! | `chunk_index` | `[u8; 32] -> (u64, u64)` | BLAKE3 hash -> (chunk id, uses) |
//! | `chunks`, `refs` | by hash     | format 1's chunks and counts (read only)     |
//! | `summaries` | `u64 -> &[u8]`   | per step: time, metrics, sizes (small JSON)  |
//! | `pins`   | `u64 -> ()`         | steps retention and removal must not delete  |
//! | `packed` | `(u64, u32) -> &[u8]` | per step: its small blobs, concatenated    |
//!
//! A manifest value is the 32-byte BLAKE3 hash of the encoding that follows
//! it, so a damaged manifest is detected on read rather than trusted.
//!
//! Format versions: 1 (ckptstore 0.1) wrote JSON manifests and kept chunks
//! by hash in `chunks`; 2 writes binary manifests and chunks by id, and reads
//! both. Opening a format 1 store for writing adds the format 2 tables and
//! marks it format 2, so that an older build refuses it instead of
//! misreading new steps. Its format 1 steps stay where they are (new chunks
//! are not deduplicated against them) until they are removed.

use redb::TableDefinition;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Store-wide facts.
pub(crate) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
/// Step number -> manifest.
pub(crate) const STEPS: TableDefinition<u64, &[u8]> = TableDefinition::new("steps");
/// Chunk id -> chunk bytes. Ids are given out in ascending order, so a
/// commit appends its chunks at the right edge of the b-tree: redb never
/// reads an older chunk's page to find where a new one goes (with hash keys
/// every insert landed beside a random old 1 MiB leaf and read it: a commit
/// read about its own size once the store outgrew the cache).
pub(crate) const CHUNK_DATA: TableDefinition<u64, &[u8]> = TableDefinition::new("chunk_data");
/// Chunk hash -> (chunk id, number of references from manifests): the
/// content-addressed index, with small entries only.
pub(crate) const CHUNK_INDEX: TableDefinition<&[u8; 32], (u64, u64)> =
    TableDefinition::new("chunk_index");

/// Format 1: chunk hash -> chunk bytes. Read, and emptied as steps go, in
/// stores written by 0.1; never written to since.
pub(crate) const LEGACY_CHUNKS: TableDefinition<&[u8; 32], &[u8]> = TableDefinition::new("chunks");
/// Format 1: chunk hash -> number of references.
pub(crate) const LEGACY_REFS: TableDefinition<&[u8; 32], u64> = TableDefinition::new("refs");

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
/// `meta` key of the next chunk id to give out (u64, little endian).
pub(crate) const META_NEXT_CHUNK: &str = "next_chunk_id";
/// `meta` key present while a commit stages chunks (see `stage` in
/// write.rs): a writable open that finds it deletes the staged chunks.
pub(crate) const META_STAGING: &str = "staging";

/// `meta` key of the store's format version (u32, little endian).
pub(crate) const META_FORMAT: &str = "format_version";
/// `meta` key of the store's UUID (text).
pub(crate) const META_STORE_ID: &str = "store_id";
/// `meta` key of the creation time (u64 Unix seconds, little endian).
pub(crate) const META_CREATED: &str = "created_at";

/// The newest store and manifest format this build reads and the one it
/// writes.
pub(crate) const FORMAT_VERSION: u32 = 2;

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
    /// Each chunk's hash, in order.
    #[serde(with = "hex_ids")]
    pub(crate) chunks: Vec<ChunkId>,
    /// Each chunk's id in [`CHUNK_DATA`], beside `chunks`; `None` for a
    /// format 1 blob, whose chunks are in [`LEGACY_CHUNKS`] by hash.
    #[serde(skip)]
    pub(crate) ids: Option<Vec<u64>>,
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
