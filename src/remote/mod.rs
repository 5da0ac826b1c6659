//! Object storage: committed steps replicated to a bucket (S3 or a
//! directory) through the `object_store` crate, and restored from the
//! bucket alone. See [`layout`] for the names in the bucket.

mod layout;
mod locks;
mod push;
mod read;
mod replicate;
mod restore;
mod retention;
mod shards;
mod step;
mod verify;

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::format::manifest::Hash;
use crate::{Error, Result};
use layout::{parse_chunk, parse_commit, Layout, COMMITS, DELETED};

pub use push::PushReport;
pub use replicate::ReplicationStatus;
pub(crate) use replicate::Replicator;
pub use retention::GcReport;
pub use shards::{ShardInfo, ShardStatus};

/// Requests retried at most this often before failing: with the backoff
/// below, a server that is back within about 10 s (a restart) is waited
/// for, and an endpoint that stays unreachable fails within about 12 s.
const MAX_RETRIES: usize = 6;
/// Nor for longer than this in all.
const RETRY_TIMEOUT: Duration = Duration::from_secs(30);
/// The first wait before a retry, doubling up to the second (with jitter).
const FIRST_RETRY_WAIT: Duration = Duration::from_millis(250);
const LONGEST_RETRY_WAIT: Duration = Duration::from_secs(4);
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
    runtime: tokio::runtime::Runtime,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// A commit object found in the bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Commit {
    pub(crate) step: u64,
    /// The hash of the step's manifest.
    pub(crate) hash: Hash,
}

impl Remote {
    /// Open `url`: `s3://BUCKET/PREFIX` (credentials, endpoint and region
    /// from `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
    /// `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`) or `file:///DIR` (a directory
    /// as a bucket, created if missing). Nothing is requested yet.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for another scheme or a malformed URL.
    pub fn open(url: &str) -> Result<Remote> {
        let invalid = |reason: &str| Error::InvalidUrl {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let (store, prefix): (Arc<dyn ObjectStore>, &str) =
            if let Some(rest) = url.strip_prefix("s3://") {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    return Err(invalid("no bucket named"));
                }
                let retry = object_store::RetryConfig {
                    max_retries: MAX_RETRIES,
                    retry_timeout: RETRY_TIMEOUT,
                    backoff: object_store::BackoffConfig {
                        init_backoff: FIRST_RETRY_WAIT,
                        max_backoff: LONGEST_RETRY_WAIT,
                        base: 2.0,
                    },
                };
                // Client options replace those from_env read: take the one
                // that matters here again.
                let allow_http = std::env::var("AWS_ALLOW_HTTP")
                    .is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
                let client = object_store::ClientOptions::new()
                    .with_allow_http(allow_http)
                    .with_timeout(REQUEST_TIMEOUT)
                    .with_connect_timeout(CONNECT_TIMEOUT);
                let s3 = object_store::aws::AmazonS3Builder::from_env()
                    .with_bucket_name(bucket)
                    .with_retry(retry)
                    .with_client_options(client)
                    .build()
                    .map_err(|e| remote_error(url, "configuring", e))?;
                (Arc::new(s3), prefix)
            } else if let Some(dir) = url.strip_prefix("file://") {
                if !dir.starts_with('/') {
                    return Err(invalid("a file:// URL needs an absolute path: file:///DIR"));
                }
                std::fs::create_dir_all(dir).map_err(|source| Error::Io {
                    op: "create directory",
                    path: dir.into(),
                    source,
                })?;
                let fs = object_store::local::LocalFileSystem::new_with_prefix(dir)
                    .map_err(|e| remote_error(url, "opening", e))?;
                (Arc::new(fs), "")
            } else {
                return Err(invalid("the scheme must be s3:// or file://"));
            };
        Remote::with_store(store, prefix, url)
    }

