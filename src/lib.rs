//! # ckptstore
//!
//! Transactional storage of training checkpoints in one embedded
//! [redb](https://docs.rs/redb) file.
//!
//! A training step — computation graph, step number, loss CID, optimizer
//! state blobs, timestamp, metrics — is committed in **one redb write
//! transaction** keyed by step: when [`CheckpointStore::commit`] returns the
//! step is complete and durable, and a crash before that leaves no trace of
//! it: no half-written checkpoints, nothing to clean up by hand.
//!
//! - Blobs of 64 KiB and more are stored as raw bytes in content-addressed
//!   chunks (BLAKE3): a chunk that did not change since an earlier step is
//!   referenced, not written again. Smaller blobs are packed together per
//!   step. Every chunk and every step's packed bytes are hash-checked when
//!   read.
//! - [`latest`](CheckpointStore::latest), [`get`](CheckpointStore::get),
//!   [`steps`](CheckpointStore::steps), [`steps_in`](CheckpointStore::steps_in),
//!   [`remove`](CheckpointStore::remove),
//!   [`rollback_to`](CheckpointStore::rollback_to),
//!   [`verify`](CheckpointStore::verify).
//! - [`commit_async`](CheckpointStore::commit_async) writes in the background
//!   behind a bounded queue, so training does not wait for the disk;
//!   [`commit_async_copy`](CheckpointStore::commit_async_copy) first copies
//!   state the caller keeps changing into buffers it recycles.
//! - [`Retention`] policies (keep last N, every N-th, one per interval, best
//!   K by a metric; pinned steps are kept) run with each commit or on demand;
//!   [`stats`](CheckpointStore::stats) and
//!   [`compact`](CheckpointStore::compact) track and reclaim space.
//! - Other processes can open the store read-only while a training run
//!   writes to it ([`CheckpointStore::open_read_only`]); the `ckpt` tool does.
//! - After a crash, the store reopens in milliseconds whatever its size
//!   ([`StoreOptions::quick_repair`]), and can be read at once, before
//!   anything reopens it for writing, without a byte of it changing.
//! - With the `remote` feature (on by default), committed steps replicate
//!   to a bucket (S3-compatible, or a directory), deduplicated by content,
//!   once ([`Remote::push`]) or after every commit
//!   ([`StoreOptions::replicate_to`]); any machine lists, verifies and
//!   restores them from the bucket alone ([`Remote`]).
//! - [`GradientCheckpoint::save`] / [`GradientCheckpoint::load`] keep the
//!   original one-JSON-file-per-step format for import and export.
//!
//! ## Quick start
//!
//! ```
//! use ckptstore::{CheckpointStore, ComputationGraphStore, ComputationNode, GradientCheckpoint};
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("run.ckpt");
//!
//! let store = CheckpointStore::open(&path)?;
//!
//! // Resume from the latest step, or start from scratch.
//! let start = store.latest_step()?.map_or(0, |s| s + 1);
//!
//! for step in start..start + 3 {
//!     let mut graph = ComputationGraphStore::new();
//!     let id = graph.add_node(ComputationNode::new("matmul", vec!["cid_x".into()]));
//!     graph.record_output(&id, format!("cid_y_{step}"))?;
//!
//!     let mut ckpt = GradientCheckpoint::new(graph, step).with_loss_cid(format!("cid_loss_{step}"));
//!     ckpt.set_optimizer_state("adam_m", vec![step as u8; 1 << 16]);
//!     let info = store.commit(&ckpt)?; // durable when it returns
//!     assert_eq!(info.step, step);
//! }
//!
//! let latest = store.latest()?.expect("three steps were committed");
//! assert_eq!(latest.step, start + 2);
//! assert_eq!(store.steps()?, vec![0, 1, 2]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod checkpoint;
mod db;
mod engine;
mod error;
mod exchange;
mod file;
mod files;
mod format;
mod graph;
mod hex;
mod options;
mod process;
#[cfg(feature = "remote")]
mod remote;
mod report;
mod retention;
mod save_record;
mod step;
mod store;
mod tensor;
pub mod tier;

pub use checkpoint::{GradientCheckpoint, MAX_TEXT_BYTES};
pub use file::{remove_durably, write_durably};
pub use files::{step_of_dir, write_dir, FILES_ENTRY};

/// The length of a blob's chunks, all but its last few (which are shorter):
/// ranged reads cut on multiples of it from a blob's start share no chunk.
pub const CHUNK_BYTES: usize = format::layout::CHUNK_SIZE;
pub use engine::hashing::ChunkHasher;
pub use engine::slices::{slice_proof, slice_proof_len, ChunkSlice, SliceCheck};
pub use error::{Cause, Error, PackError, PackOp, Result};
pub use exchange::dcp::{BoxSpan, DcpDtype, DcpIndex, DcpTensor, DCP_METADATA, DCP_RANK_METADATA};
pub use exchange::dcp_doc::{DcpChunk, DcpDocument, DcpEntry, DcpPathPart, DcpWhere, DCP_FORMAT};
pub use exchange::hf::{cast_dtype, HfExport, DEFAULT_MAX_SHARD_BYTES};
pub use graph::{ComputationGraphStore, ComputationNode};
pub use options::{Durability, DEFAULT_PACK_THRESHOLD};
#[cfg(feature = "remote")]
pub use remote::{
    Announce, BucketError, EntryInfo, GcReport, GlobalStep, Piece, PushReport, Remote, SaveId,
    ShardHash, ShardInfo, ShardSource, ShardStatus, ShardUpload, ShardWrite, DEFAULT_GRACE_PERIOD,
    DEFAULT_PACK_BYTES, DEFAULT_RETRY_WINDOW, MAX_MANIFEST_BYTES, MAX_WORLD_SIZE,
};
#[cfg(feature = "remote")]
pub use report::ReplicationStatus;
pub use report::{CommitInfo, ContentDigest, StepInfo, StoreStats, TensorInfo, VerifyReport};
pub use retention::{Goal, Retention, StepSummary};
pub use save_record::{SaveRecord, Staging};
pub use step::{Entry, Step};
pub use store::{CheckpointStore, ChunkMap, CommitHandle, StoreOptions};
pub use tensor::{ChunkHashes, Dtype, Tensor, TensorMut, TensorRef};
