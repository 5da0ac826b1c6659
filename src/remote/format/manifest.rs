//! A step's manifest in the bucket (`RemoteManifest`): its format
//! (`ManifestFormat`), its metadata, and where each blob or tensor lies
//! (chunks, the packed chunk, the packs of formats 3 and 4); written by
//! [`encode`](super::layout::encode).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::format::layout::{chunk_lengths, small_tail};
use crate::format::manifest::{BlobRef, Hash, PackedRef, Placement};
use crate::remote::format::hash::HexHash;
use crate::remote::format::layout::{canonical, encode};
use crate::Dtype;

/// Which blobs are tensors: a blob's name to its dtype and shape.
pub(crate) type TypeOf<'a> = dyn Fn(&str) -> Option<(Dtype, Vec<u64>)> + 'a;

/// The format of a step's or a shard's manifest (its `"format"`): what
/// its blobs name and where their bytes are. Any other number is refused
/// as the manifest is decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub(crate) enum ManifestFormat {
    /// Chunk objects, a blob's chunks named by hash (0.3 reads only this).
    Chunks = 1,
    /// As `Chunks`, and a blob may end in the packed chunk
    /// ([`RemoteBlob::tail`](super::manifest::RemoteBlob::tail)).
    Tails = 2,
    /// Every chunk in a pack object (`packs`, `index`).
    Packs = 3,
    /// As `Packs`, and a chunk may be stored compressed (its index entry
    /// names its stored form). Written only where one is, so that a step
    /// of raw chunks stays readable by builds that read format 3.
    Compressed = 4,
}

impl ManifestFormat {
    /// Whether its chunks lie in packs (`packs`, `index`).
    pub(crate) fn has_packs(self) -> bool {
        matches!(self, ManifestFormat::Packs | ManifestFormat::Compressed)
    }
}

impl TryFrom<u32> for ManifestFormat {
    type Error = String;

    fn try_from(n: u32) -> Result<Self, String> {
        match n {
            1 => Ok(ManifestFormat::Chunks),
            2 => Ok(ManifestFormat::Tails),
            3 => Ok(ManifestFormat::Packs),
            4 => Ok(ManifestFormat::Compressed),
            n => Err(format!("manifest format {n} (this build reads 1 to 4)")),
        }
    }
}

impl From<ManifestFormat> for u32 {
    fn from(f: ManifestFormat) -> u32 {
        f as u32
    }
}

impl fmt::Display for ManifestFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", u32::from(*self))
    }
}

/// A step's manifest in the bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct RemoteManifest {
    pub(crate) format: ManifestFormat,
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
    /// A shard of a rank-local save: which save
    /// ([`SaveId`](crate::SaveId)); its step completes only with shards
    /// naming the same. Left out otherwise (a reader before it ignores it).
    /// (Boxed, as the record is.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) save: Option<Box<HexHash>>,
}

impl RemoteManifest {
    /// The manifest of `ckpt` (its graph, metadata and `blobs`).
    /// The bucket's form of a step: the one model of a step (`ckpt`'s
    /// skeleton, each blob's length and placement, which blobs are tensors,
    /// the packed bytes) in this codec. Chunks are named by hash.
    pub(crate) fn from_model<'a>(
        ckpt: impl Into<crate::step::StepRef<'a>>,
        blobs: &BTreeMap<String, BlobRef>,
        typed: &TypeOf<'_>,
        packed: Option<&PackedRef>,
    ) -> crate::Result<RemoteManifest> {
        let blobs = blobs
            .iter()
            .map(|(name, blob)| {
                let place = match &blob.at {
                    Placement::Packed { offset } => RemotePlace::Packed { offset: *offset },
                    Placement::Chunks(refs) => RemotePlace::Chunks {
                        hashes: refs.iter().map(|c| HexHash(c.hash)).collect(),
                        tail: None,
                    },
                    Placement::Format1Chunks(hashes) => RemotePlace::Chunks {
                        hashes: hashes.iter().map(|h| HexHash(*h)).collect(),
                        tail: None,
                    },
                };
                let tensor = typed(name).map(|(d, shape)| RemoteTensor {
                    dtype: d.name().to_owned(),
                    shape,
                });
                let entry = RemoteBlob {
                    len: blob.len,
                    place,
                    tensor,
                };
                (name.clone(), entry)
            })
            .collect();
        let packed = packed.map(|p| RemotePacked {
            len: p.len,
            hash: HexHash(p.hash),
        });
        Self::of(ckpt.into(), blobs, packed)
    }

    fn of(
        ckpt: crate::step::StepRef<'_>,
        blobs: BTreeMap<String, RemoteBlob>,
        packed: Option<RemotePacked>,
    ) -> crate::Result<RemoteManifest> {
        let graph = serde_json::to_value(ckpt.graph()).map_err(|e| crate::Error::Json {
            path: None,
            source: Box::new(e),
        })?;
        Ok(RemoteManifest {
            format: ManifestFormat::Chunks,
            step: ckpt.step(),
            timestamp: ckpt.timestamp(),
            loss_cid: ckpt.loss_cid().map(str::to_owned),
            metrics: ckpt.metrics().clone(),
            graph: canonical(graph),
            blobs,
            packed,
            packs: None,
            index: None,
            save_record: Box::new(ckpt.save_record().clone()),
            save: None,
        })
    }
}

