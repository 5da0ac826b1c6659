//! Global steps of N ranks: shards that complete a step by themselves
//! (`shards`), steps a coordinator completes (`coordinated`), and DCP's
//! metadata over them (`dcp`).

pub(crate) mod coordinated;
pub(crate) mod dcp;
#[cfg(test)]
mod legacy_metrics;
pub(crate) mod shards;
pub(crate) mod write;

use std::collections::BTreeMap;
use std::path::Path;

use crate::remote::format::hash::ShardHash;
use crate::remote::global::shards::{ShardInfo, ShardStatus, ShardUpload};
use crate::remote::global::write::{Announce, ShardSource, ShardWrite};
use crate::remote::read::pieces::GlobalStep;
use crate::remote::write::Writer;
use crate::remote::Remote;
use crate::{CheckpointStore, DcpIndex, Result, Step};

/// A remote's global-step coordinator: shards of N ranks, the commit that
/// completes a step, and DCP's metadata over them.
#[derive(Clone, Copy)]
pub(crate) struct Coordinator<'r> {
    write: Writer<'r>,
}

impl<'r> Coordinator<'r> {
    pub(crate) fn over(write: Writer<'r>) -> Coordinator<'r> {
        Coordinator { write }
    }
}

impl<'r> std::ops::Deref for Coordinator<'r> {
    type Target = Writer<'r>;
    fn deref(&self) -> &Writer<'r> {
        &self.write
    }
}

impl Remote {
    /// Write one rank's shard of a global step: the shard, where its bytes
    /// come from and how far the write goes, as values ([`ShardWrite`]).
    /// Every write uploads the shard's chunks new to the bucket in pack
    /// objects first; then, as [`ShardUpload`] says, nothing more, its
    /// manifest, the step's commit once every rank's shard is there (of
    /// one save, for a rank-local save), or the step's commit naming the
    /// shards given (a coordinator's). The other shard calls are
    /// conveniences over it.
    ///
    /// ```
    /// use ckptstore::{Entry, Remote, ShardSource, ShardUpload, ShardWrite, Step};
    /// # let dir = tempfile::tempdir()?;
    /// let remote = Remote::open(&format!("file://{}", dir.path().display()))?;
    /// let mut shard = Step::new(7);
    /// shard.insert("w", Entry::Blob(vec![1; 100]));
    /// let write = ShardWrite::new((7, 0, 1), ShardSource::Owned(&shard), ShardUpload::Complete);
    /// assert!(remote.write_shard(write)?.complete);
    /// assert_eq!(remote.steps()?, vec![7]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidCheckpoint`](crate::Error::InvalidCheckpoint) for a
    /// rank not below the world size, a checkpoint of another step, more
    /// ranks than [`MAX_WORLD_SIZE`](crate::MAX_WORLD_SIZE), a borrowed
    /// tensor's name also the checkpoint's, or (`Commit`) as many shards
    /// named as ranks not given or another rank's entry `None`;
    /// [`Error::StepNotFound`](crate::Error::StepNotFound) for a store
    /// without the step; [`BucketError::WorldSizeMismatch`](crate::BucketError::WorldSizeMismatch)
    /// (`Complete`) when the step's other shards name another world size;
    /// [`Error::Corrupt`](crate::Error::Corrupt) (`Commit`) naming a shard
    /// that is missing or damaged; [`BucketError::Request`](crate::BucketError::Request)
    /// when the bucket fails.
    pub fn write_shard(&self, write: ShardWrite<'_>) -> Result<ShardInfo> {
        self.coordinator().write_shard(write, None)
    }

    /// A rank-local save's shard completed through the job's rendezvous
    /// (`ckptstore.dcp`'s rank-local mode): `write` (whose `then` is
    /// [`ShardUpload::RankLocalShard`]; any other is as
    /// [`write_shard`](Self::write_shard)) is uploaded, then, its push lock
    /// still held, `announce` tells the other ranks its name. The rank
    /// whose announcement completes the save gets every rank's name and
    /// writes the step's commit naming them in the same lock cycle, as
    /// [`commit_reported`](Self::commit_reported) would ([`ShardInfo::complete`]
    /// is then true): each rank's requests stay a handful however many
    /// ranks land at once. `announce` answering `None` leaves the step to
    /// the rank that completes it (or, if that one died, to
    /// [`complete_landed`](Self::complete_landed)).
    ///
    /// # Errors
    /// As [`write_shard`](Self::write_shard);
    /// [`Error::InvalidCheckpoint`](crate::Error::InvalidCheckpoint) when
    /// the names announced are not one a rank, or this rank's is not the
    /// shard it uploaded.
    pub fn write_shard_announced(
        &self,
        write: ShardWrite<'_>,
        announce: Announce<'_>,
    ) -> Result<ShardInfo> {
        self.coordinator().write_shard(write, Some(announce))
    }

