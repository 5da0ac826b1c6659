//! Object storage: committed steps replicated to a bucket (S3 or a
//! directory) through the `object_store` crate, and restored from the
//! bucket alone. See [`layout`] for the names in the bucket.

mod coordination;
mod format;
mod gc;
mod global;
mod read;
mod s3;
mod write;

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

pub use crate::error::BucketError;
use crate::format::manifest::Hash;
use crate::{Error, Result};
pub(crate) use format::layout::Commit;
use format::layout::{parse_chunk, Layout, StepHash, COMMITS, DELETED, MANIFESTS};
pub use format::layout::{MAX_MANIFEST_BYTES, MAX_WORLD_SIZE};
pub use format::pack_format::DEFAULT_PACK_BYTES;

pub use gc::retention::GcReport;
pub use global::shards::{ShardInfo, ShardStatus, ShardUpload};
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
    store: Arc<dyn ObjectStore>,
    layout: Layout,
    url: String,
    grace: Duration,
    retry_window: Duration,
    /// Where the bucket is, for `s3://` URLs (the client is built again
    /// when the retry window changes).
    s3_bucket: Option<String>,
    /// The directory of a `file://` URL: empty while it is missing, the
    /// first write creates it.
    dir: Option<std::path::PathBuf>,
    /// The process that opened it: a forked child may not use it.
    owner: crate::process::Owner,
    /// Always there until dropped; leaked rather than shut down in a
    /// forked child (its threads are the parent's).
    runtime: Option<tokio::runtime::Runtime>,
    /// The size a shard's new pack objects are filled to.
    pack_bytes: u64,
    /// Where chunks this remote wrote or read lie in the bucket's packs.
    known: std::sync::Mutex<write::packs::Known>,
}

