//! Object storage: committed steps replicated to a bucket (S3 or a
//! directory) through the `object_store` crate, and restored from the
//! bucket alone. See [`layout`](format::layout) for the names in the bucket.

mod bucket;
mod coordination;
mod format;
mod gc;
mod global;
mod read;
mod s3;
mod write;

use std::sync::Arc;
use std::time::Duration;

use object_store::ObjectStore;

pub use crate::error::BucketError;
use crate::Result;
use bucket::Bucket;
pub use format::hash::{SaveId, ShardHash};
pub(crate) use format::layout::Commit;
pub use format::layout::{MAX_MANIFEST_BYTES, MAX_WORLD_SIZE};
pub use format::pack_format::DEFAULT_PACK_BYTES;

pub use gc::retention::GcReport;
pub use global::shards::{ShardInfo, ShardStatus, ShardUpload};
pub use global::write::{Announce, ShardSource, ShardWrite};
pub use read::pieces::{EntryInfo, GlobalStep, Piece};
pub use write::push::PushReport;

/// How long requests to a server that does not answer (refused
/// connections, 5xx answers, a restart) are retried before an operation
/// fails: a server back within this window is waited out.
pub const DEFAULT_RETRY_WINDOW: Duration = Duration::from_secs(30);
/// The first wait before a retry; waits grow to the second (with jitter).
const FIRST_RETRY_WAIT: Duration = Duration::from_millis(250);
const LONGEST_RETRY_WAIT: Duration = Duration::from_secs(2);
/// One request's time limit, and a connection's.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a push may take between two writes of its lock, and how old an
/// unreferenced object must be before garbage collection deletes it.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(600);

/// A bucket (or a prefix in one) that holds replicated steps.
///
/// Methods block (an internal runtime runs the requests); do not call them
/// from inside an async runtime. `Remote` is `Send + Sync`.
///
/// ```
/// use ckptstore::Remote;
/// # let dir = tempfile::tempdir()?;
/// let remote = Remote::open(&format!("file://{}", dir.path().display()))?;
/// assert_eq!(remote.latest_step()?, None);
/// assert!(Remote::open("ftp://host/x").is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Remote {
    /// The objects: every part reads and writes the bucket through it.
    bucket: Bucket,
    grace: Duration,
    /// The size a shard's new pack objects are filled to.
    pack_bytes: u64,
    /// Whether new chunks are stored compressed where that saves bytes.
    compress: bool,
    /// Where chunks this remote wrote or read lie in the bucket's packs
    /// (shared with the remotes [`compressing`](Self::compressing) made).
    known: Arc<std::sync::Mutex<coordination::known::Known>>,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("url", &self.bucket.url)
            .finish_non_exhaustive()
    }
}

impl Remote {
    /// Open `url`: `s3://BUCKET/PREFIX` (credentials, endpoint and region from
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
    /// `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`) or `file:///DIR` (a directory as a
    /// bucket: it reads as empty while it is missing, the first write creates
    /// it, and every object and its directory is fsynced before a commit names
    /// it). Nothing is requested yet.
    ///
    /// # Errors
    /// [`BucketError::InvalidUrl`](crate::BucketError::InvalidUrl) for another
    /// scheme or a malformed URL.
    pub fn open(url: &str) -> Result<Remote> {
        Ok(Remote::over(Bucket::open(url, None)?))
    }

    /// Open `s3://` URL `url` as [`open`](Self::open) does (the same
    /// environment, retries and checks), its HTTP requests sent through
    /// `connector` rather than reqwest's client: a proxy, another HTTP or
    /// TLS stack, or a simulated S3 in tests (`object_store`'s
    /// [`HttpConnector`](object_store::client::HttpConnector)). The
    /// connector's clients do their own I/O, on a runtime of their own
    /// (as `object_store::client::SpawnedReqwestConnector` does): the
    /// remote's runtime drives timers only.
    ///
    /// # Errors
    /// [`BucketError::InvalidUrl`](crate::BucketError::InvalidUrl) for a
    /// URL that is not `s3://` or is malformed.
    pub fn open_with_connector(
        url: &str,
        connector: Arc<dyn object_store::client::HttpConnector>,
    ) -> Result<Remote> {
        Ok(Remote::over(Bucket::open(url, Some(connector))?))
    }

    /// A remote over any [`ObjectStore`] (tests inject faults this way), at
    /// `prefix` in it; `url` names it in errors.
    ///
    /// # Errors
    /// [`BucketError::InvalidUrl`](crate::BucketError::InvalidUrl) when
    /// `prefix` is not a valid object path.
    pub fn with_store(store: Arc<dyn ObjectStore>, prefix: &str, url: &str) -> Result<Remote> {
        Ok(Remote::over(Bucket::with_store(store, prefix, url)?))
    }

    fn over(bucket: Bucket) -> Remote {
        // Where bytes cross a network to be kept and billed, fewer win
        // (`with_compression`); a directory is written faster than
        // chunks compress.
        let compress = bucket.s3_name.is_some();
        Remote {
            bucket,
            grace: DEFAULT_GRACE_PERIOD,
            pack_bytes: format::pack_format::DEFAULT_PACK_BYTES,
            compress,
            known: Arc::default(),
        }
    }

