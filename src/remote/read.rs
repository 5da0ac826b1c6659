//! Listing and restoring steps from the bucket alone: a step counts only
//! when its commit names a manifest that is there, hashes right, and names
//! only chunks the bucket holds; every chunk read is hash-checked.

use std::collections::HashSet;

use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;

use super::layout::{parse_hex, RemoteManifest, MANIFEST_FORMAT};
use super::push::UPLOADS_IN_FLIGHT;
use super::{Commit, Remote};
use crate::format::layout::packed_slice;
use crate::format::manifest::{hex, Hash};
use crate::{CheckpointStore, CommitInfo, Dtype, Error, GradientCheckpoint, Result, Tensor};

impl Remote {
    /// The complete steps in the bucket, ascending.
    pub fn steps(&self) -> Result<Vec<u64>> {
        let chunks = self.chunk_hashes()?;
        let mut steps = Vec::new();
        for c in self.commits()? {
            if steps.last() != Some(&c.step) && self.checked_manifest(c, Some(&chunks))?.is_some() {
                steps.push(c.step);
            }
        }
        Ok(steps)
    }

    /// The newest complete step, skipping any whose objects are missing or
    /// damaged.
    pub fn latest_step(&self) -> Result<Option<u64>> {
        let commits = self.commits()?;
        if commits.is_empty() {
            return Ok(None);
        }
        let chunks = self.chunk_hashes()?;
        for c in commits.iter().rev() {
            if self.checked_manifest(*c, Some(&chunks))?.is_some() {
                return Ok(Some(c.step));
            }
        }
        Ok(None)
    }

    /// Step `step`, restored from the bucket with every chunk hash-checked,
    /// or `None` if the bucket has no complete copy of it.
    ///
    /// # Errors
    /// [`Error::Corrupt`] when a chunk is missing or fails its hash check
    /// (naming the URL); [`Error::Remote`] when the bucket fails.
    pub fn get(&self, step: u64) -> Result<Option<GradientCheckpoint>> {
        let commits: Vec<Commit> = self
            .commits()?
            .into_iter()
            .filter(|c| c.step == step)
            .collect();
        for c in commits.iter().rev() {
            if let Some(m) = self.checked_manifest(*c, None)? {
                return self.assemble(m).map(Some);
            }
        }
        Ok(None)
    }

    /// Copy step `step` from the bucket into `store` (one commit there).
    ///
    /// # Errors
    /// [`Error::StepsNotFound`] when the bucket has no complete copy of it;
    /// as [`get`](Self::get) and [`CheckpointStore::commit`].
    pub fn pull(&self, step: u64, store: &CheckpointStore) -> Result<CommitInfo> {
        let ckpt = self
            .get(step)?
            .ok_or(Error::StepsNotFound { steps: vec![step] })?;
        store.commit(&ckpt)
    }

    /// The manifest `commit` names, if it is there, hashes right, is one
    /// this build reads, and (given the bucket's chunks) names only chunks
    /// that are there.
    fn checked_manifest(
        &self,
        commit: Commit,
        chunks: Option<&HashSet<Hash>>,
    ) -> Result<Option<RemoteManifest>> {
        let key = self.layout.manifest(commit.step, &commit.hash);
        let Some(bytes) = self.get_bytes(&key)? else {
            return Ok(None);
        };
        if blake3::hash(&bytes).as_bytes() != &commit.hash {
            return Ok(None);
        }
        let Ok(m) = serde_json::from_slice::<RemoteManifest>(&bytes) else {
            return Ok(None);
        };
        if m.format != MANIFEST_FORMAT || m.step != commit.step {
            return Ok(None);
        }
        if let Some(chunks) = chunks {
            let mut named = m
                .blobs
                .values()
                .flat_map(|b| b.chunks.iter().flatten())
                .chain(m.packed.iter().map(|p| &p.hash));
            if !named.all(|h| parse_hex(h).is_some_and(|h| chunks.contains(&h))) {
                return Ok(None);
            }
        }
        Ok(Some(m))
    }

    /// Chunks `hashes` (hex), fetched several at a time, checked, in order.
    fn fetch(&self, step: u64, what: &str, hashes: &[String]) -> Result<Vec<u8>> {
        let corrupt = |detail: String| Error::corrupt(Some(step), detail);
        let mut parsed = Vec::with_capacity(hashes.len());
        for h in hashes {
            parsed.push(
                parse_hex(h).ok_or_else(|| corrupt(format!("{what}: bad chunk name {h:?}")))?,
            );
        }
        let store = &self.store;
        let layout = &self.layout;
        let pieces: Vec<bytes::Bytes> = self.block_on("reading chunks from", async {
            futures::stream::iter(parsed.iter())
                .map(|hash| async move {
                    let got = store.get(&layout.chunk(hash)).await?;
                    got.bytes().await
                })
                .buffered(UPLOADS_IN_FLIGHT)
                .try_collect()
                .await
        })?;
        let mut data = Vec::with_capacity(pieces.iter().map(bytes::Bytes::len).sum());
        for (piece, hash) in pieces.iter().zip(&parsed) {
            if blake3::hash(piece).as_bytes() != hash {
                return Err(corrupt(format!(
                    "{what}: chunk {} in {} fails its hash check",
                    hex(hash),
                    self.url
                )));
            }
            data.extend_from_slice(piece);
        }
        Ok(data)
    }

    fn assemble(&self, m: RemoteManifest) -> Result<GradientCheckpoint> {
        let step = m.step;
        let corrupt = |detail: String| Error::corrupt(Some(step), detail);
        let graph = serde_json::from_value(m.graph).map_err(|e| Error::Json {
            path: None,
            source: Box::new(e),
        })?;
        let mut ckpt = GradientCheckpoint::new(graph, step);
        ckpt.timestamp = m.timestamp;
        ckpt.loss_cid = m.loss_cid;
        ckpt.metrics = m.metrics;
        let packed = match &m.packed {
            Some(p) => self.fetch(step, "packed blobs", std::slice::from_ref(&p.hash))?,
            None => Vec::new(),
        };
        for (name, blob) in m.blobs {
            let data = match (&blob.chunks, blob.offset) {
                (Some(hashes), None) => self.fetch(step, &name, hashes)?,
                (None, Some(offset)) => packed_slice(&packed, offset, blob.len)
                    .ok_or_else(|| corrupt(format!("blob {name:?} is outside the packed bytes")))?
                    .to_vec(),
                _ => return Err(corrupt(format!("blob {name:?} has no place"))),
            };
            if data.len() as u64 != blob.len {
                return Err(corrupt(format!("blob {name:?} has the wrong length")));
            }
            match (blob.dtype, blob.shape) {
                (Some(dtype), Some(shape)) => {
                    let dtype = Dtype::from_name(&dtype).ok_or_else(|| {
                        corrupt(format!("tensor {name:?}: unknown dtype {dtype}"))
                    })?;
                    ckpt.set_tensor(name, Tensor::new(dtype, shape, data)?);
                }
                _ => ckpt.set_optimizer_state(name, data),
            }
        }
        Ok(ckpt)
    }
}