impl Drop for Remote {
    fn drop(&mut self) {
        if self.owner.forked() {
            std::mem::forget(self.runtime.take());
        }
    }
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl Remote {
    /// Open `url`: `s3://BUCKET/PREFIX` (credentials, endpoint and region
    /// from `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
    /// `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`) or `file:///DIR` (a directory
    /// as a bucket: it reads as empty while it is missing, the first write
    /// creates it, and every object and its directory is fsynced before a
    /// commit names it). Nothing is requested yet.
    ///
    /// # Errors
    /// [`BucketError::InvalidUrl`](crate::BucketError::InvalidUrl) for another scheme or a malformed URL.
    pub fn open(url: &str) -> Result<Remote> {
        let invalid = |reason: &str| -> Error {
            BucketError::InvalidUrl {
                url: url.to_owned(),
                reason: reason.to_owned(),
            }
            .into()
        };
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(invalid("no bucket named"));
            }
            let store = s3::s3_store(url, bucket, DEFAULT_RETRY_WINDOW)?;
            let mut remote = Remote::with_store(store, prefix, url)?;
            remote.s3_bucket = Some(bucket.to_owned());
            Ok(remote)
        } else if let Some(dir) = url.strip_prefix("file://") {
            if !dir.starts_with('/') {
                return Err(invalid("a file:// URL needs an absolute path: file:///DIR"));
            }
            let fs = object_store::local::LocalFileSystem::new().with_fsync(true);
            let mut remote = Remote::with_store(Arc::new(fs), dir, url)?;
            remote.dir = Some(dir.into());
            Ok(remote)
        } else {
            Err(invalid("the scheme must be s3:// or file://"))
        }
    }

    /// A remote over any [`ObjectStore`] (tests inject faults this way),
    /// at `prefix` in it; `url` names it in errors.
    ///
    /// # Errors
    /// [`BucketError::InvalidUrl`](crate::BucketError::InvalidUrl) when `prefix` is not a valid object path.
    pub fn with_store(store: Arc<dyn ObjectStore>, prefix: &str, url: &str) -> Result<Remote> {
        let prefix =
            Path::parse(prefix.trim_matches('/')).map_err(|e| BucketError::InvalidUrl {
                url: url.to_owned(),
                reason: e.to_string(),
            })?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| Error::Io {
                op: "start the runtime for",
                path: url.into(),
                source,
            })?;
        Ok(Remote {
            store,
            layout: Layout { prefix },
            url: url.to_owned(),
            grace: DEFAULT_GRACE_PERIOD,
            retry_window: DEFAULT_RETRY_WINDOW,
            s3_bucket: None,
            dir: None,
            owner: crate::process::Owner::current(),
            runtime: Some(runtime),
            pack_bytes: format::pack_format::DEFAULT_PACK_BYTES,
            known: std::sync::Mutex::default(),
        })
    }

    /// Set how long requests to a server that does not answer are retried
    /// (default [`DEFAULT_RETRY_WINDOW`], 30 s): a restart or an outage
    /// shorter than this is waited out, a longer one fails the operation
    /// with an error naming the URL. For `s3://` remotes (a directory does
    /// not retry; a store given to [`with_store`](Self::with_store) keeps
    /// its own policy).
    ///
    /// # Errors
    /// [`BucketError::Request`](crate::BucketError::Request) if the client cannot be configured again.
    pub fn with_retry_window(mut self, window: Duration) -> Result<Remote> {
        if let Some(bucket) = &self.s3_bucket {
            self.store = s3::s3_store(&self.url, bucket, window)?;
        }
        self.retry_window = window;
        Ok(self)
    }

    /// The retry window.
    pub fn retry_window(&self) -> Duration {
        self.retry_window
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

    /// Whether the bucket is there: for a `file://` URL, whether its
    /// directory exists; for `s3://`, whether the bucket answers a listing.
    /// Commands that only read (`ckpt ls`, `show`, `verify`, `gc`, `pull`)
    /// check this first, so that a mistyped URL is an error rather than an
    /// empty bucket.
    pub fn exists(&self) -> Result<bool> {
        if let Some(dir) = &self.dir {
            return Ok(dir.is_dir());
        }
        let prefix = self.layout.folder(COMMITS);
        let listed = self.run(async {
            let mut listing = self.store.list(Some(&prefix));
            listing.try_next().await.map(drop)
        })?;
        match listed.map_err(|e| self.error("listing", &prefix, e)) {
            Ok(()) => Ok(true),
            Err(Error::Bucket(BucketError::NoBucket { .. })) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The URL this remote was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Run `f`, a request for `key`, to completion; its error becomes
    /// [`BucketError::Request`](crate::BucketError::Request) (or [`BucketError::NoBucket`](crate::BucketError::NoBucket)).
    fn block_on<T>(
        &self,
        op: &str,
        key: &Path,
        f: impl Future<Output = object_store::Result<T>>,
    ) -> Result<T> {
        self.run(f)?.map_err(|e| self.error(op, key, e))
    }

    /// Run `f` to completion on the remote's runtime, in the process that
    /// opened the remote only.
    fn run<F: Future>(&self, f: F) -> Result<F::Output> {
        self.owner.check(&|| format!("remote {}", self.url))?;
        let runtime = self.runtime.as_ref().ok_or_else(|| Error::Forked {
            what: format!("remote {}", self.url),
            opened_by: 0,
            this: std::process::id(),
        })?;
        Ok(runtime.block_on(f))
    }

    /// `e`, from a request for `key`, as this crate's error: a missing
    /// bucket said plainly.
    pub(crate) fn error(&self, op: &str, key: &Path, e: object_store::Error) -> Error {
        remote_error(&self.url, &self.layout.url_of(&self.url, key), op, e)
    }

    fn put(&self, key: &Path, bytes: Vec<u8>) -> Result<()> {
        let payload = PutPayload::from(bytes);
        let put = self.run(self.store.put(key, payload))?;
        match put {
            Ok(_) => Ok(()),
            // S3 answers a write to a missing bucket with 404.
            Err(object_store::Error::NotFound { source, .. }) => Err(BucketError::NoBucket {
                url: self.url.clone(),
                source: Some(source),
            }
            .into()),
            Err(e) => Err(self.error("writing", key, e)),
        }
    }

    /// The bytes at `key`, or `None` if there is no such object; an object
    /// larger than `cap` bytes is refused as [`Error::Corrupt`] before it
    /// is read.
    fn get_bytes(&self, key: &Path, cap: u64) -> Result<Option<bytes::Bytes>> {
        let got = self.run(async {
            match self.store.get(key).await {
                Ok(r) if r.meta.size > cap => Ok(Err(r.meta.size)),
                Ok(r) => r.bytes().await.map(|b| Ok(Some(b))),
                Err(object_store::Error::NotFound { .. }) => Ok(Ok(None)),
                Err(e) => Err(e),
            }
        })?;
        got.map_err(|e| self.error("reading", key, e))?
            .map_err(|size| {
                Error::corrupt(
                    None,
                    format!(
                        "{} is {size} bytes (at most {cap} are read)",
                        self.layout.url_of(&self.url, key)
                    ),
                )
            })
    }

    /// Names of the objects in `folder`.
    fn list_names(&self, folder: &str) -> Result<Vec<String>> {
        self.list_keys(&self.layout.folder(folder))
    }

    /// The name of each object directly in folder `prefix` (not in a
    /// folder below it: another prefix's objects may be there).
    fn list_keys(&self, prefix: &Path) -> Result<Vec<String>> {
        Ok(self
            .list_under(prefix, 1)?
            .into_iter()
            .map(|(mut parts, _)| parts.remove(0))
            .collect())
    }

    /// Each object `depth` folders down from `prefix`: its name's parts
    /// below `prefix`, and its metadata. A `file://` bucket whose
    /// directory is missing is empty (and not created).
    pub(crate) fn list_under(
        &self,
        prefix: &Path,
        depth: usize,
    ) -> Result<Vec<(Vec<String>, object_store::ObjectMeta)>> {
        if self.dir.as_ref().is_some_and(|d| !d.is_dir()) {
            return Ok(Vec::new());
        }
        let found: Vec<object_store::ObjectMeta> = self.block_on("listing", prefix, async {
            self.store.list(Some(prefix)).try_collect().await
        })?;
        Ok(found
            .into_iter()
            .filter_map(|meta| {
                let parts: Vec<String> = meta
                    .location
                    .prefix_match(prefix)?
                    .map(|p| p.as_ref().to_owned())
                    .collect();
                (parts.len() == depth).then_some((parts, meta))
            })
            .collect())
    }

    /// The (step, hash) of every manifest object.
    pub(crate) fn manifest_names(&self) -> Result<HashSet<(u64, Hash)>> {
        Ok(self
            .list_names(MANIFESTS)?
            .iter()
            .filter_map(|n| n.strip_suffix(".json")?.parse::<StepHash>().ok())
            .map(|n| (n.step, n.hash))
            .collect())
    }

    /// The (step, manifest hash) of every step retention deleted.
    pub(crate) fn deleted(&self) -> Result<Vec<(u64, Hash)>> {
        Ok(self
            .list_names(DELETED)?
            .iter()
            .filter_map(|n| n.parse::<StepHash>().ok())
            .map(|n| (n.step, n.hash))
            .collect())
    }

    /// Delete `key`; a key already gone is fine.
    fn delete(&self, key: &Path) -> Result<()> {
        let deleted = self.run(async {
            match self.store.delete(key).await {
                Err(object_store::Error::NotFound { .. }) => Ok(()),
                other => other,
            }
        })?;
        deleted.map_err(|e| self.error("deleting", key, e))
    }

    /// Every chunk and pack object in the bucket: what a manifest may
    /// need ([`RemoteManifest::objects`](format::manifest::RemoteManifest::objects)).
    pub(crate) fn objects(&self) -> Result<HashSet<format::pack_format::Object>> {
        let chunks = self
            .chunk_hashes()?
            .into_iter()
            .map(format::pack_format::Object::Chunk);
        let packs = self
            .pack_names()?
            .into_iter()
            .map(format::pack_format::Object::Pack);
        Ok(chunks.chain(packs).collect())
    }

    /// The names of every pack in the bucket.
    pub(crate) fn pack_names(&self) -> Result<HashSet<Hash>> {
        Ok(self
            .list_names(format::layout::PACKS)?
            .iter()
            .filter_map(|n| parse_chunk(n))
            .collect())
    }

    /// The hashes of every chunk in the bucket.
    pub(crate) fn chunk_hashes(&self) -> Result<HashSet<Hash>> {
        Ok(self
            .list_names(format::layout::CHUNKS)?
            .iter()
            .filter_map(|n| parse_chunk(n))
            .collect())
    }
}

/// The `s3://` client for `bucket`, retrying for `window`.
/// The one mapping of an `object_store` error to this crate's: `e`, from
/// `op` on `object` (a URL) of the remote at `url`. What the S3 backend
/// knows of the answer ([`s3::S3Answer`]) comes first: a missing bucket,
/// missing credentials.
fn remote_error(url: &str, object: &str, op: &str, e: object_store::Error) -> Error {
    let op = match s3::answer_of(&e) {
        Some(s3::S3Answer::NoSuchBucket) => {
            return BucketError::NoBucket {
                url: url.to_owned(),
                source: Some(Box::new(e)),
            }
            .into()
        }
        Some(s3::S3Answer::NoInstanceCredentials { .. }) => format!(
            "{op} (no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or run \
             where instance credentials exist)"
        ),
        None => op.to_owned(),
    };
    BucketError::Request {
        op,
        url: object.to_owned(),
        reason: reason(&e),
        source: Box::new(e),
    }
    .into()
}

/// What `e` says, without the store's own form of the object's path
/// (relative, no leading `/`): the error names the object by its URL.
fn reason(e: &object_store::Error) -> String {
    use object_store::Error as E;
    match e {
        E::NotFound { source, .. } => format!("no such object ({source})"),
        E::AlreadyExists { source, .. } => format!("the object already exists ({source})"),
        E::Precondition { source, .. } => format!("a precondition failed ({source})"),
        E::NotModified { source, .. } => format!("the object was not modified ({source})"),
        E::PermissionDenied { source, .. } => format!("permission denied ({source})"),
        E::Unauthenticated { source, .. } => format!("not authenticated ({source})"),
        other => other.to_string(),
    }
}
