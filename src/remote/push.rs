//! `CheckpointStore::push`: upload every committed step the bucket lacks.
//!
//! Per step, in order: the chunks the bucket lacks (in parallel), then the
//! manifest, then the commit object. A step is visible in the bucket only
//! once its commit is there, and a rerun after any failure skips what
//! landed: chunks are listed first, and a step whose commit exists is done.

use std::collections::{BTreeMap, HashSet};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectStoreExt, PutPayload};

use super::layout::{canonical, RemoteBlob, RemoteManifest, RemotePacked, MANIFEST_FORMAT};
use super::Remote;
use crate::engine::StepData;
use crate::format::layout::{split, PACK_BELOW};
use crate::format::manifest::{hex, Hash};
use crate::{CheckpointStore, Error, GradientCheckpoint, Result, StepInfo};

/// Uploads in flight at once.
pub(crate) const UPLOADS_IN_FLIGHT: usize = 8;

/// What [`CheckpointStore::push`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PushReport {
    /// Steps uploaded by this push, ascending.
    pub steps_pushed: Vec<u64>,
    /// Steps the bucket had already.
    pub steps_present: u64,
    /// Bytes of chunks uploaded.
    pub bytes_uploaded: u64,
    /// Bytes of chunks not uploaded because the bucket had them.
    pub bytes_skipped: u64,
    /// Chunk objects uploaded.
    pub chunks_uploaded: u64,
}

impl CheckpointStore {
    /// Upload every committed step `remote` lacks, deduplicated by content
    /// against everything in the bucket. Idempotent and resumable: rerun
    /// after any failure or kill, it finishes the job without uploading
    /// again what landed.
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Remote};
    /// # let dir = tempfile::tempdir()?;
    /// let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
    /// ckpt.set_optimizer_state("adam_m", vec![7u8; 1 << 20]);
    /// store.commit(&ckpt)?;
    ///
    /// let bucket = dir.path().join("bucket");
    /// let remote = Remote::open(&format!("file://{}", bucket.display()))?;
    /// let report = store.push(&remote)?;
    /// assert_eq!(report.steps_pushed, vec![1]);
    /// assert_eq!(store.push(&remote)?.steps_present, 1); // nothing to do
    /// assert_eq!(remote.get(1)?, Some(ckpt));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Remote`] when the bucket cannot be reached or refuses a
    /// request (after bounded retries); store errors as for reads.
    pub fn push(&self, remote: &Remote) -> Result<PushReport> {
        let mut report = PushReport::default();
        let committed = remote.commits()?;
        let mut present: HashSet<Hash> = remote.chunk_hashes()?;
        for step in self.steps()? {
            let pushed = self.with_step(step, |ckpt, info, data| {
                let manifest = remote_manifest(
                    &ckpt,
                    &info,
                    data,
                    &mut |hash, bytes| {
                        if present.contains(&hash) {
                            report.bytes_skipped += bytes.len() as u64;
                            return false;
                        }
                        present.insert(hash);
                        report.bytes_uploaded += bytes.len() as u64;
                        report.chunks_uploaded += 1;
                        true
                    },
                    remote,
                )?;
                let bytes = serde_json::to_vec(&manifest).map_err(|e| Error::Json {
                    path: None,
                    source: Box::new(e),
                })?;
                let hash = *blake3::hash(&bytes).as_bytes();
                if committed.iter().any(|c| c.step == step && c.hash == hash) {
                    return Ok(false);
                }
                remote.put(&remote.layout.manifest(step, &hash), bytes)?;
                let commit = super::commit_body(step, &hash);
                remote.put(&remote.layout.commit(step, &hash), commit)?;
                Ok(true)
            })?;
            match pushed {
                Some(true) => report.steps_pushed.push(step),
                Some(false) => report.steps_present += 1,
                None => {} // removed since it was listed
            }
        }
        Ok(report)
    }
}

/// Upload the chunks of one step that `wanted` says the bucket lacks, and
/// return its manifest.
fn remote_manifest(
    ckpt: &GradientCheckpoint,
    info: &StepInfo,
    data: &StepData<'_>,
    wanted: &mut dyn FnMut(Hash, &[u8]) -> bool,
    remote: &Remote,
) -> Result<RemoteManifest> {
    let mut blobs = BTreeMap::new();
    let mut packed = Vec::new();
    for name in data.names() {
        let bytes = data.read(&name)?.unwrap_or_default();
        let typed = info.tensors.get(&name);
        let mut blob = RemoteBlob {
            len: bytes.len() as u64,
            chunks: None,
            offset: None,
            dtype: typed.map(|t| t.dtype.name().to_owned()),
            shape: typed.map(|t| t.shape.clone()),
        };
        if bytes.len() < PACK_BELOW {
            blob.offset = Some(packed.len() as u64);
            packed.extend_from_slice(&bytes);
        } else {
            let bytes = Bytes::from(bytes);
            let mut hashes = Vec::new();
            let mut uploads = Vec::new();
            let mut at = 0;
            for piece in split(&bytes) {
                let hash = *blake3::hash(piece).as_bytes();
                hashes.push(hex(&hash));
                if wanted(hash, piece) {
                    uploads.push((hash, bytes.slice(at..at + piece.len())));
                }
                at += piece.len();
            }
            remote.put_chunks(uploads)?;
            blob.chunks = Some(hashes);
        }
        blobs.insert(name, blob);
    }
    let packed = if packed.is_empty() {
        None
    } else {
        let hash = *blake3::hash(&packed).as_bytes();
        if wanted(hash, &packed) {
            remote.put_chunks(vec![(hash, Bytes::from(packed.clone()))])?;
        }
        Some(RemotePacked {
            len: packed.len() as u64,
            hash: hex(&hash),
        })
    };
    let graph = serde_json::to_value(&ckpt.graph).map_err(|e| Error::Json {
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

impl Remote {
    /// Upload chunks, several at a time.
    pub(crate) fn put_chunks(&self, chunks: Vec<(Hash, Bytes)>) -> Result<()> {
        let store = &self.store;
        let layout = &self.layout;
        self.block_on("uploading chunks to", async {
            futures::stream::iter(chunks)
                .map(|(hash, bytes)| async move {
                    store
                        .put(&layout.chunk(&hash), PutPayload::from_bytes(bytes))
                        .await
                        .map(|_| ())
                })
                .buffer_unordered(UPLOADS_IN_FLIGHT)
                .try_collect::<()>()
                .await
        })
    }
}