impl RemoteManifest {
    /// The hash a push judges a store's step by before packing it (its
    /// manifest in format 1, no packs), for a step a push packed (format
    /// 3 or 4, no blob tails); None for any other (formats 1 and 2 are named by
    /// that hash already). Retention marks a deleted step under both
    /// hashes, so that a push that lists the bucket finds the marker.
    pub(crate) fn unpacked_hash(&self) -> crate::Result<Option<Hash>> {
        let tails = self.blobs.values().any(|b| b.tail().is_some());
        if !self.format.has_packs() || tails {
            return Ok(None);
        }
        let mut plain = self.clone();
        (plain.format, plain.packs, plain.index) = (ManifestFormat::Chunks, None, None);
        Ok(Some(encode(self.step, &plain)?.1))
    }
}

#[allow(clippy::borrowed_box)] // serde passes the field by reference
fn no_record(record: &Box<crate::SaveRecord>) -> bool {
    record.is_empty()
}

/// Where one blob or tensor lies, and a tensor's dtype and shape. Decoded
/// from its wire form ([`WireBlob`]): a blob with no place, or two, or
/// with a dtype and no shape, is no blob this build reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "WireBlob", into = "WireBlob")]
pub(crate) struct RemoteBlob {
    pub(crate) len: u64,
    pub(crate) place: RemotePlace,
    pub(crate) tensor: Option<RemoteTensor>,
}

/// Where a blob's bytes lie.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum RemotePlace {
    /// A large blob: its chunks' hashes, in order; format 2: its small
    /// end ([`small_tail`]: the last pieces under 64 KiB) is not among
    /// them but in the packed chunk (`tail`).
    Chunks {
        hashes: Vec<HexHash>,
        tail: Option<RemoteTail>,
    },
    /// A small blob: at `offset` in the packed chunk.
    Packed { offset: u64 },
}

/// A tensor's dtype (by name) and shape.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RemoteTensor {
    pub(crate) dtype: String,
    pub(crate) shape: Vec<u64>,
}

/// A blob as JSON has it (the bucket's format): each part optional.
#[derive(Clone, Serialize, Deserialize)]
struct WireBlob {
    len: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    chunks: Option<Vec<HexHash>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    offset: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tail: Option<RemoteTail>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dtype: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    shape: Option<Vec<u64>>,
}

impl TryFrom<WireBlob> for RemoteBlob {
    type Error = String;

    fn try_from(w: WireBlob) -> std::result::Result<RemoteBlob, String> {
        let place = match (w.chunks, w.offset, w.tail) {
            (Some(hashes), None, tail) => RemotePlace::Chunks { hashes, tail },
            (None, Some(offset), None) => RemotePlace::Packed { offset },
            _ => return Err("a blob with no place (chunks, or an offset alone)".to_owned()),
        };
        let tensor = match (w.dtype, w.shape) {
            (None, None) => None,
            (Some(dtype), Some(shape)) => Some(RemoteTensor { dtype, shape }),
            _ => return Err("a blob with a dtype or a shape, not both".to_owned()),
        };
        Ok(RemoteBlob {
            len: w.len,
            place,
            tensor,
        })
    }
}

impl From<RemoteBlob> for WireBlob {
    fn from(b: RemoteBlob) -> WireBlob {
        let (chunks, offset, tail) = match b.place {
            RemotePlace::Chunks { hashes, tail } => (Some(hashes), None, tail),
            RemotePlace::Packed { offset } => (None, Some(offset), None),
        };
        let (dtype, shape) = b.tensor.map(|t| (t.dtype, t.shape)).unzip();
        WireBlob {
            len: b.len,
            chunks,
            offset,
            tail,
            dtype,
            shape,
        }
    }
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
    /// Its chunks' hashes, in order (none for a packed blob).
    pub(crate) fn chunks(&self) -> &[HexHash] {
        match &self.place {
            RemotePlace::Chunks { hashes, .. } => hashes,
            RemotePlace::Packed { .. } => &[],
        }
    }

