//! A step's manifest in the bucket (`RemoteManifest`): its metadata, and
//! where each blob or tensor lies (chunks, the packed chunk, format 3's
//! packs); written by [`encode`](super::layout::encode).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::format::layout::{chunk_lengths, small_tail};
use crate::format::manifest::{BlobRef, Hash, PackedRef, Placement};
use crate::remote::format::hash::HexHash;
use crate::remote::format::layout::{canonical, encode, MANIFEST_FORMAT};
use crate::remote::format::pack_format::MANIFEST_FORMAT_PACKS;
use crate::Dtype;

/// Which blobs are tensors: a blob's name to its dtype and shape.
pub(crate) type TypeOf<'a> = dyn Fn(&str) -> Option<(Dtype, Vec<u64>)> + 'a;

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
    /// Format 3: the packs its chunks lie in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) packs: Option<Vec<crate::remote::format::pack_format::RemotePack>>,
    /// Format 3: where each chunk it names lies in `packs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) index: Option<crate::remote::format::pack_format::PackIndex>,
    /// How the step was saved; left out when empty (a bucket written
    /// before it keeps 0.4.0's record among `metrics`).
    /// (Boxed: most manifests have none, and every commit body holds one.)
    #[serde(default, skip_serializing_if = "no_record")]
    pub(crate) save_record: Box<crate::SaveRecord>,
}

impl RemoteManifest {
    /// The manifest of `ckpt` (its graph, metadata and `blobs`).
    /// The bucket's form of a step: the one model of a step (`ckpt`'s
    /// skeleton, each blob's length and placement, which blobs are tensors,
    /// the packed bytes) in this codec. Chunks are named by hash.
    pub(crate) fn from_model(
        ckpt: &crate::GradientCheckpoint,
        blobs: &BTreeMap<String, BlobRef>,
        typed: &TypeOf<'_>,
        packed: Option<&PackedRef>,
    ) -> crate::Result<RemoteManifest> {
        let blobs = blobs
            .iter()
            .map(|(name, blob)| {
                let (chunks, offset) = match &blob.at {
                    Placement::Packed { offset } => (None, Some(*offset)),
                    Placement::Chunks(refs) => {
                        (Some(refs.iter().map(|c| HexHash(c.hash)).collect()), None)
                    }
                    Placement::Format1Chunks(hashes) => {
                        (Some(hashes.iter().map(|h| HexHash(*h)).collect()), None)
                    }
                };
                let tensor = typed(name);
                let entry = RemoteBlob {
                    len: blob.len,
                    chunks,
                    offset,
                    tail: None,
                    dtype: tensor.as_ref().map(|(d, _)| d.name().to_owned()),
                    shape: tensor.map(|(_, s)| s),
                };
                (name.clone(), entry)
            })
            .collect();
        let packed = packed.map(|p| RemotePacked {
            len: p.len,
            hash: HexHash(p.hash),
        });
        Self::of(ckpt, blobs, packed)
    }

    fn of(
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
            packs: None,
            index: None,
            save_record: Box::new(ckpt.save_record.clone()),
        })
    }
}

impl RemoteManifest {
    /// The hash a push judges a store's step by before packing it (its
    /// manifest in format 1, no packs), for a step a push packed (format
    /// 3, no blob tails); None for any other (formats 1 and 2 are named by
    /// that hash already). Retention marks a deleted step under both
    /// hashes, so that a push that lists the bucket finds the marker.
    pub(crate) fn unpacked_hash(&self) -> crate::Result<Option<Hash>> {
        let tails = self.blobs.values().any(|b| b.tail.is_some());
        if self.format != MANIFEST_FORMAT_PACKS || tails {
            return Ok(None);
        }
        let mut plain = self.clone();
        (plain.format, plain.packs, plain.index) = (MANIFEST_FORMAT, None, None);
        Ok(Some(encode(self.step, &plain)?.1))
    }
}

#[allow(clippy::borrowed_box)] // serde passes the field by reference
fn no_record(record: &Box<crate::SaveRecord>) -> bool {
    record.is_empty()
}

/// Where one blob or tensor lies.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct RemoteBlob {
    pub(crate) len: u64,
    /// Its chunks' hashes, in order (a large blob).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) chunks: Option<Vec<HexHash>>,
    /// Its offset in the packed chunk (a small blob).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) offset: Option<u64>,
    /// Format 2: a chunked blob whose small end ([`small_tail`]: the last
    /// pieces under 64 KiB) is not in `chunks` but in the packed chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tail: Option<RemoteTail>,
    /// A tensor's dtype name and shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) shape: Option<Vec<u64>>,
}

/// Where a blob's small end lies in the packed chunk, and the hash of
/// those bytes: a reader fetches and checks them alone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct RemoteTail {
    pub(crate) offset: u64,
    pub(crate) hash: HexHash,
}

/// The packed chunk of a step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct RemotePacked {
    pub(crate) len: u64,
    pub(crate) hash: HexHash,
}

impl RemoteBlob {
    /// The lengths of its chunk objects, in order (none for a packed blob).
    pub(crate) fn chunk_lengths(&self) -> impl Iterator<Item = usize> {
        let len = usize::try_from(self.len).unwrap_or(usize::MAX);
        let count = match &self.chunks {
            Some(chunks) => chunks.len(),
            None => 0,
        };
        chunk_lengths(len).take(count)
    }

    /// Bytes of its end that lie in the packed chunk (format 2): their
    /// offset there and their length.
    pub(crate) fn tail_bytes(&self) -> Option<(u64, u64)> {
        let len = usize::try_from(self.len).ok()?;
        Some((self.tail.as_ref()?.offset, small_tail(len).1 as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::remote::format::pack_format::RemotePack;

    /// A step's manifest as a push makes it before packing.
    fn plain() -> RemoteManifest {
        let h = "ab".repeat(32);
        let json = serde_json::json!({
            "format": MANIFEST_FORMAT, "step": 7, "timestamp": 3, "loss_cid": null,
            "metrics": {"loss": 0.5}, "graph": {"edges": [], "nodes": {}},
            "blobs": {"w": {"len": 1 << 20, "chunks": [h]}},
            "packed": null,
        });
        serde_json::from_value(json).expect("a manifest")
    }

    #[test]
    fn a_packed_step_knows_the_hash_a_push_compares() -> crate::Result<()> {
        let before = plain();
        let (_, want) = encode(7, &before)?;
        let mut packed = before.clone();
        packed.format = MANIFEST_FORMAT_PACKS;
        packed.packs = Some(vec![RemotePack {
            hash: HexHash([0xcd; 32]),
            len: 1 << 20,
        }]);
        packed.index = Some([(HexHash([0xab; 32]), (0, 0))].into());
        // Read back from its bytes, as retention reads it.
        let (bytes, packed_hash) = encode(7, &packed)?;
        let read: RemoteManifest = serde_json::from_slice(&bytes).expect("decodes");
        assert_ne!(packed_hash, want);
        assert_eq!(read.unpacked_hash()?, Some(want));
        // Other formats are named by that hash already; a shard with
        // blob tails is not a pushed step.
        assert_eq!(before.unpacked_hash()?, None);
        let mut tailed = read.clone();
        if let Some(b) = tailed.blobs.get_mut("w") {
            b.tail = Some(RemoteTail {
                offset: 0,
                hash: HexHash([0xef; 32]),
            });
        }
        assert_eq!(tailed.unpacked_hash()?, None);
        Ok(())
    }
}
