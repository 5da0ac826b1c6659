//! The first part of a commit, with no database: cut the checkpoint's
//! blobs into chunks and packed bytes, and say where each blob will lie.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::format::layout::{split, PACK_BELOW};
use crate::format::manifest::{BlobRef, ChunkRef, Hash, PackedRef, Placement, TypedRef};
use crate::step::StepRef;
use crate::{StepSummary, TensorRef};

/// Tensors of a commit that borrow their bytes, by name.
pub(crate) type Borrowed<'a> = BTreeMap<String, TensorRef<'a>>;

/// Refuse borrowed tensors one of whose names is also a blob or tensor of
/// `step`.
pub(crate) fn check_borrowed<'a>(
    step: impl Into<StepRef<'a>>,
    borrowed: &Borrowed<'_>,
) -> crate::Result<()> {
    let step = step.into();
    let clash = borrowed.keys().find(|n| step.contains(n));
    match clash {
        Some(name) => Err(crate::Error::InvalidCheckpoint {
            step: step.step(),
            reason: format!("{name:?} is both a borrowed tensor and in the checkpoint"),
        }),
        None => Ok(()),
    }
}

/// A blob or tensor whose chunks an earlier transaction staged and whose
/// bytes are no longer in memory (an import that streams a large file).
pub(crate) struct Streamed {
    pub(crate) name: String,
    pub(crate) len: u64,
    /// Each chunk's hash, in order.
    pub(crate) hashes: Vec<Hash>,
    /// A tensor (typed in the checkpoint, with no data there), or a blob.
    pub(crate) typed: bool,
}

/// A blob to cut: its name, bytes, and its chunks' hashes when known.
type Named<'a> = (&'a String, &'a [u8], Option<&'a [Hash]>);

