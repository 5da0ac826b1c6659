//! A step's chunk map: where its entries lie in its chunks, as a rank that
//! does not hold the step learns it from one that does, to check the bytes
//! that rank hands it. The map travels as the step's manifest, encoded as
//! stored (its own BLAKE3 checked on decoding), and is taken only if the
//! manifest is of the save the receiver expects (its content digest).

use super::CheckpointStore;
use crate::engine::slices::ChunkSlice;
use crate::engine::Placing;
use crate::format::manifest::{decode_manifest, hex, Manifest};
use crate::{ContentDigest, Error, Result};

/// Where the entries of one save of a step lie in its chunks
/// ([`ChunkMap::slices`]), decoded from what
/// [`CheckpointStore::chunk_map`] gave on another rank and checked against
/// the save's [`ContentDigest`].
///
/// ```
/// # use ckptstore::{CheckpointStore, ChunkMap, ComputationGraphStore, Dtype, GradientCheckpoint, Tensor};
/// # let dir = tempfile::tempdir()?;
/// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
/// let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
/// c.set_tensor("w", Tensor::new(Dtype::U8, vec![3000], vec![7; 3000])?);
/// store.commit(&c)?;
/// let digest = store.content_digest(1)?.unwrap();
/// let sent = store.chunk_map(1, Some(&digest))?.unwrap();
/// let map = ChunkMap::decode(1, &sent, &digest)?;
/// assert_eq!(map.slices("w", 10, 100)?, store.slices(1, None, &[("w", 10, 100)])?.unwrap()[0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct ChunkMap {
    manifest: Manifest,
}

impl ChunkMap {
    /// The chunk map of step `step` in `bytes`, if it is of the save
    /// `digest` names.
    ///
    /// # Errors
    /// [`Error::Corrupt`] naming the step when `bytes` do not decode (a
    /// damaged map fails its hash), are of another step, or are of another
    /// save of it (another content digest).
    pub fn decode(step: u64, bytes: &[u8], digest: &ContentDigest) -> Result<ChunkMap> {
        let manifest = decode_manifest(step, bytes)?;
        if manifest.step != step {
            return Err(Error::corrupt(
                Some(step),
                format!("the chunk map sent is of step {}", manifest.step),
            ));
        }
        let got = manifest.content_digest();
        if got != digest.0 {
            return Err(Error::corrupt(
                Some(step),
                format!(
                    "the chunk map sent is of another save (content digest {}, not {digest})",
                    hex(&got)
                ),
            ));
        }
        Ok(ChunkMap { manifest })
    }

    /// Where bytes `start..start + len` of entry `name` lie in the save's
    /// chunks, in order: as [`CheckpointStore::slices`] gives them where
    /// the save is stored.
    ///
    /// # Errors
    /// [`Error::RangeNotStored`] for an entry the save does not have or
    /// bytes past its end.
    pub fn slices(&self, name: &str, start: u64, len: u64) -> Result<Vec<ChunkSlice>> {
        let placing = Placing {
            step: self.manifest.step,
            blobs: &self.manifest.blobs,
            packed: self.manifest.packed.as_ref(),
        };
        placing.slices(name, start, len)
    }
}

impl CheckpointStore {
    /// The chunk map of `step` as bytes to send to a rank that does not
    /// hold it ([`ChunkMap::decode`]); `None` if the step is not stored
    /// or, `digest` given, is another save of it.
    ///
    /// # Errors
    /// [`Error::Corrupt`] when the step's manifest is damaged; as any read.
    pub fn chunk_map(&self, step: u64, digest: Option<&ContentDigest>) -> Result<Option<Vec<u8>>> {
        let what = || format!("reading step {step}");
        self.db.read_retrying(&what, |view| {
            Ok(view.manifest_bytes(step)?.and_then(|(manifest, bytes)| {
                super::ranges::is_save(&manifest, digest).then_some(bytes)
            }))
        })
    }
}
