//! One shard write ([`Remote::write_shard`](crate::Remote::write_shard)),
//! after `object_store`'s `put_opts`: the shard (step, rank, world size),
//! where its bytes come from and how far the write goes, as values. The
//! other shard calls of `Remote` are conveniences over it.

use std::collections::BTreeMap;

use crate::engine::plan::{check_borrowed, Plan};
use crate::remote::format::hash::ShardHash;
use crate::remote::global::shards::ShardUpload;
use crate::remote::global::Coordinator;
use crate::remote::ShardInfo;
use crate::{CheckpointStore, Entry, Error, GradientCheckpoint, Result, Step, TensorRef};

/// Where the bytes of a shard come from ([`ShardWrite`]).
#[derive(Clone, Copy)]
#[non_exhaustive]
pub enum ShardSource<'a> {
    /// A step in memory.
    Owned(&'a Step),
    /// A step with these tensors added, whose bytes are hashed and
    /// uploaded from where they lie: no copy of them is made (the Python
    /// package uploads numpy arrays and torch tensors this way). A name
    /// of the tensors that is also an entry of the step is refused.
    Borrowed(&'a Step, &'a BTreeMap<String, TensorRef<'a>>),
    /// The shard's step of a local store, read and hashed in Rust (chunks
    /// the bucket holds are neither read nor hashed again).
    Store(&'a CheckpointStore),
    /// As [`Store`](Self::Store), less the blobs and tensors named in
    /// `drop` and with the blobs `add` (a tier's upload puts the save's
    /// own metadata in place of the rank's this way).
    StoreEdited {
        /// The store whose step it is.
        store: &'a CheckpointStore,
        /// Entries of the step left out.
        drop: &'a [String],
        /// Blobs added (replacing any of the same name).
        add: &'a [(String, Vec<u8>)],
    },
}

/// A write of rank `rank`'s shard of global step `step` of `world_size`
/// ranks: its bytes (`source`) and how far the write goes (`then`).
#[non_exhaustive]
pub struct ShardWrite<'a> {
    /// The step.
    pub step: u64,
    /// This shard's rank.
    pub rank: u32,
    /// The number of ranks.
    pub world_size: u32,
    /// Where its bytes come from.
    pub source: ShardSource<'a>,
    /// How far the write goes after its chunks.
    pub then: ShardUpload,
}

/// How a rank of a rank-local save tells the others its shard landed
/// ([`Remote::write_shard_announced`](crate::Remote::write_shard_announced)):
/// given the shard's name, every rank's (by rank) where this rank's
/// announcement completed the save, else `None`.
pub type Announce<'a> = &'a mut dyn FnMut(ShardHash) -> Option<Vec<ShardHash>>;

impl<'a> ShardWrite<'a> {
    /// The write of shard `(step, rank, world_size)` from `source`, as
    /// far as `then`.
    pub fn new(
        (step, rank, world_size): (u64, u32, u32),
        source: ShardSource<'a>,
        then: ShardUpload,
    ) -> ShardWrite<'a> {
        ShardWrite {
            step,
            rank,
            world_size,
            source,
            then,
        }
    }
}

/// Step `step` as a store gave it (`found`), less the entries named in
/// `drop`, with the blobs `add`.
fn edited(
    found: Option<Step>,
    step: u64,
    drop: &[String],
    add: &[(String, Vec<u8>)],
) -> Result<Step> {
    let mut s = found.ok_or(Error::StepNotFound { step })?;
    for name in drop {
        s.remove(name);
    }
    for (name, bytes) in add {
        s.insert(name.clone(), Entry::Blob(bytes.clone()));
    }
    Ok(s)
}

impl Coordinator<'_> {
    /// Does the work of [`Remote::write_shard`](crate::Remote::write_shard).
    pub(crate) fn write_shard(
        &self,
        write: ShardWrite<'_>,
        announce: Option<Announce<'_>>,
    ) -> Result<ShardInfo> {
        let shard = (write.step, write.rank, write.world_size);
        let stored;
        let edits;
        let plan = match write.source {
            ShardSource::Owned(ckpt) => Plan::new(ckpt),
            ShardSource::Borrowed(ckpt, tensors) => {
                check_borrowed(ckpt, tensors)?;
                Plan::with_borrowed(ckpt, tensors)
            }
            ShardSource::Store(store) => {
                let step = write.step;
                stored = store.get(step)?.ok_or(Error::StepNotFound { step })?;
                Plan::new(&stored)
            }
            ShardSource::StoreEdited { store, drop, add } => {
                let step = write.step;
                let found = store.get(step)?.map(GradientCheckpoint::into_step);
                edits = edited(found, step, drop, add)?;
                Plan::new(&edits)
            }
        };
        match (write.then, announce) {
            (ShardUpload::Commit(shards), _) => self.upload_and_commit(shard, &plan, &shards, true),
            (ShardUpload::CommitReported(shards), _) => {
                self.upload_and_commit(shard, &plan, &shards, false)
            }
            (ShardUpload::RankLocalShard(save), Some(announce)) => {
                self.upload_announced(shard, &plan, save, announce)
            }
            (how, _) => self.upload_planned(shard, &plan, &how),
        }
    }
}
