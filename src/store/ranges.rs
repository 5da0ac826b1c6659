//! Reading a step in byte ranges: only the chunks holding them, each
//! checked; where the ranges lie in the chunks, and the proofs a rank
//! handing them on sends with them.

use super::CheckpointStore;
use crate::engine::slices::ChunkSlice;
use crate::engine::StepData;
use crate::format::manifest::Manifest;
use crate::{ContentDigest, Result};

impl CheckpointStore {
    /// Bytes of `step`'s tensors and blobs by range, from one read
    /// transaction: each `(name, start, out)` of `reads` is filled with
    /// bytes `start..start + out.len()` of entry `name`. Only the chunks
    /// holding those bytes are read, each hash-checked before its bytes
    /// reach `out`, so a step can be read in pieces of any size without
    /// holding it whole. `Ok(false)` (nothing filled) if the step is not
    /// stored or, `digest` given, if its [`content_digest`](Self::content_digest)
    /// is another (another save of the step). An entry the step does not
    /// store, or bytes beyond an entry's end, are
    /// [`Error::RangeNotStored`](crate::Error::RangeNotStored).
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, Dtype, GradientCheckpoint, Tensor};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
    /// c.set_tensor("w", Tensor::new(Dtype::U8, vec![4], vec![1, 2, 3, 4])?);
    /// store.commit(&c)?;
    /// let mut two = [0u8; 2];
    /// assert!(store.read_ranges(1, None, &mut [("w", 1, &mut two[..])])?);
    /// assert_eq!(two, [2, 3]);
    /// assert!(!store.read_ranges(2, None, &mut [("w", 1, &mut two[..])])?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn read_ranges(
        &self,
        step: u64,
        digest: Option<&ContentDigest>,
        reads: &mut [(&str, u64, &mut [u8])],
    ) -> Result<bool> {
        Ok(self
            .read_ranges_proving(step, digest, reads, &[])?
            .is_some())
    }

    /// Where bytes of `step`'s entries lie in the store's chunks: for each
    /// `(name, start, len)` of `ranges`, its slices in order (a chunk of
    /// the entry, or the packed bytes the step's small entries share).
    /// A rank handed those bytes by another checks them against the
    /// chunks' hashes with the proofs [`read_ranges_proving`](Self::read_ranges_proving)
    /// makes ([`SliceCheck`](crate::SliceCheck)). `None` as
    /// [`read_ranges`](Self::read_ranges) gives `false`.
    ///
    /// # Errors
    /// As [`read_ranges`](Self::read_ranges).
    pub fn slices(
        &self,
        step: u64,
        digest: Option<&ContentDigest>,
        ranges: &[(&str, u64, u64)],
    ) -> Result<Option<Vec<Vec<ChunkSlice>>>> {
        self.with_ranges(step, digest, |data| {
            ranges
                .iter()
                .map(|&(name, start, len)| data.slices(name, start, len))
                .collect()
        })
    }

    /// [`read_ranges`](Self::read_ranges), and for each `(name, start,
    /// len)` of `proved` the proofs of its [`slices`](Self::slices), back
    /// to back ([`slice_proof`](crate::slice_proof)), made from checked
    /// bytes (those `reads` hold, else the chunk read and checked again):
    /// what a rank handing those bytes on sends with them. `None` (nothing
    /// filled) as [`read_ranges`](Self::read_ranges) gives `false`.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, Dtype, GradientCheckpoint, SliceCheck, Tensor};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
    /// c.set_tensor("w", Tensor::new(Dtype::U8, vec![3000], vec![7; 3000])?);
    /// store.commit(&c)?;
    /// let mut bytes = [0u8; 1000];
    /// let proofs = store
    ///     .read_ranges_proving(1, None, &mut [("w", 1500, &mut bytes[..])], &[("w", 1500, 1000)])?
    ///     .unwrap();
    /// let slice = store.slices(1, None, &[("w", 1500, 1000)])?.unwrap()[0][0];
    /// let mut check = SliceCheck::new(slice.hash, slice.len, slice.a, slice.b, &proofs[0])?;
    /// check.update(&bytes);
    /// assert!(check.finish());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// As [`read_ranges`](Self::read_ranges).
    pub fn read_ranges_proving(
        &self,
        step: u64,
        digest: Option<&ContentDigest>,
        reads: &mut [(&str, u64, &mut [u8])],
        proved: &[(&str, u64, u64)],
    ) -> Result<Option<Vec<Vec<u8>>>> {
        self.with_ranges(step, digest, |data| {
            for (name, start, out) in reads.iter_mut() {
                if !data.read_range_into(name, *start, out)? {
                    return Err(crate::Error::RangeNotStored {
                        step,
                        detail: format!("it stores no entry {name:?}"),
                    });
                }
            }
            let have: Vec<(&str, u64, &[u8])> =
                reads.iter().map(|(n, s, o)| (*n, *s, &**o)).collect();
            data.proofs(proved, &have)
        })
    }

    /// `f` on the data of `step` in one read transaction (retried as
    /// reads are); `None` if the step is not stored or, `digest` given, is
    /// another save of it.
    fn with_ranges<T>(
        &self,
        step: u64,
        digest: Option<&ContentDigest>,
        mut f: impl FnMut(&StepData<'_>) -> Result<T>,
    ) -> Result<Option<T>> {
        let what = || format!("reading step {step}");
        self.db.read_retrying(&what, |view| {
            let Some(manifest) = view.manifest(step)? else {
                return Ok(None);
            };
            if !is_save(&manifest, digest) {
                return Ok(None);
            }
            let packed = manifest.packed.clone();
            let (_, blobs, _) = manifest.into_parts();
            f(&view.step_data(step, packed, blobs)?).map(Some)
        })
    }
}

/// Whether `manifest` is of the save `digest` names (any save without one).
pub(super) fn is_save(manifest: &Manifest, digest: Option<&ContentDigest>) -> bool {
    digest.is_none_or(|d| d.0 == manifest.content_digest())
}