    /// Upload rank `rank`'s shard of global step `step` of `world_size`
    /// ranks (its new chunks in pack objects, then the shard's manifest)
    /// without completing the step; [`ShardInfo::shard`] names
    /// it for [`commit_global`](Self::commit_global). Shards of the step
    /// with another world size (an attempt that died) do not matter.
    ///
    /// # Errors
    /// As [`commit_shard`](Self::commit_shard), but for the world size.
    pub fn upload_shard(
        &self,
        step: u64,
        rank: u32,
        world_size: u32,
        shard: &Step,
    ) -> Result<ShardInfo> {
        let source = ShardSource::Owned(shard);
        self.write_shard(ShardWrite::new(
            (step, rank, world_size),
            source,
            ShardUpload::Manifest,
        ))
    }

    /// Complete global step `step` with `shards` (each rank's, by rank, as
    /// [`upload_shard`](Self::upload_shard) named them): check that each is
    /// there and whole (its manifest hashes right; a shard of format 1 or
    /// 2, from an older build, has every chunk it names asked for), then
    /// write the step's manifest and a commit newer
    /// than any of the step's. The step is listed from then on, and reads
    /// exactly these shards.
    ///
    /// ```
    /// use ckptstore::{Entry, Remote, ShardHash, Step};
    /// # let dir = tempfile::tempdir()?;
    /// let remote = Remote::open(&format!("file://{}", dir.path().display()))?;
    /// let shard = |rank: u8| {
    ///     let mut s = Step::new(3);
    ///     s.timestamp = 1_700_000_000; // the same each time it is built
    ///     s.insert("w", Entry::Blob(vec![rank; 100]));
    ///     s
    /// };
    /// let names: Vec<ShardHash> = (0..2)
    ///     .map(|r| Ok(remote.upload_shard(3, r, 2, &shard(r as u8))?.shard))
    ///     .collect::<ckptstore::Result<_>>()?;
    /// assert_eq!(remote.steps()?, Vec::<u64>::new()); // not before the commit
    /// remote.commit_global(3, &names)?;
    /// assert_eq!(remote.steps()?, vec![3]);
    /// assert_eq!(remote.get_shard(3, 1)?, Some(shard(1)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidCheckpoint`](crate::Error::InvalidCheckpoint) for no shards or too
    /// many; [`Error::Corrupt`](crate::Error::Corrupt) naming the shard when one is
    /// missing, damaged or names a chunk the bucket lacks;
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket fails.
    pub fn commit_global(&self, step: u64, shards: &[ShardHash]) -> Result<()> {
        self.coordinator().commit_global(step, shards)
    }

    /// Complete global step `step` with `shards` (each rank's, by rank)
    /// that each rank reported once its upload returned (a rank-local
    /// save's ranks, through the job's rendezvous store, after
    /// [`ShardUpload::RankLocalShard`](crate::ShardUpload::RankLocalShard)):
    /// as [`commit_global`](Self::commit_global), but no shard is read,
    /// for a request count that does not grow with the ranks. The names
    /// are trusted: an upload that returned is there (S3 reads its
    /// writes). A name that is wrong makes a commit no reader takes (each
    /// checks every shard it reads: the step's older commit, if any,
    /// stays what it reads).
    ///
    /// # Errors
    /// [`Error::InvalidCheckpoint`](crate::Error::InvalidCheckpoint) for no
    /// shards or too many; [`BucketError::Request`](crate::BucketError::Request)
    /// when the bucket fails.
    pub fn commit_reported(&self, step: u64, shards: &[ShardHash]) -> Result<()> {
        self.coordinator().commit_reported(step, shards)
    }

    /// The index of step `step` if `ckptstore.dcp` saved it: its tensors with
    /// their global shapes and stored boxes (of a rank-local save, every
    /// rank's metadata merged); `None` for a step that is not complete or
    /// was not saved through DCP.
    ///
    /// # Errors
    /// [`Error::Corrupt`](crate::Error::Corrupt) when the metadata is damaged;
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket
    /// fails.
    pub fn dcp_index(&self, step: u64) -> Result<Option<DcpIndex>> {
        self.coordinator().dcp_index(step)
    }