    /// Format 2: where its small end lies in the packed chunk.
    pub(crate) fn tail(&self) -> Option<&RemoteTail> {
        match &self.place {
            RemotePlace::Chunks { tail, .. } => tail.as_ref(),
            RemotePlace::Packed { .. } => None,
        }
    }

    /// The lengths of its chunk objects, in order (none for a packed blob).
    pub(crate) fn chunk_lengths(&self) -> impl Iterator<Item = usize> {
        let len = usize::try_from(self.len).unwrap_or(usize::MAX);
        chunk_lengths(len).take(self.chunks().len())
    }

    /// Bytes of its end that lie in the packed chunk (format 2): their
    /// offset there and their length.
    pub(crate) fn tail_bytes(&self) -> Option<(u64, u64)> {
        let len = usize::try_from(self.len).ok()?;
        Some((self.tail()?.offset, small_tail(len).1 as u64))
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
            "format": 1, "step": 7, "timestamp": 3, "loss_cid": null,
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
        packed.format = ManifestFormat::Packs;
        packed.packs = Some(vec![RemotePack {
            hash: HexHash([0xcd; 32]),
            len: 1 << 20,
        }]);
        let entry = crate::remote::format::pack_format::IndexEntry {
            pack: 0,
            at: 0,
            stored: crate::remote::format::stored::Stored::Raw,
        };
        packed.index = Some([(HexHash([0xab; 32]), entry)].into());
        // Read back from its bytes, as retention reads it.
        let (bytes, packed_hash) = encode(7, &packed)?;
        let read: RemoteManifest = serde_json::from_slice(&bytes).expect("decodes");
        assert_ne!(packed_hash, want);
        assert_eq!(read.unpacked_hash()?, Some(want));
        // Other formats are named by that hash already; a shard with
        // blob tails is not a pushed step.
        assert_eq!(before.unpacked_hash()?, None);
        let mut tailed = read.clone();
        if let Some(RemotePlace::Chunks { tail, .. }) =
            tailed.blobs.get_mut("w").map(|b| &mut b.place)
        {
            *tail = Some(RemoteTail {
                offset: 0,
                hash: HexHash([0xef; 32]),
            });
        }
        assert_eq!(tailed.unpacked_hash()?, None);
        Ok(())
    }

    #[test]
    fn a_blob_decodes_to_one_place_and_encodes_back_as_it_was() {
        let h = "ab".repeat(32);
        let valid = [
            serde_json::json!({"len": 1 << 20, "chunks": [h]}),
            serde_json::json!({"len": 1 << 20, "chunks": [h], "tail": {"offset": 4, "hash": h},
                "dtype": "F32", "shape": [262_144]}),
            serde_json::json!({"len": 12, "offset": 0, "dtype": "U8", "shape": [3, 4]}),
            serde_json::json!({"len": 0, "chunks": []}),
        ];
        for json in valid {
            let blob: RemoteBlob = serde_json::from_value(json.clone()).expect("a blob");
            assert_eq!(serde_json::to_value(&blob).ok(), Some(json));
        }
        let packed: RemoteBlob =
            serde_json::from_value(serde_json::json!({"len": 5, "offset": 9})).expect("a blob");
        assert_eq!(packed.place, RemotePlace::Packed { offset: 9 });
        assert!(packed.chunks().is_empty() && packed.tail().is_none() && packed.tensor.is_none());
        let crafted = [
            (serde_json::json!({"len": 5}), "no place"),
            (
                serde_json::json!({"len": 5, "offset": 1, "chunks": [h]}),
                "no place",
            ),
            (
                serde_json::json!({"len": 5, "offset": 1, "tail": {"offset": 0, "hash": h}}),
                "no place",
            ),
            (
                serde_json::json!({"len": 5, "offset": 1, "dtype": "U8"}),
                "not both",
            ),
            (
                serde_json::json!({"len": 5, "offset": 1, "shape": [5]}),
                "not both",
            ),
            (serde_json::json!({"len": -1, "offset": 1}), "invalid value"),
        ];
        for (json, why) in crafted {
            let e = serde_json::from_value::<RemoteBlob>(json.clone()).expect_err("refused");
            assert!(e.to_string().contains(why), "{json}: {e}");
        }
    }
}