    /// A remote over any [`ObjectStore`] (tests inject faults this way),
    /// at `prefix` in it; `url` names it in errors.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] when `prefix` is not a valid object path.
    pub fn with_store(store: Arc<dyn ObjectStore>, prefix: &str, url: &str) -> Result<Remote> {
        let prefix = Path::parse(prefix.trim_matches('/')).map_err(|e| Error::InvalidUrl {
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
            runtime,
        })
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

    /// The URL this remote was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Run `f` to completion; its error becomes [`Error::Remote`].
    fn block_on<T>(&self, op: &str, f: impl Future<Output = object_store::Result<T>>) -> Result<T> {
        self.runtime
            .block_on(f)
            .map_err(|e| remote_error(&self.url, op, e))
    }

    fn put(&self, key: &Path, bytes: Vec<u8>) -> Result<()> {
        let payload = PutPayload::from(bytes);
        self.block_on("writing to", self.store.put(key, payload))
            .map(|_| ())
    }

    /// The bytes at `key`, or `None` if there is no such object.
    fn get_bytes(&self, key: &Path) -> Result<Option<bytes::Bytes>> {
        let got = self.runtime.block_on(async {
            match self.store.get(key).await {
                Ok(r) => r.bytes().await.map(Some),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        });
        got.map_err(|e| remote_error(&self.url, "reading from", e))
    }

    /// Names of the objects in `folder`.
    fn list_names(&self, folder: &str) -> Result<Vec<String>> {
        self.list_keys(&self.layout.folder(folder))
    }

    /// The last part of the name of each object under `prefix`.
    fn list_keys(&self, prefix: &Path) -> Result<Vec<String>> {
        self.block_on("listing", async {
            self.store
                .list(Some(prefix))
                .map_ok(|meta| meta.location.filename().unwrap_or_default().to_owned())
                .try_collect()
                .await
        })
    }

    /// Every commit object, by ascending step.
    pub(crate) fn commits(&self) -> Result<Vec<Commit>> {
        let mut commits: Vec<Commit> = self
            .list_names(COMMITS)?
            .iter()
            .filter_map(|n| parse_commit(n))
            .map(|(step, hash)| Commit { step, hash })
            .collect();
        commits.sort_by_key(|c| (c.step, c.hash));
        Ok(commits)
    }

    /// The (step, manifest hash) of every step retention deleted.
    pub(crate) fn deleted(&self) -> Result<Vec<(u64, Hash)>> {
        Ok(self
            .list_names(DELETED)?
            .iter()
            .filter_map(|n| parse_commit(n))
            .collect())
    }

    /// Delete `key`; a key already gone is fine.
    fn delete(&self, key: &Path) -> Result<()> {
        let deleted = self.runtime.block_on(async {
            match self.store.delete(key).await {
                Err(object_store::Error::NotFound { .. }) => Ok(()),
                other => other,
            }
        });
        deleted.map_err(|e| remote_error(&self.url, "deleting from", e))
    }

    /// Make step `step` visible: its manifest `bytes` (hashing to `hash`),
    /// then the commit naming it. Whatever the step needs must be there.
    fn put_step(&self, step: u64, hash: &Hash, bytes: Vec<u8>) -> Result<()> {
        self.put(&self.layout.manifest(step, hash), bytes)?;
        let commit = format!(
            "{{\"format\":1,\"step\":{step},\"manifest\":\"{}\"}}",
            crate::format::manifest::hex(hash)
        );
        self.put(&self.layout.commit(step, hash), commit.into_bytes())
    }

    /// The hashes of every chunk in the bucket.
    pub(crate) fn chunk_hashes(&self) -> Result<HashSet<Hash>> {
        Ok(self
            .list_names(layout::CHUNKS)?
            .iter()
            .filter_map(|n| parse_chunk(n))
            .collect())
    }
}

fn remote_error(url: &str, op: &str, e: object_store::Error) -> Error {
    Error::Remote {
        op: op.to_owned(),
        url: url.to_owned(),
        source: Box::new(e),
    }
}