    /// The DCP metadata document of an opened global step (the bytes of
    /// [`DCP_METADATA`](crate::DCP_METADATA)), `None` if `ckptstore.dcp` did not save it
    /// or saved it rank-locally (each rank's shard holds its own,
    /// [`DCP_RANK_METADATA`](crate::DCP_RANK_METADATA)). The
    /// coordinator's shard holds it: rank 0's, unless the save's
    /// coordinator had another rank; a rank's shard manifest is read
    /// (and checked) only until it is found.
    ///
    /// # Errors
    /// [`Error::Corrupt`](crate::Error::Corrupt) for a damaged manifest or chunk;
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket fails.
    pub fn dcp_metadata(&self, global: &GlobalStep) -> Result<Option<Vec<u8>>> {
        self.coordinator().dcp_metadata(global)
    }

    /// Write DCP step `step` to `path` as one safetensors file of whole tensors
    /// under their fully qualified names (with `prefix`, only the names under
    /// it, the prefix stripped: `"model."` gives a file an unsharded model's
    /// `load_state_dict` takes). One tensor is in memory at a time, read in
    /// windows of 32 MiB; every chunk is hash-checked; the file is written
    /// durably, or not at all. The names written.
    ///
    /// # Errors
    /// [`Error::StepNotFound`](crate::Error::StepNotFound) when the step is not
    /// a complete DCP step;
    /// [`Error::InvalidCheckpoint`](crate::Error::InvalidCheckpoint) naming a
    /// chosen tensor whose dtype safetensors cannot hold
    /// ([`DcpDtype::Torch`](crate::DcpDtype::Torch): leave it out with a
    /// prefix, or load it through `ckptstore.dcp`);
    /// [`Error::Corrupt`](crate::Error::Corrupt) for damaged data or metadata
    /// (a box not stored, boxes that do not cover a tensor); I/O errors naming
    /// `path`.
    pub fn consolidate(&self, step: u64, path: &Path, prefix: Option<&str>) -> Result<Vec<String>> {
        self.coordinator().consolidate(step, path, prefix)
    }

    /// Write DCP step `step` into directory `dir` as a Hugging Face
    /// checkpoint: safetensors shards of at most `max_shard` bytes
    /// (`model-00001-of-0000N.safetensors`, or `model.safetensors` alone)
    /// and `model.safetensors.index.json`, tensors whole under their
    /// names (with `prefix`, only those under it, stripped), floating
    /// tensors cast to `cast` if given (lossy when it narrows). One tensor
    /// is in memory at a time, read in windows of 32 MiB, every chunk
    /// hash-checked; an index already in `dir` is removed first and the
    /// new one written last, each shard durably under a temporary name
    /// first, so a killed export leaves no index naming a shard that is
    /// not whole.
    ///
    /// # Errors
    /// As [`consolidate`](Self::consolidate); I/O errors naming the file.
    pub fn export_hf(
        &self,
        step: u64,
        dir: &Path,
        max_shard: u64,
        prefix: Option<&str>,
        cast: Option<crate::Dtype>,
    ) -> Result<crate::HfExport> {
        self.coordinator()
            .export_hf(step, dir, max_shard, prefix, cast)
    }

    /// Commit directory `dir` as step `step` of this bucket (a step of
    /// files, as [`CheckpointStore::save_dir`](crate::CheckpointStore::save_dir)
    /// cuts it: each regular file an entry, unchanged chunks not uploaded
    /// again), complete when this returns. A step already there is saved
    /// again: readers take the newer save.
    ///
    /// # Errors
    /// As [`commit_shard`](Self::commit_shard); [`Error::Io`](crate::Error::Io)
    /// naming a file that could not be read;
    /// [`Error::InvalidCheckpoint`](crate::Error::InvalidCheckpoint) for a
    /// link or a special file under `dir`.
    pub fn save_dir(&self, step: u64, dir: &Path) -> Result<ShardInfo> {
        self.commit_shard(step, 0, 1, &crate::files::step_of_dir(step, dir)?)
    }

    /// Write step `step`, a step of files, into directory `dir` (which
    /// must not exist, or be empty), whole or not at all, every chunk
    /// checked as read: the paths written.
    ///
    /// # Errors
    /// [`Error::StepNotFound`](crate::Error::StepNotFound);
    /// [`Error::InvalidCheckpoint`](crate::Error::InvalidCheckpoint) for a
    /// step [`save_dir`](Self::save_dir) did not write;
    /// [`Error::Io`](crate::Error::Io) naming what could not be written;
    /// [`BucketError::Request`](crate::BucketError::Request) when the
    /// bucket fails.
    pub fn load_dir(&self, step: u64, dir: &Path) -> Result<Vec<String>> {
        let found = self.get_shard(step, 0)?;
        crate::files::write_dir(&found.ok_or(crate::Error::StepNotFound { step })?, dir)
    }

