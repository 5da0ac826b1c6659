//! Reads: the commit objects (`commits`), what a commit stands for and the checks a step passes
//! (`step`), listings and summaries (`listing`), restores (`restore`), ranged
//! reads of a global step (`pieces`, and `local` for a directory bucket),
//! and `verify`.

pub(crate) mod commits;
pub(crate) mod listing;
pub(crate) mod local;
pub(crate) mod pieces;
pub(crate) mod restore;
pub(crate) mod step;
pub(crate) mod verify;

use std::collections::BTreeMap;

use crate::remote::coordination::Shared;
use crate::remote::read::pieces::{EntryInfo, GlobalStep, Piece};
use crate::remote::Remote;
use crate::{
    CheckpointStore, ChunkSlice, CommitInfo, GradientCheckpoint, Result, StepInfo, StepSummary,
    VerifyReport,
};

/// A remote's reads: listings, restores, ranged reads, `verify`.
#[derive(Clone, Copy)]
pub(crate) struct Reader<'r> {
    shared: Shared<'r>,
}

impl<'r> Reader<'r> {
    pub(crate) fn over(shared: Shared<'r>) -> Reader<'r> {
        Reader { shared }
    }
}

impl<'r> std::ops::Deref for Reader<'r> {
    type Target = Shared<'r>;
    fn deref(&self) -> &Shared<'r> {
        &self.shared
    }
}

impl Remote {
    /// The committed steps in the bucket, ascending: from the listing of
    /// commit objects alone (a request per 1,000 commits), whatever the
    /// bucket's size. A commit is written last, once everything its step
    /// needs is there; a step whose objects were damaged or deleted since
    /// stays listed until [`verify`](Self::verify) reports it and reading
    /// it fails ([`skipped_steps`](Self::skipped_steps) lists those).
    pub fn steps(&self) -> Result<Vec<u64>> {
        self.reader().steps()
    }

    /// The newest step with a commit whose manifest is there and checks
    /// out: the commits from the step the bucket's latest-step hint names
    /// on (a GET and a listing of what follows, whatever the bucket's
    /// size), then the newest manifests, one GET each, until one checks
    /// out; below the hint only if none does (a damaged newest step never
    /// hides an older one). Neither a global step's shard manifests nor
    /// chunks are looked for: reading the step checks each.
    pub fn latest_step(&self) -> Result<Option<u64>> {
        self.reader().latest_step()
    }

    /// Step `step`, restored from the bucket with every chunk hash-checked, or
    /// `None` if the bucket has no complete copy of it.
    ///
    /// # Errors
    /// [`Error::Corrupt`](crate::Error::Corrupt) when a chunk is missing or
    /// fails its hash check (naming the URL);
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket
    /// fails; [`BucketError::ShardedStep`](crate::BucketError::ShardedStep) for
    /// a global step of several ranks (read its shards with
    /// [`get_shard`](Self::get_shard)).
    pub fn get(&self, step: u64) -> Result<Option<GradientCheckpoint>> {
        self.reader().get(step)
    }

