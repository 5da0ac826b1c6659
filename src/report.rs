//! What operations report: a commit, a step's metadata, the store's
//! figures, a verification.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::{Dtype, Error};

/// What a commit did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CommitInfo {
    /// The step committed.
    pub step: u64,
    /// Bytes of optimizer state in the checkpoint.
    pub logical_bytes: u64,
    /// Blob bytes this commit wrote as new chunks.
    pub bytes_written: u64,
    /// Blob bytes already stored and referenced instead of written.
    pub bytes_reused: u64,
    /// Chunks written.
    pub chunks_written: u64,
    /// Chunks referenced without writing.
    pub chunks_reused: u64,
    /// Chunks written again because the pack file that held them was
    /// missing or not whole: the commit healed the store rather than point
    /// at bytes that are gone. Steps that already used such a chunk read it
    /// from its new place. Counted among `chunks_written` (a commit that
    /// stages its chunks in parts first writes them as it stages, and
    /// counts them among `chunks_reused`).
    pub chunks_healed: u64,
    /// Bytes of the step's manifest (graph and metadata).
    pub manifest_bytes: u64,
    /// Blob bytes freed: of the step this commit replaced, and of the steps
    /// the retention policy removed.
    pub bytes_freed: u64,
    /// Steps the store's retention policy removed in the same transaction.
    pub removed: Vec<u64>,
    /// Wall time of the whole commit, hashing and fsync included.
    pub duration: Duration,
}

/// A step's metadata, read without its blobs.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct StepInfo {
    /// The step number.
    pub step: u64,
    /// Unix time in seconds of the checkpoint.
    pub timestamp: u64,
    /// CID of the loss tensor.
    pub loss_cid: Option<String>,
    /// Named metrics.
    pub metrics: BTreeMap<String, f64>,
    /// Nodes in the computation graph.
    pub node_count: usize,
    /// Edges in the computation graph.
    pub edge_count: usize,
    /// Each optimizer blob's length in bytes, by name.
    pub blobs: BTreeMap<String, u64>,
    /// Each tensor's dtype and shape, by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// How the step was saved (left out of its serde form when empty).
    #[serde(skip_serializing_if = "crate::SaveRecord::is_empty")]
    pub save_record: crate::SaveRecord,
}

impl StepInfo {
    /// The metadata of the step `skeleton` (a checkpoint without blob or
    /// tensor data) whose blobs and tensors are `entries`: the one place a
    /// `StepInfo` is built, from a store's manifest or a bucket's.
    pub(crate) fn of(
        skeleton: &crate::GradientCheckpoint,
        entries: impl IntoIterator<Item = crate::checkpoint::Incoming>,
    ) -> StepInfo {
        let mut info = StepInfo {
            step: skeleton.step,
            timestamp: skeleton.timestamp,
            loss_cid: skeleton.loss_cid.clone(),
            metrics: skeleton.metrics.clone(),
            node_count: skeleton.graph.node_count(),
            edge_count: skeleton.graph.edge_count(),
            blobs: BTreeMap::new(),
            tensors: BTreeMap::new(),
            save_record: skeleton.save_record.clone(),
        };
        for entry in entries {
            match entry.tensor {
                Some((dtype, shape)) => {
                    let t = TensorInfo {
                        dtype,
                        shape,
                        bytes: entry.len,
                    };
                    info.tensors.insert(entry.name, t);
                }
                None => {
                    info.blobs.insert(entry.name, entry.len);
                }
            }
        }
        info
    }
}

/// A stored tensor's type, without its data.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct TensorInfo {
    /// The element type.
    pub dtype: Dtype,
    /// The size of each dimension.
    pub shape: Vec<u64>,
    /// Bytes of data.
    pub bytes: u64,
}

/// The identity of a step's content, from
/// [`CheckpointStore::content_digest`](crate::CheckpointStore::content_digest):
/// a BLAKE3 hash, shown as 64 lowercase hex digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ContentDigest(pub(crate) [u8; 32]);

impl ContentDigest {
    /// The hash's 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The digest that `Display` shows as `hex`: 64 lowercase hex digits,
    /// or None.
    pub fn from_hex(hex: &str) -> Option<Self> {
        crate::hex::decode(hex).map(Self)
    }
}

impl std::fmt::Display for ContentDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&crate::hex::encode(&self.0))
    }
}

impl StepInfo {
    /// Total bytes of state: optimizer blobs and tensor data.
    pub fn logical_bytes(&self) -> u64 {
        self.blobs.values().sum::<u64>() + self.tensors.values().map(|t| t.bytes).sum::<u64>()
    }
}