    /// Upload rank `rank`'s shard of global step `step` of `world_size` ranks:
    /// its chunks in pack objects, those this remote wrote or loaded before
    /// (under the bucket's current collection mark) not uploaded again. The
    /// step becomes visible ([`steps`](Self::steps),
    /// [`latest_step`](Self::latest_step)) once all `world_size` shards are in:
    /// the rank that lands last, or any rank that finds them all, writes its
    /// commit. Never waits for other ranks. Committing the same shard again
    /// through the same remote (a retry) uploads nothing new and leaves one
    /// shard; a restarted process packs its chunks again.
    ///
    /// ```
    /// use ckptstore::{Entry, Remote, Step};
    /// # let dir = tempfile::tempdir()?;
    /// let remote = Remote::open(&format!("file://{}", dir.path().display()))?;
    /// let shard = |rank: u8| {
    ///     let mut s = Step::new(7);
    ///     s.timestamp = 1_700_000_000; // the same each time it is built
    ///     s.insert("params", Entry::Blob(vec![rank; 1 << 20]));
    ///     s
    /// };
    /// assert!(!remote.commit_shard(7, 0, 2, &shard(0))?.complete);
    /// assert_eq!(remote.latest_step()?, None); // rank 1 has not landed
    /// assert!(remote.commit_shard(7, 1, 2, &shard(1))?.complete);
    /// assert_eq!(remote.latest_step()?, Some(7));
    /// assert_eq!(remote.get_shard(7, 1)?, Some(shard(1)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`BucketError::WorldSizeMismatch`](crate::BucketError::WorldSizeMismatch)
    /// when shards of the step with another world size are there;
    /// [`Error::InvalidCheckpoint`](crate::Error::InvalidCheckpoint) for a rank
    /// not below `world_size` or a checkpoint of another step;
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket
    /// fails.
    pub fn commit_shard(
        &self,
        step: u64,
        rank: u32,
        world_size: u32,
        shard: &Step,
    ) -> Result<ShardInfo> {
        let source = ShardSource::Owned(shard);
        self.write_shard(ShardWrite::new(
            (step, rank, world_size),
            source,
            ShardUpload::Complete,
        ))
    }

    /// Rank `rank`'s shard of global step `step`, restored with every chunk
    /// hash-checked: the one the step's commit names if the step is
    /// complete, else a whole one that landed; `None` if there is none.
    pub fn get_shard(&self, step: u64, rank: u32) -> Result<Option<Step>> {
        self.coordinator().get_shard(step, rank)
    }

    /// Which ranks of `step` have landed, also for a step not complete
    /// (for debugging a job that stalled).
    pub fn shards(&self, step: u64) -> Result<ShardStatus> {
        self.coordinator().shards(step)
    }

    /// The number of ranks of each complete step (1 for a step pushed from
    /// one store).
    pub fn world_sizes(&self) -> Result<BTreeMap<u64, u32>> {
        self.coordinator().world_sizes()
    }

    /// The global steps some of whose shards are in the bucket but that are
    /// not complete, ascending, with which ranks landed.
    pub fn incomplete_steps(&self) -> Result<Vec<ShardStatus>> {
        self.coordinator().incomplete_steps()
    }

    /// Complete each step that is not complete but whose newest save has
    /// every rank's shard there, whole (a rank-local save whose completing
    /// rank died before its commit, [`ShardUpload::RankLocalShard`](crate::ShardUpload::RankLocalShard)):
    /// the steps completed, ascending. Lists every shard of the bucket and
    /// reads the shards of each such step: a relaunch's recovery, not a
    /// save's.
    ///
    /// # Errors
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket fails.
    pub fn complete_landed(&self) -> Result<Vec<u64>> {
        self.coordinator().complete_landed()
    }

    /// The number of ranks of step `step`: 1 for a step pushed from one
    /// store, N for a complete global step, what its shards say for one not
    /// complete; `None` if the bucket has nothing of it.
    pub fn world_size(&self, step: u64) -> Result<Option<u32>> {
        self.coordinator().world_size(step)
    }

    /// Upload step `step` of `store` as rank `rank`'s shard of global
    /// step `step` of `world_size` ranks ([`commit_shard`](Self::commit_shard)).
    ///
    /// # Errors
    /// [`Error::StepNotFound`](crate::Error::StepNotFound) if the step is not in `store`; as
    /// [`commit_shard`](Self::commit_shard).
    pub fn push_shard(
        &self,
        store: &CheckpointStore,
        step: u64,
        rank: u32,
        world_size: u32,
    ) -> Result<ShardInfo> {
        let source = ShardSource::Store(store);
        self.write_shard(ShardWrite::new(
            (step, rank, world_size),
            source,
            ShardUpload::Complete,
        ))
    }
}