    /// Set how long requests to a server that does not answer are retried
    /// (default [`DEFAULT_RETRY_WINDOW`], 30 s): a restart or an outage shorter
    /// than this is waited out, a longer one fails the operation with an error
    /// naming the URL. For `s3://` remotes (a directory does not retry; a store
    /// given to [`with_store`](Self::with_store) keeps its own policy).
    ///
    /// # Errors
    /// [`BucketError::Request`](crate::BucketError::Request) if the client
    /// cannot be configured again.
    pub fn with_retry_window(mut self, window: Duration) -> Result<Remote> {
        self.bucket.set_retry_window(window)?;
        Ok(self)
    }

    /// The retry window.
    pub fn retry_window(&self) -> Duration {
        self.bucket.retry_window
    }

    /// Set the grace period (default [`DEFAULT_GRACE_PERIOD`], 10 minutes):
    /// garbage collection deletes no chunk while a push's lock is younger
    /// than this, nor any unreferenced object younger than this; a push
    /// rewrites its lock well within it, and waits at most this long for a
    /// collection to finish. Every process using a bucket should use the
    /// same grace period.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # let dir = tempfile::tempdir()?;
    /// let remote = ckptstore::Remote::open(&format!("file://{}", dir.path().display()))?
    ///     .with_grace_period(Duration::from_secs(3600));
    /// assert_eq!(remote.grace_period(), Duration::from_secs(3600));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_grace_period(mut self, grace: Duration) -> Remote {
        self.grace = grace;
        self
    }

    /// The grace period.
    pub fn grace_period(&self) -> Duration {
        self.grace
    }

    /// Set the size a shard's new chunks are packed to (default
    /// [`DEFAULT_PACK_BYTES`], 64 MiB; at least 1 MiB): a pack object is
    /// one PUT, and holds at least one chunk. Readers need not know it.
    pub fn with_pack_size(mut self, bytes: u64) -> Remote {
        self.pack_bytes = bytes.max(1 << 20);
        self
    }

    /// Set whether the chunks this remote uploads are stored compressed
    /// where that saves bytes (bucket format 4; by default, for `s3://`
    /// and not for `file://` or a store given to
    /// [`with_store`](Self::with_store)): each chunk split into byte
    /// planes by the width of the elements of the tensor it is part of
    /// and compressed with zstd, on every core beside the uploads, and
    /// kept so where that saves at least 1/32 of its bytes. A chunk's
    /// name stays the hash of its own bytes, so deduplication is
    /// unchanged; a step that holds a compressed chunk is written in
    /// manifest format 4, which builds before it refuse by its number (a
    /// step of none stays format 3). Readers decompress whatever they
    /// find, whatever this is set to.
    pub fn with_compression(mut self, on: bool) -> Remote {
        self.compress = on;
        self
    }

    /// A remote of the same bucket and settings that stores new chunks
    /// compressed or not (`on`), and shares what this one knows of where
    /// chunks lie: what either uploads or reads, the other deduplicates
    /// against (a chunk is named by its raw bytes in both forms). One
    /// that does not compress relies only on chunks stored raw, so that
    /// every step it writes stays format 3; a chunk it finds only
    /// compressed it uploads raw.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) if its runtime cannot start.
    pub fn compressing(&self, on: bool) -> Result<Remote> {
        Ok(Remote {
            bucket: self.bucket.sibling()?,
            grace: self.grace,
            pack_bytes: self.pack_bytes,
            compress: on,
            known: Arc::clone(&self.known),
        })
    }

    /// Whether the chunks this remote uploads are stored compressed where
    /// that saves bytes ([`with_compression`](Self::with_compression)).
    pub fn compression(&self) -> bool {
        self.compress
    }

    /// Whether the bucket is there: for a `file://` URL, whether its
    /// directory exists; for `s3://`, whether the bucket answers a listing.
    /// Commands that only read (`ckpt ls`, `show`, `verify`, `gc`, `pull`)
    /// check this first, so that a mistyped URL is an error rather than an
    /// empty bucket.
    ///
    /// # Errors
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket fails otherwise.
    pub fn exists(&self) -> Result<bool> {
        self.bucket.exists()
    }

    /// The URL this remote was opened with.
    pub fn url(&self) -> &str {
        &self.bucket.url
    }

    /// The part every other one builds on.
    fn shared(&self) -> coordination::Shared<'_> {
        coordination::Shared {
            bucket: &self.bucket,
            grace: self.grace,
            known: &self.known,
        }
    }

    /// The reads.
    fn reader(&self) -> read::Reader<'_> {
        read::Reader::over(self.shared())
    }

    /// The writes.
    fn writer(&self) -> write::Writer<'_> {
        write::Writer::over(self.reader(), self.pack_bytes, self.compress)
    }

    /// Retention and collection.
    fn collector(&self) -> gc::Collector<'_> {
        gc::Collector::over(self.writer())
    }

    /// Global steps.
    fn coordinator(&self) -> global::Coordinator<'_> {
        global::Coordinator::over(self.writer())
    }
}