/// A checkpoint cut up for storing.
pub(crate) struct Plan<'a> {
    /// The step cut.
    pub(crate) source: StepRef<'a>,
    /// Every chunk of every chunked blob, blobs in name order.
    pub(crate) pieces: Vec<&'a [u8]>,
    /// The hash of each piece when it is known already (a borrowed tensor
    /// whose chunks were hashed as it was copied); empty when none is.
    pub(crate) known: Vec<Option<Hash>>,
    /// Each chunked blob: its name, length, and its range of `pieces`.
    chunked: Vec<(&'a str, u64, Range<usize>)>,
    /// Each packed blob: its name, length, and offset in `packed`.
    packed_at: Vec<(&'a str, u64, u64)>,
    /// The small blobs, concatenated.
    pub(crate) packed: Vec<u8>,
    /// Blobs and tensors already staged, without their bytes.
    pub(crate) streamed: &'a [Streamed],
    /// Every tensor's name, dtype and shape, in name order.
    pub(crate) typed: Vec<TypedRef<'a>>,
    /// Bytes of the tensors that borrow their bytes.
    borrowed_bytes: u64,
}

impl<'a> Plan<'a> {
    /// Cut `ckpt`: blobs of [`PACK_BELOW`] bytes or more into chunks, the
    /// rest packed together.
    #[cfg(any(test, feature = "remote"))]
    pub(crate) fn new(ckpt: impl Into<StepRef<'a>>) -> Self {
        Self::build(ckpt.into(), &[], None)
    }

    /// [`new`](Self::new) for a checkpoint some of whose blobs and tensors
    /// are `streamed`: staged already, their names left out of the plan
    /// (a streamed tensor stays in `ckpt` without data, for its type).
    pub(crate) fn with_streamed(ckpt: impl Into<StepRef<'a>>, streamed: &'a [Streamed]) -> Self {
        Self::build(ckpt.into(), streamed, None)
    }

    /// [`new`](Self::new) for `ckpt` and the tensors `borrowed`, whose names
    /// are none of `ckpt`'s.
    pub(crate) fn with_borrowed(ckpt: impl Into<StepRef<'a>>, borrowed: &'a Borrowed<'a>) -> Self {
        Self::build(ckpt.into(), &[], Some(borrowed))
    }

    fn build(
        source: StepRef<'a>,
        streamed: &'a [Streamed],
        borrowed: Option<&'a Borrowed<'a>>,
    ) -> Self {
        let streamed_names: std::collections::HashSet<&str> =
            streamed.iter().map(|s| s.name.as_str()).collect();
        let elsewhere = |name: &String| streamed_names.contains(name.as_str());
        let borrowed = borrowed.into_iter().flatten();
        // Tensors' data is stored as blobs are; the manifest types them.
        let mut named: Vec<Named<'a>> = source
            .entries()
            .map(|(n, b, _)| (n, b, None))
            .filter(|(n, _, _)| !elsewhere(n))
            .chain(
                borrowed
                    .clone()
                    .map(|(n, t)| (n, t.data(), t.known_hashes())),
            )
            .collect();
        named.sort_unstable_by_key(|(n, _, _)| *n);
        let mut typed: Vec<TypedRef<'a>> = source
            .entries()
            .filter_map(|(n, _, t)| t.map(|(dtype, shape)| (n.as_str(), dtype, shape)))
            .chain(
                borrowed
                    .clone()
                    .map(|(n, t)| (n.as_str(), t.dtype(), t.shape())),
            )
            .collect();
        typed.sort_unstable_by_key(|t| t.0);
        let mut plan = Plan {
            source,
            pieces: Vec::new(),
            known: Vec::new(),
            chunked: Vec::new(),
            packed_at: Vec::new(),
            packed: Vec::new(),
            streamed,
            typed,
            borrowed_bytes: borrowed.map(|(_, t)| t.data().len() as u64).sum(),
        };
        for (name, blob, hashes) in named {
            let len = blob.len() as u64;
            if blob.len() < PACK_BELOW {
                plan.packed_at.push((name, len, plan.packed.len() as u64));
                plan.packed.extend_from_slice(blob);
            } else {
                let first = plan.pieces.len();
                plan.pieces.extend(split(blob));
                if let Some(hashes) = hashes {
                    // One per piece (`ChunkHashes` is of this many bytes).
                    plan.known.resize(first, None);
                    plan.known.extend(hashes.iter().copied().map(Some));
                }
                plan.chunked.push((name, len, first..plan.pieces.len()));
            }
        }
        plan
    }

    pub(crate) fn step(&self) -> u64 {
        self.source.step()
    }

    /// Bytes of all chunks (before deduplication).
    pub(crate) fn chunk_bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.len()).sum()
    }

    /// The packed bytes' length and hash, if there are any.
    pub(crate) fn packed_ref(&self) -> Option<PackedRef> {
        (!self.packed.is_empty()).then(|| PackedRef {
            len: self.packed.len() as u64,
            hash: *blake3::hash(&self.packed).as_bytes(),
        })
    }

    /// Bytes of state: in memory and streamed.
    pub(crate) fn logical_bytes(&self) -> u64 {
        self.source.logical_bytes()
            + self.streamed.iter().map(|s| s.len).sum::<u64>()
            + self.borrowed_bytes
    }

    /// Where each blob lies, given the stored chunk of each piece and of
    /// each streamed blob.
    pub(crate) fn placements_with(
        &self,
        chunks: &[ChunkRef],
        streamed: Vec<Vec<ChunkRef>>,
    ) -> BTreeMap<String, BlobRef> {
        let mut all = self.placements(chunks);
        for (s, refs) in self.streamed.iter().zip(streamed) {
            let blob = BlobRef {
                len: s.len,
                at: Placement::Chunks(refs),
            };
            all.insert(s.name.clone(), blob);
        }
        all
    }

    /// Where each blob lies, given the stored chunk of each piece.
    pub(crate) fn placements(&self, chunks: &[ChunkRef]) -> BTreeMap<String, BlobRef> {
        let chunked = self.chunked.iter().map(|(name, len, range)| {
            let at = Placement::Chunks(chunks[range.clone()].to_vec());
            ((*name).to_owned(), BlobRef { len: *len, at })
        });
        let packed = self.packed_at.iter().map(|&(name, len, offset)| {
            let at = Placement::Packed { offset };
            (name.to_owned(), BlobRef { len, at })
        });
        chunked.chain(packed).collect()
    }

    /// The step's summary record, given the bytes the commit wrote.
    pub(crate) fn summary(&self, bytes_written: u64) -> StepSummary {
        StepSummary {
            step: self.source.step(),
            timestamp: self.source.timestamp(),
            loss_cid: self.source.loss_cid().map(str::to_owned),
            metrics: self.source.metrics().clone(),
            logical_bytes: self.logical_bytes(),
            bytes_written,
            stored_bytes: bytes_written,
            blobs: self.source.blob_count() + self.streamed.iter().filter(|s| !s.typed).count(),
            save_record: self.source.save_record().clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::layout::{chunk_lengths, CHUNK_SIZE};
    use crate::{ComputationGraphStore, GradientCheckpoint};

    #[test]
    fn small_blobs_are_packed_and_large_ones_chunked_in_name_order() {
        let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 7);
        c.set_optimizer_state("b_small", vec![1; 10]);
        c.set_optimizer_state("a_small", vec![2; PACK_BELOW - 1]);
        c.set_optimizer_state("z_large", vec![3; CHUNK_SIZE + 5]);
        c.set_optimizer_state("m_edge", vec![4; PACK_BELOW]);
        let plan = Plan::new(&c);
        assert_eq!(plan.packed.len(), PACK_BELOW - 1 + 10);
        assert_eq!(plan.packed[0], 2, "a_small comes first");
        let lens: Vec<usize> = chunk_lengths(PACK_BELOW)
            .chain(chunk_lengths(CHUNK_SIZE + 5))
            .collect();
        assert_eq!(
            plan.pieces.iter().map(|p| p.len()).collect::<Vec<_>>(),
            lens
        );
        assert_eq!(plan.chunk_bytes(), PACK_BELOW + CHUNK_SIZE + 5);

        let refs: Vec<ChunkRef> = (0..plan.pieces.len() as u64)
            .map(|id| ChunkRef { hash: [0; 32], id })
            .collect();
        let placed = plan.placements(&refs);
        assert_eq!(placed.len(), 4);
        assert_eq!(placed["a_small"].at, Placement::Packed { offset: 0 });
        assert_eq!(
            placed["b_small"].at,
            Placement::Packed {
                offset: PACK_BELOW as u64 - 1
            }
        );
        let Placement::Chunks(edge) = &placed["m_edge"].at else {
            panic!("m_edge is chunked");
        };
        assert_eq!(edge[0].id, 0);
        let Placement::Chunks(large) = &placed["z_large"].at else {
            panic!("z_large is chunked");
        };
        assert_eq!(large.first().map(|c| c.id), Some(edge.len() as u64));
        assert_eq!(placed["z_large"].len, CHUNK_SIZE as u64 + 5);
        let packed = plan.packed_ref().expect("two blobs are packed");
        assert_eq!(packed.hash, *blake3::hash(&plan.packed).as_bytes());
    }

    #[test]
    fn an_empty_checkpoint_plans_nothing() {
        let c = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
        let plan = Plan::new(&c);
        assert!(plan.pieces.is_empty() && plan.packed.is_empty());
        assert!(plan.packed_ref().is_none());
        assert!(plan.placements(&[]).is_empty());
        assert_eq!(plan.summary(0).blobs, 0);
    }
}
