//! The bucket's layout, under the remote's prefix, all plain names:
//!
//! ```text
//! chunks/<blake3 hex>                      chunk bytes (and a step's packed small blobs)
//! manifests/<step:020>-<blake3 hex>.json   a step's manifest (JSON); the hash is of its bytes;
//!                                          for a global step of N ranks, the list of its shards
//! shards/<step:020>/<rank:06>-of-<N:06>-<blake3 hex>.json
//!                                          one rank's shard of a global step: a manifest
//! commits/<step:020>-<blake3 hex>          written last: the step is visible; names its manifest
//! deleted/<step:020>-<blake3 hex>          that step was deleted by retention: push skips it
//! locks/<push|gc>-<uuid>                   a push or a garbage collection in progress
//! ```
//!
//! Every key but the locks is written once with bytes that are a function
//! of its name (content addressing), so no conditional PUT is needed: a
//! rewrite puts the same bytes back.

use std::collections::BTreeMap;

use object_store::path::Path;
use serde::{Deserialize, Serialize};

use crate::format::manifest::{hex, Hash};

/// The folder of content-addressed chunks.
pub(crate) const CHUNKS: &str = "chunks";
/// The folder of step manifests.
pub(crate) const MANIFESTS: &str = "manifests";
/// The folder of commit objects.
pub(crate) const COMMITS: &str = "commits";
/// The folder of the shards of global steps, a folder per step.
pub(crate) const SHARDS: &str = "shards";
/// The folder of markers of steps deleted by retention.
pub(crate) const DELETED: &str = "deleted";
/// The folder of locks.
pub(crate) const LOCKS: &str = "locks";
/// The version of the manifest JSON written here.
pub(crate) const MANIFEST_FORMAT: u32 = 1;

/// Where things are under one prefix.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    pub(crate) prefix: Path,
}

impl Layout {
    fn key(&self, folder: &str, name: &str) -> Path {
        self.prefix.clone().join(folder).join(name)
    }

    pub(crate) fn folder(&self, folder: &str) -> Path {
        self.prefix.clone().join(folder)
    }

    pub(crate) fn chunk(&self, hash: &Hash) -> Path {
        self.key(CHUNKS, &hex(hash))
    }

    pub(crate) fn manifest(&self, step: u64, hash: &Hash) -> Path {
        self.key(MANIFESTS, &format!("{step:020}-{}.json", hex(hash)))
    }

    pub(crate) fn commit(&self, step: u64, hash: &Hash) -> Path {
        self.key(COMMITS, &format!("{step:020}-{}", hex(hash)))
    }

    pub(crate) fn shard_folder(&self, step: u64) -> Path {
        self.prefix.clone().join(SHARDS).join(format!("{step:020}"))
    }

    pub(crate) fn shard(&self, step: u64, id: &ShardId) -> Path {
        self.shard_folder(step).join(id.name())
    }

    pub(crate) fn deleted(&self, step: u64, hash: &Hash) -> Path {
        self.key(DELETED, &format!("{step:020}-{}", hex(hash)))
    }

    pub(crate) fn lock(&self, name: &str) -> Path {
        self.key(LOCKS, name)
    }
}

/// The step and manifest hash a commit's (or a deletion marker's, or a
/// manifest's without its `.json`) name carries.
pub(crate) fn parse_commit(name: &str) -> Option<(u64, Hash)> {
    let (step, hash) = name.split_once('-')?;
    if step.len() != 20 {
        return None;
    }
    Some((step.parse().ok()?, parse_hex(hash)?))
}

/// One rank's shard manifest, as its name says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct ShardId {
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    pub(crate) hash: Hash,
}

impl ShardId {
    fn name(&self) -> String {
        format!(
            "{:06}-of-{:06}-{}.json",
            self.rank,
            self.world_size,
            hex(&self.hash)
        )
    }

    /// The shard a name in a step's shard folder stands for.
    pub(crate) fn parse(name: &str) -> Option<ShardId> {
        let stem = name.strip_suffix(".json")?;
        let (rank, rest) = stem.split_once("-of-")?;
        let (world, hash) = rest.split_once('-')?;
        Some(ShardId {
            rank: rank.parse().ok()?,
            world_size: world.parse().ok()?,
            hash: parse_hex(hash)?,
        })
    }
}

