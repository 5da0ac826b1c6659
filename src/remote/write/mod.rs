//! Writes: a store's push (`push`, over `knowledge` of what the bucket
//! holds: the store's memory of it or a listing), pack objects (`packs`,
//! for pushes and shards alike), and background replication
//! (`replicate`).

pub(crate) mod knowledge;
pub(crate) mod packs;
pub(crate) mod push;
pub(crate) mod replicate;

use crate::remote::read::Reader;
use crate::remote::write::push::PushReport;
use crate::remote::Remote;
use crate::{CheckpointStore, Result};

/// A remote's writes: pushes and pack objects. A writer reads as it
/// writes (what the bucket holds, what it deduplicates against).
#[derive(Clone, Copy)]
pub(crate) struct Writer<'r> {
    read: Reader<'r>,
    /// The size new pack objects are filled to (raw bytes).
    pub(crate) pack_bytes: u64,
    /// Whether chunks go into packs compressed where that saves bytes
    /// (bucket format 4).
    pub(crate) compress: bool,
}

impl<'r> Writer<'r> {
    pub(crate) fn over(read: Reader<'r>, pack_bytes: u64, compress: bool) -> Writer<'r> {
        Writer {
            read,
            pack_bytes,
            compress,
        }
    }
}

impl<'r> std::ops::Deref for Writer<'r> {
    type Target = Reader<'r>;
    fn deref(&self) -> &Reader<'r> {
        &self.read
    }
}

impl Remote {
    /// Upload every committed step of `store` that this bucket lacks,
    /// deduplicated by content against everything in the bucket. Idempotent and
    /// resumable: rerun after any failure or kill, it finishes the job without
    /// uploading again what landed. A step that the bucket's retention deleted
    /// ([`Remote::apply_retention`]) is not uploaded again.
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
    /// let report = remote.push(&store)?;
    /// assert_eq!(report.steps_pushed, vec![1]);
    /// assert_eq!(remote.push(&store)?.steps_present, 1); // nothing to do
    /// assert_eq!(remote.get(1)?, Some(ckpt));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket
    /// cannot be reached or refuses a request (after bounded retries);
    /// [`BucketError::Busy`](crate::BucketError::Busy) when a garbage
    /// collection of the bucket holds its lock for longer than the grace
    /// period; store errors as for reads.
    pub fn push(&self, store: &CheckpointStore) -> Result<PushReport> {
        self.writer().push(store)
    }

    /// [`push`](Self::push), calling `progress(step, bytes_uploaded)` after
    /// each chunk lands and each step is done (for progress bars); the push
    /// stops early, with what it did so far, when `progress` returns false.
    pub fn push_with(
        &self,
        store: &CheckpointStore,
        progress: &mut dyn FnMut(u64, u64) -> bool,
    ) -> Result<PushReport> {
        self.writer().push_with(store, progress)
    }

    /// [`push`](Self::push) that lists the bucket rather than trust what the
    /// store remembers of it, so that it also repairs steps whose chunks,
    /// packs or manifests were deleted by hand (a plain push notices only
    /// what a garbage collection deleted). Costs a listing of the bucket and
    /// a GET of each step's manifest.
    pub fn repair(&self, store: &CheckpointStore) -> Result<PushReport> {
        self.writer().repair(store)
    }
}