    /// [`get`](Self::get), calling `progress(bytes_fetched, bytes_total)`
    /// as chunks arrive (for progress bars).
    pub fn get_with(
        &self,
        step: u64,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Option<GradientCheckpoint>> {
        self.reader().get_with(step, progress)
    }

    /// Copy step `step` from the bucket into `store` (one commit there). An
    /// empty store takes the run identity of the prefix
    /// ([`owner`](Self::owner)): a job resumed from the bucket on a new machine
    /// goes on pushing into it.
    ///
    /// # Errors
    /// [`Error::StepsNotFound`](crate::Error::StepsNotFound) when the bucket
    /// has no complete copy of it; as [`get`](Self::get) and
    /// [`CheckpointStore::commit`].
    pub fn pull(&self, step: u64, store: &CheckpointStore) -> Result<CommitInfo> {
        self.reader().pull(step, store)
    }

    /// [`pull`](Self::pull), with progress as for [`get_with`](Self::get_with).
    /// The step is fed into one streamed commit blob by blob while the
    /// next chunks download, so memory holds a batch of chunks (32 MiB, or
    /// the largest blob) rather than the step.
    pub fn pull_with(
        &self,
        step: u64,
        store: &CheckpointStore,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<CommitInfo> {
        self.reader().pull_with(step, store, progress)
    }

    /// The summaries (time, loss CID, metrics, sizes) of the complete
    /// steps, ascending, from their manifests.
    /// `bytes_written` is what each step added to the bucket: its chunks
    /// that no earlier step there has.
    pub fn summaries(&self) -> Result<Vec<StepSummary>> {
        self.reader().summaries()
    }

    /// Step `step`'s metadata, from its manifest (no chunk is read), or `None`
    /// if the bucket has no complete copy of it.
    ///
    /// # Errors
    /// [`BucketError::ShardedStep`](crate::BucketError::ShardedStep) for a
    /// global step of several ranks (see [`get_shard`](Self::get_shard)).
    pub fn info(&self, step: u64) -> Result<Option<StepInfo>> {
        self.reader().info(step)
    }

    /// Step `step` opened for reads of parts of it: its newest commit whose
    /// manifests are there and hash right (a damaged newer commit falls
    /// back to an older one); `None` if no commit of the step checks out.
    /// Chunks are checked when read.
    ///
    /// # Errors
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket fails.
    pub fn open_global(&self, step: u64) -> Result<Option<GlobalStep>> {
        self.reader().open_global(step)
    }

    /// The newest complete step opened for reads of parts of it, in one
    /// listing of the commits: what [`latest_step`](Self::latest_step)
    /// then [`open_global`](Self::open_global) give, without listing
    /// twice; `None` if no step is complete.
    ///
    /// # Errors
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket fails.
    pub fn open_latest_global(&self) -> Result<Option<GlobalStep>> {
        self.reader().open_latest_global()
    }

    /// Step `step` opened from exactly the commit named `commit` (a
    /// [`GlobalStep::commit`] another reader opened); `None` if that
    /// commit is gone or does not check out.
    ///
    /// # Errors
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket fails.
    pub fn open_global_commit(&self, step: u64, commit: &str) -> Result<Option<GlobalStep>> {
        self.reader().open_global_commit(step, commit)
    }

    /// Rank `rank`'s entries of `global` by name (empty for a rank it does
    /// not have), its shard's manifest read if it was not.
    ///
    /// # Errors
    /// As [`read_pieces`](Self::read_pieces).
    pub fn entries(&self, global: &GlobalStep, rank: u32) -> Result<BTreeMap<String, EntryInfo>> {
        self.reader().entries(global, rank)
    }

    /// The bytes of each of `pieces` of `global`, in order. Only the chunks
    /// the pieces overlap are fetched (each once, several in flight), and
    /// each is checked against its hash and length before any of its bytes
    /// is used.
    ///
    /// # Errors
    /// [`Error::InvalidCheckpoint`](crate::Error::InvalidCheckpoint) for a piece outside its entry;
    /// [`Error::Corrupt`](crate::Error::Corrupt) naming the step and chunk when a chunk is missing
    /// or damaged; [`BucketError::Request`](crate::BucketError::Request) when the bucket fails.
    pub fn read_pieces(&self, global: &GlobalStep, pieces: &[Piece<'_>]) -> Result<Vec<Vec<u8>>> {
        self.reader().read_pieces(global, pieces)
    }

    /// [`read_pieces`](Self::read_pieces) into the caller's buffers, one per
    /// piece and of its length (a tensor's memory): each chunk's bytes are
    /// copied straight into place, once checked. On an error a buffer may hold
    /// some of its piece, never bytes that failed a check.
    ///
    /// # Errors
    /// As [`read_pieces`](Self::read_pieces);
    /// [`Error::InvalidCheckpoint`](crate::Error::InvalidCheckpoint) when a
    /// buffer's length is not its piece's.
    pub fn read_pieces_into(
        &self,
        global: &GlobalStep,
        pieces: &[Piece<'_>],
        outs: &mut [&mut [u8]],
    ) -> Result<()> {
        self.reader().read_pieces_into(global, pieces, outs)
    }

    /// Where the bytes of `piece` lie in the bucket's chunks, in order
    /// (the shard's manifest read if it was not).
    ///
    /// # Errors
    /// As [`read_pieces`](Self::read_pieces).
    pub fn slices(&self, global: &GlobalStep, piece: &Piece<'_>) -> Result<Vec<ChunkSlice>> {
        self.reader().slices(global, piece)
    }

    /// [`read_pieces_into`](Self::read_pieces_into), and for each of `proved`
    /// (byte ranges within the pieces) the proofs of its
    /// [`slices`](Self::slices), back to back, made from each chunk once it is
    /// checked: what a rank handing those bytes on sends with them.
    ///
    /// # Errors
    /// As [`read_pieces_into`](Self::read_pieces_into), and
    /// [`Error::InvalidCheckpoint`](crate::Error::InvalidCheckpoint) for a
    /// range outside the pieces.
    pub fn read_pieces_proving(
        &self,
        global: &GlobalStep,
        pieces: &[Piece<'_>],
        outs: &mut [&mut [u8]],
        proved: &[Piece<'_>],
    ) -> Result<Vec<Vec<u8>>> {
        self.reader()
            .read_pieces_proving(global, pieces, outs, proved)
    }

    /// The steps that have commits none of which checks out (a manifest
    /// missing, damaged or refused by its checks, a chunk missing), each
    /// with why its newest commit does not: listings skip them, `verify`
    /// reports them as damaged.
    ///
    /// # Errors
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket fails.
    pub fn skipped_steps(&self) -> Result<Vec<(u64, String)>> {
        self.reader().skipped_steps()
    }

    /// Read every step in the bucket and check every hash, as readers get
    /// it: each step's newest commit that checks out (its manifest there,
    /// hashing right and consistent: lengths, counts, names, see the caps
    /// in the crate docs; every object it names there), and each chunk it
    /// names. Older commits of a step (superseded by a save again) are not
    /// judged: readers never take them. A step none of whose commits
    /// checks out, or whose chunks fail their hash, is reported in
    /// [`VerifyReport::damaged`] with the object at fault; `Err` means the
    /// bucket could not be read at all. Reads every chunk once per step, a
    /// batch of chunks in memory at a time.
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Remote};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// # let remote = Remote::open(&format!("file://{}", dir.path().join("bucket").display()))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// remote.push(&store)?;
    /// let report = remote.verify()?;
    /// assert!(report.is_ok());
    /// assert_eq!(report.steps_ok, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn verify(&self) -> Result<VerifyReport> {
        self.reader().verify()
    }

    /// [`verify`](Self::verify), calling `progress(step, bytes)` after each
    /// step is checked.
    pub fn verify_with(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<VerifyReport> {
        self.reader().verify_with(progress)
    }
}