/// The manifest of a global step: its world size and each rank's shard
/// manifest hash, by rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct GlobalManifest {
    pub(crate) format: u32,
    pub(crate) step: u64,
    pub(crate) world_size: u32,
    pub(crate) shards: Vec<String>,
}

/// A chunk object's hash, from its name.
pub(crate) fn parse_chunk(name: &str) -> Option<Hash> {
    parse_hex(name)
}

pub(crate) fn parse_hex(s: &str) -> Option<Hash> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// A step's manifest in the bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct RemoteManifest {
    pub(crate) format: u32,
    pub(crate) step: u64,
    pub(crate) timestamp: u64,
    pub(crate) loss_cid: Option<String>,
    pub(crate) metrics: BTreeMap<String, f64>,
    /// The computation graph in the seed's JSON form, keys sorted.
    pub(crate) graph: serde_json::Value,
    pub(crate) blobs: BTreeMap<String, RemoteBlob>,
    /// The step's small blobs, concatenated in name order: one chunk.
    pub(crate) packed: Option<RemotePacked>,
}

impl RemoteManifest {
    /// The manifest of `ckpt` (its graph, metadata and `blobs`).
    pub(crate) fn of(
        ckpt: &crate::GradientCheckpoint,
        blobs: BTreeMap<String, RemoteBlob>,
        packed: Option<RemotePacked>,
    ) -> crate::Result<RemoteManifest> {
        let graph = serde_json::to_value(&ckpt.graph).map_err(|e| crate::Error::Json {
            path: None,
            source: Box::new(e),
        })?;
        Ok(RemoteManifest {
            format: MANIFEST_FORMAT,
            step: ckpt.step,
            timestamp: ckpt.timestamp,
            loss_cid: ckpt.loss_cid.clone(),
            metrics: ckpt.metrics.clone(),
            graph: canonical(graph),
            blobs,
            packed,
        })
    }
}

/// Where one blob or tensor lies.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct RemoteBlob {
    pub(crate) len: u64,
    /// Its chunks' hashes, in order (a large blob).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) chunks: Option<Vec<String>>,
    /// Its offset in the packed chunk (a small blob).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) offset: Option<u64>,
    /// A tensor's dtype name and shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) shape: Option<Vec<u64>>,
}

/// The packed chunk of a step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct RemotePacked {
    pub(crate) len: u64,
    pub(crate) hash: String,
}

/// The bytes of a manifest (JSON) and their hash, which names it.
pub(crate) fn encode(manifest: &impl Serialize) -> crate::Result<(Vec<u8>, Hash)> {
    let bytes = serde_json::to_vec(manifest).map_err(|e| crate::Error::Json {
        path: None,
        source: Box::new(e),
    })?;
    let hash = *blake3::hash(&bytes).as_bytes();
    Ok((bytes, hash))
}

/// `value` with every object's keys in order, whatever map type
/// `serde_json` was built with: the same value encodes to the same bytes.
pub(crate) fn canonical(value: serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, canonical(v)))
                    .collect(),
            )
        }
        serde_json::Value::Array(items) => {
            serde_json::Value::Array(items.into_iter().map(canonical).collect())
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        let layout = Layout {
            prefix: Path::from("runs/a"),
        };
        let h = [0xab; 32];
        let c = layout.commit(42, &h);
        assert_eq!(c.as_ref(), format!("runs/a/commits/{:020}-{}", 42, hex(&h)));
        let name = c.filename().expect("has a name");
        assert_eq!(parse_commit(name), Some((42, h)));
        assert_eq!(parse_commit("42-ab"), None);
        assert_eq!(parse_chunk(&hex(&h)), Some(h));
        assert_eq!(parse_chunk("zz"), None);
        let name = layout.manifest(7, &h);
        assert_eq!(name.extension(), Some("json"));
    }

    #[test]
    fn canonical_json_sorts_keys() {
        let v: serde_json::Value =
            serde_json::json!({"b": 1, "a": {"d": [1, {"z": 0, "y": 1}], "c": 2}});
        let bytes = serde_json::to_vec(&canonical(v)).expect("encodes");
        assert_eq!(
            String::from_utf8(bytes).expect("utf-8"),
            r#"{"a":{"c":2,"d":[1,{"y":1,"z":0}]},"b":1}"#
        );
    }
}
