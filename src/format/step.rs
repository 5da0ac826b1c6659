//! A step's manifest in memory: its checkpoint skeleton and where each
//! blob's bytes are. One model, with a codec per format: the current
//! binary one (`manifest.rs`) and format 1's JSON (`manifest_v1.rs`).

use std::collections::{BTreeMap, HashMap};

use super::codec::Hash;
use crate::{ComputationGraphStore, Dtype, GradientCheckpoint, SaveRecord};

/// One chunk of a blob: its content hash, and its id in `chunk_data`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChunkRef {
    pub(crate) hash: Hash,
    pub(crate) id: u64,
}

/// Where a blob's bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// In the step's packed small blobs, from this offset.
    Packed { offset: u64 },
    /// In these chunks of `chunk_data`, in order.
    Chunks(Vec<ChunkRef>),
    /// Format 1: in these chunks of the `chunks` table, by hash.
    Format1Chunks(Vec<Hash>),
}

/// One optimizer blob of a manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BlobRef {
    pub(crate) len: u64,
    pub(crate) at: Placement,
}

/// A step's small blobs, concatenated and stored under the step in
/// `packed` (cut as [`chunk_lengths`](super::layout::chunk_lengths) says).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PackedRef {
    pub(crate) len: u64,
    pub(crate) hash: Hash,
}

/// Dtype and shape of each blob that is a tensor, by name.
pub(crate) type Typed = BTreeMap<String, (Dtype, Vec<u64>)>;

/// One use of a chunk by a manifest.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ChunkUse<'a> {
    Current(&'a ChunkRef),
    Format1(&'a Hash),
}

/// A step's manifest as read.
#[derive(Clone, Debug)]
pub(crate) struct Manifest {
    pub(crate) step: u64,
    pub(crate) timestamp: u64,
    pub(crate) loss_cid: Option<String>,
    pub(crate) metrics: BTreeMap<String, f64>,
    pub(crate) graph: ComputationGraphStore,
    pub(crate) blobs: BTreeMap<String, BlobRef>,
    pub(crate) packed: Option<PackedRef>,
    /// The blobs that are tensors: their dtype and shape.
    pub(crate) typed: BTreeMap<String, (Dtype, Vec<u64>)>,
    /// How the step was saved (format 4; lifted from 0.4.0's metrics for
    /// the formats before it).
    pub(crate) save_record: SaveRecord,
}

impl Manifest {
    /// The checkpoint this manifest describes, with its blobs still to read,
    /// and which of them are tensors.
    pub(crate) fn into_parts(self) -> (GradientCheckpoint, BTreeMap<String, BlobRef>, Typed) {
        let ckpt = GradientCheckpoint {
            graph: self.graph,
            step: self.step,
            loss_cid: self.loss_cid,
            optimizer_state: HashMap::new(),
            timestamp: self.timestamp,
            metrics: self.metrics,
            tensors: BTreeMap::new(),
            save_record: self.save_record,
        };
        (ckpt, self.blobs, self.typed)
    }

    /// Every chunk use, once per use.
    pub(crate) fn chunk_uses(&self) -> impl Iterator<Item = ChunkUse<'_>> {
        self.blobs.values().flat_map(|b| {
            let (current, format1): (&[ChunkRef], &[Hash]) = match &b.at {
                Placement::Packed { .. } => (&[], &[]),
                Placement::Chunks(c) => (c, &[]),
                Placement::Format1Chunks(h) => (&[], h),
            };
            current
                .iter()
                .map(ChunkUse::Current)
                .chain(format1.iter().map(ChunkUse::Format1))
        })
    }
}

impl Manifest {
    /// The identity of the step's content: BLAKE3 over each blob's name,
    /// length, dtype and shape (for a tensor) and the hashes of its bytes
    /// (its chunks', or the packed small blobs' with its offset there), in
    /// name order. Two stores holding the same entries with the same bytes
    /// give the same digest, whatever their step's time, metrics or where
    /// the chunks lie; nothing is read but the manifest.
    pub(crate) fn content_digest(&self) -> Hash {
        let mut w = super::codec::Writer(Vec::new());
        w.len(self.blobs.len());
        for (name, blob) in &self.blobs {
            w.str(name);
            w.varint(blob.len);
            match self.typed.get(name) {
                None => w.u8(0),
                Some((dtype, shape)) => {
                    w.u8(1);
                    w.str(dtype.name());
                    w.len(shape.len());
                    for &d in shape {
                        w.varint(d);
                    }
                }
            }
            match &blob.at {
                Placement::Packed { offset } => {
                    w.u8(0);
                    w.varint(*offset);
                    w.hash(&self.packed.as_ref().map_or([0; 32], |p| p.hash));
                }
                Placement::Chunks(chunks) => {
                    w.u8(1);
                    w.len(chunks.len());
                    for c in chunks {
                        w.hash(&c.hash);
                    }
                }
                Placement::Format1Chunks(hashes) => {
                    w.u8(1);
                    w.len(hashes.len());
                    for h in hashes {
                        w.hash(h);
                    }
                }
            }
        }
        *blake3::hash(&w.0).as_bytes()
    }
}
