//! Listing and restoring steps from the bucket alone: a step counts only
//! when its commit names a manifest that is there, hashes right, and names
//! only chunks the bucket holds; every chunk read is hash-checked.

use std::collections::{BTreeMap, HashSet};

use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;

use super::layout::{parse_hex, RemoteManifest};
use super::push::UPLOADS_IN_FLIGHT;
use super::step::{new_bytes, StepManifest};
use super::{Commit, Remote};
use crate::format::layout::packed_slice;
use crate::format::manifest::{hex, Hash};
use crate::{
    CheckpointStore, CommitInfo, ComputationGraphStore, Dtype, Error, GradientCheckpoint, Result,
    StepInfo, StepSummary, Tensor, TensorInfo,
};

impl Remote {
    /// The complete steps in the bucket, ascending.
    pub fn steps(&self) -> Result<Vec<u64>> {
        Ok(self.complete()?.iter().map(|(c, _)| c.step).collect())
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
    /// (naming the URL); [`Error::Remote`] when the bucket fails;
    /// [`Error::ShardedStep`] for a global step of several ranks (read its
    /// shards with [`get_shard`](Self::get_shard)).
    pub fn get(&self, step: u64) -> Result<Option<GradientCheckpoint>> {
        self.get_with(step, &mut |_, _| {})
    }

    /// [`get`](Self::get), calling `progress(bytes_fetched, bytes_total)`
    /// as chunks arrive (for progress bars).
    pub fn get_with(
        &self,
        step: u64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Option<GradientCheckpoint>> {
        let commits: Vec<Commit> = self
            .commits()?
            .into_iter()
            .filter(|c| c.step == step)
            .collect();
        for c in commits.iter().rev() {
            let Some(m) = self.checked_manifest(*c, None)? else {
                continue;
            };
            let m = single(step, m)?;
            let total = m
                .blobs
                .values()
                .filter(|b| b.chunks.is_some())
                .map(|b| b.len)
                .sum::<u64>()
                + m.packed.as_ref().map_or(0, |p| p.len);
            let mut fetched = 0;
            match self.assemble(m, &mut |n| {
                fetched += n;
                progress(fetched, total);
            }) {
                Ok(ckpt) => return Ok(Some(ckpt)),
                // Retention may have deleted the step while it was read.
                Err(e @ Error::Corrupt { .. }) if !self.commits()?.contains(c) => drop(e),
                Err(e) => return Err(e),
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
        self.pull_with(step, store, &mut |_, _| {})
    }

    /// [`pull`](Self::pull), with progress as for [`get_with`](Self::get_with).
    pub fn pull_with(
        &self,
        step: u64,
        store: &CheckpointStore,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<CommitInfo> {
        let ckpt = self
            .get_with(step, progress)?
            .ok_or(Error::StepsNotFound { steps: vec![step] })?;
        store.commit(&ckpt)
    }

    /// The summaries (time, loss CID, metrics, sizes) of the complete
    /// steps, ascending, from their manifests.
    /// `bytes_written` is what each step added to the bucket: its chunks
    /// that no earlier step there has.
    pub fn summaries(&self) -> Result<Vec<StepSummary>> {
        let mut seen = HashSet::new();
        let complete = self.complete()?;
        let summaries = complete.iter().map(|(_, m)| {
            let mut s = m.summary();
            s.bytes_written = m.parts().iter().map(|p| new_bytes(p, &mut seen)).sum();
            s
        });
        Ok(summaries.collect())
    }

    /// Step `step`'s metadata, from its manifest (no chunk is read), or
    /// `None` if the bucket has no complete copy of it.
    ///
    /// # Errors
    /// [`Error::ShardedStep`] for a global step of several ranks (see
    /// [`get_shard`](Self::get_shard)).
    pub fn info(&self, step: u64) -> Result<Option<StepInfo>> {
        let Some((_, m)) = self.complete()?.into_iter().find(|(c, _)| c.step == step) else {
            return Ok(None);
        };
        let m = single(step, m)?;
        let corrupt = |detail: String| Error::corrupt(Some(step), detail);
        let graph: ComputationGraphStore =
            serde_json::from_value(m.graph).map_err(|e| Error::Json {
                path: None,
                source: Box::new(e),
            })?;
        let mut info = StepInfo {
            step,
            timestamp: m.timestamp,
            loss_cid: m.loss_cid,
            metrics: m.metrics,
            node_count: graph.node_count(),
            edge_count: graph.edge_count(),
            blobs: BTreeMap::new(),
            tensors: BTreeMap::new(),
        };
        for (name, blob) in m.blobs {
            if let (Some(dtype), Some(shape)) = (blob.dtype, blob.shape) {
                let dtype = Dtype::from_name(&dtype)
                    .ok_or_else(|| corrupt(format!("tensor {name:?}: unknown dtype {dtype}")))?;
                let t = TensorInfo {
                    dtype,
                    shape,
                    bytes: blob.len,
                };
                info.tensors.insert(name, t);
            } else {
                info.blobs.insert(name, blob.len);
            }
        }
        Ok(Some(info))
    }

    /// The chunks `wanted` (each with the blob it belongs to, for errors),
    /// fetched several at a time and hash-checked, in order; `progress`
    /// gets each one's length as it arrives.
    fn fetch(
        &self,
        step: u64,
        wanted: &[(&str, Hash)],
        progress: &mut dyn FnMut(u64),
    ) -> Result<Vec<bytes::Bytes>> {
        let (store, layout, url) = (&self.store, &self.layout, &self.url);
        let corrupt = |detail: String| Error::corrupt(Some(step), detail);
        let mut fetches = futures::stream::iter(wanted)
            .map(|(what, hash)| async move {
                let got = match store.get(&layout.chunk(hash)).await {
                    Ok(got) => got.bytes().await,
                    Err(e) => Err(e),
                };
                let piece = got.map_err(|e| match e {
                    object_store::Error::NotFound { .. } => {
                        corrupt(format!("{what}: chunk {} is missing from {url}", hex(hash)))
                    }
                    e => super::remote_error(url, "reading chunks from", e),
                })?;
                if blake3::hash(&piece).as_bytes() != hash {
                    return Err(corrupt(format!(
                        "{what}: chunk {} in {url} fails its hash check",
                        hex(hash)
                    )));
                }
                Ok(piece)
            })
            .buffered(UPLOADS_IN_FLIGHT);
        let mut pieces = Vec::with_capacity(wanted.len());
        // `progress` runs outside the runtime, free to block.
        while let Some(piece) = self.runtime.block_on(fetches.try_next())? {
            progress(piece.len() as u64);
            pieces.push(piece);
        }
        Ok(pieces)
    }

    /// Fetch every chunk `m` names (several at a time) and build the step.
    pub(super) fn assemble(
        &self,
        m: RemoteManifest,
        progress: &mut dyn FnMut(u64),
    ) -> Result<GradientCheckpoint> {
        let step = m.step;
        let corrupt = |detail: String| Error::corrupt(Some(step), detail);
        let parse = |what: &str, h: &str| {
            parse_hex(h).ok_or_else(|| corrupt(format!("{what}: bad chunk name {h:?}")))
        };
        let mut wanted: Vec<(&str, Hash)> = Vec::new();
        if let Some(p) = &m.packed {
            wanted.push(("packed blobs", parse("packed blobs", &p.hash)?));
        }
        for (name, blob) in &m.blobs {
            for h in blob.chunks.iter().flatten() {
                wanted.push((name, parse(name, h)?));
            }
        }
        let mut pieces = self.fetch(step, &wanted, progress)?.into_iter();
        drop(wanted);
        let packed = match &m.packed {
            Some(_) => pieces.next().map(|p| p.to_vec()).unwrap_or_default(),
            None => Vec::new(),
        };
        let graph = serde_json::from_value(m.graph).map_err(|e| Error::Json {
            path: None,
            source: Box::new(e),
        })?;
        let mut ckpt = GradientCheckpoint::new(graph, step);
        ckpt.timestamp = m.timestamp;
        ckpt.loss_cid = m.loss_cid;
        ckpt.metrics = m.metrics;
        for (name, blob) in m.blobs {
            let data = match (&blob.chunks, blob.offset) {
                (Some(hashes), None) => {
                    let mut data = Vec::with_capacity(usize::try_from(blob.len).unwrap_or(0));
                    for piece in pieces.by_ref().take(hashes.len()) {
                        data.extend_from_slice(&piece);
                    }
                    data
                }
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

/// The one manifest of a step, which may be a global step of one rank.
fn single(step: u64, m: StepManifest) -> Result<RemoteManifest> {
    match m {
        StepManifest::Single(m) => Ok(m),
        StepManifest::Sharded { mut shards, ids } if shards.len() == 1 => {
            drop(ids);
            Ok(shards.remove(0))
        }
        StepManifest::Sharded { shards, .. } => Err(Error::ShardedStep {
            step,
            world_size: u32::try_from(shards.len()).unwrap_or(u32::MAX),
        }),
    }
}