/// What [`CheckpointStore::stats`](crate::CheckpointStore::stats) reports.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct StoreStats {
    /// Steps stored.
    pub steps: u64,
    /// Bytes of optimizer state over all steps, as if stored separately.
    pub logical_bytes: u64,
    /// Bytes of blob data actually stored: each chunk once, plus the
    /// packed small blobs of every step.
    pub stored_bytes: u64,
    /// Chunks stored.
    pub chunks: u64,
    /// Size of the store file (0 for a custom backend). redb grows the
    /// file in large steps, so this runs ahead of `allocated_bytes`.
    pub file_bytes: u64,
    /// Bytes of the file redb has allocated (pages in use, including pages
    /// freed by recent commits that are not reusable yet); 0 for a
    /// read-only store.
    pub allocated_bytes: u64,
    /// Pack files the store records
    /// ([`StoreOptions::pack_files`](crate::StoreOptions::pack_files)).
    pub pack_files: u64,
    /// Bytes of those pack files, dead chunks included (on disk beside
    /// `file_bytes`).
    pub pack_bytes: u64,
}

impl StoreStats {
    /// `logical_bytes / stored_bytes`: how many times over deduplication
    /// saves (1.0 with nothing shared or nothing stored).
    pub fn dedup_ratio(&self) -> f64 {
        if self.stored_bytes == 0 {
            1.0
        } else {
            self.logical_bytes as f64 / self.stored_bytes as f64
        }
    }
}

/// What [`CheckpointStore::verify`](crate::CheckpointStore::verify) found.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct VerifyReport {
    /// Steps whose manifest and every chunk checked out.
    pub steps_ok: u64,
    /// Blob bytes hashed and found good.
    pub bytes_checked: u64,
    /// Each damaged step with the first problem found in it.
    pub damaged: Vec<(u64, Error)>,
    /// Disagreements between the reference counts, the chunks and the
    /// manifests (checked when no step is damaged or gone).
    pub accounting: Vec<String>,
    /// Steps a writer in another process (or thread) removed, or whose
    /// chunks `compact` moved, while verification ran, after it had
    /// listed them: their pack files went, so they were not checked. Not
    /// damage.
    pub steps_gone: Vec<u64>,
    /// Chunks staged by a large commit still under way, used by no step
    /// yet (checked with the accounting). A commit that crashes leaves its
    /// staged chunks behind; the next writable open deletes them.
    pub staged_chunks: u64,
    /// Pack files the store records (see
    /// [`StoreOptions::pack_files`](crate::StoreOptions::pack_files)); each
    /// chunk in them was hashed with its steps, and each file's length and
    /// live bytes checked with the accounting.
    pub pack_files: u64,
    /// Bytes of the recorded pack files.
    pub pack_bytes: u64,
    /// Bytes of the recorded pack files that live chunks use (the rest
    /// [`CheckpointStore::compact`](crate::CheckpointStore::compact)
    /// reclaims once a file is half dead).
    pub pack_live_bytes: u64,
    /// Files in the pack directory that no record names and no commit
    /// under way can have written: made dead by a writer whose process
    /// died before deleting them, or not this store's (a file without a
    /// header, from before headers, or another store's). The next
    /// writable open deletes the ones whose header names this store; the
    /// rest are left where they are. Not damage.
    pub stray_pack_files: u64,
    /// Files in the pack directory of transactions that had not committed
    /// when verification began: a commit under way in a writer, or one
    /// killed before its commit (the next writable open deletes those).
    /// Not damage.
    pub in_flight_pack_files: u64,
    /// The stray files, settled by the store before it reports them.
    pub(crate) stray_packs: Vec<std::path::PathBuf>,
    /// Recorded pack files that were not there, settled by the store: a
    /// writer may have deleted them after verification began.
    pub(crate) missing_packs: Vec<(u32, String)>,
}

impl VerifyReport {
    /// True when nothing is damaged: no step in
    /// [`damaged`](Self::damaged), no problem in
    /// [`accounting`](Self::accounting). Steps gone, staged chunks, and
    /// stray or in-flight pack files are not damage.
    pub fn is_ok(&self) -> bool {
        self.damaged.is_empty() && self.accounting.is_empty()
    }

    /// Why [`is_ok`](Self::is_ok) is false, one line per problem (empty
    /// when it is true): each damaged step with its error, then each
    /// accounting problem.
    pub fn problems(&self) -> Vec<String> {
        self.damaged
            .iter()
            .map(|(step, e)| format!("step {step}: {e}"))
            .chain(self.accounting.iter().map(|p| format!("accounting: {p}")))
            .collect()
    }
}

#[cfg(feature = "remote")]
/// Where background replication stands
/// ([`CheckpointStore::replication_status`](crate::CheckpointStore::replication_status)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplicationStatus {
    /// The bucket's URL.
    pub url: String,
    /// Steps committed here that no push has confirmed in the bucket yet,
    /// ascending.
    pub pending: Vec<u64>,
    /// Whether a push is running now.
    pub running: bool,
    /// Steps uploaded since the store was opened.
    pub steps_uploaded: u64,
    /// Chunk bytes uploaded since the store was opened.
    pub bytes_uploaded: u64,
    /// Pushes that failed in a row (0 after a success).
    pub consecutive_failures: u32,
    /// The last failure, while failures go on; retried with backoff.
    pub last_error: Option<String>,
}
