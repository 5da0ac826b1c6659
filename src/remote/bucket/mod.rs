//! The bucket's object I/O, which every part of `remote` uses: a
//! [`Bucket`] puts, gets, lists and deletes objects at the names of its
//! [`Layout`], on a runtime of its own, and maps each `object_store` error
//! to this crate's in one place ([`remote_error`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use super::format::layout::{Layout, COMMITS};
use super::s3;

mod listing;
use crate::error::BucketError;
use crate::{Error, Result};
use object_store::list::PaginatedListStore;

/// A bucket (or a prefix in one): the object store, where the objects
/// are in it, and the runtime its requests run on.
pub(crate) struct Bucket {
    store: Arc<dyn ObjectStore>,
    pub(crate) layout: Layout,
    pub(crate) url: String,
    pub(crate) retry_window: Duration,
    /// Where the bucket is, for `s3://` URLs (the client is built again
    /// when the retry window changes).
    pub(crate) s3_name: Option<String>,
    /// What sends an `s3://` bucket's HTTP requests, where not reqwest
    /// ([`Remote::open_with_connector`](super::Remote::open_with_connector)).
    connector: Option<Arc<dyn object_store::client::HttpConnector>>,
    /// The same client as `store`, for listings by any key prefix, a page
    /// at a time (S3's).
    pages: Option<Arc<dyn PaginatedListStore>>,
    /// The directory of a `file://` URL: empty while it is missing, the
    /// first write creates it.
    pub(crate) dir: Option<std::path::PathBuf>,
    /// The process that opened it: a forked child may not use it.
    owner: crate::process::Owner,
    /// Always there until dropped; leaked rather than shut down in a
    /// forked child (its threads are the parent's). Shared with the
    /// buckets [`sibling`](Self::sibling) made: a client's pooled
    /// connections are driven by the runtime that opened them, so one
    /// store is used from one runtime only.
    runtime: Option<Arc<tokio::runtime::Runtime>>,
}

impl Drop for Bucket {
    fn drop(&mut self) {
        if self.owner.forked() {
            std::mem::forget(self.runtime.take());
        }
    }
}

impl Bucket {
    /// `url` opened ([`Remote::open`](super::Remote::open)), an `s3://`
    /// URL's requests sent through `connector` where given.
    pub(crate) fn open(
        url: &str,
        connector: Option<Arc<dyn object_store::client::HttpConnector>>,
    ) -> Result<Bucket> {
        let invalid = |reason: &str| -> Error {
            BucketError::InvalidUrl {
                url: url.to_owned(),
                reason: reason.to_owned(),
            }
            .into()
        };
        if let Some(rest) = url.strip_prefix("s3://") {
            let (name, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if name.is_empty() {
                return Err(invalid("no bucket named"));
            }
            let store = s3::s3_store(name, super::DEFAULT_RETRY_WINDOW, connector.clone())
                .map_err(|e| remote_error(url, url, "configuring", e))?;
            // A connector's clients do their own I/O (as object_store's
            // `SpawnedReqwestConnector` does, on a runtime of the caller's):
            // the bucket's runtime then drives timers only, and holds no
            // file descriptor.
            let io = connector.is_none();
            let mut bucket = Bucket::over(store.clone(), prefix, url, io)?;
            bucket.pages = Some(store);
            bucket.s3_name = Some(name.to_owned());
            bucket.connector = connector;
            Ok(bucket)
        } else if connector.is_some() {
            Err(invalid(
                "requests go through a connector for s3:// URLs only",
            ))
        } else if let Some(dir) = url.strip_prefix("file://") {
            if !dir.starts_with('/') {
                return Err(invalid("a file:// URL needs an absolute path: file:///DIR"));
            }
            let fs = object_store::local::LocalFileSystem::new().with_fsync(true);
            let mut bucket = Bucket::with_store(Arc::new(fs), dir, url)?;
            bucket.dir = Some(dir.into());
            Ok(bucket)
        } else {
            Err(invalid("the scheme must be s3:// or file://"))
        }
    }

    /// A bucket over `store` at `prefix` in it
    /// ([`Remote::with_store`](super::Remote::with_store)).
    pub(crate) fn with_store(
        store: Arc<dyn ObjectStore>,
        prefix: &str,
        url: &str,
    ) -> Result<Bucket> {
        Bucket::over(store, prefix, url, true)
    }

    /// A bucket over `store` at `prefix`, its runtime driving I/O where
    /// `io`, else timers only.
    fn over(store: Arc<dyn ObjectStore>, prefix: &str, url: &str, io: bool) -> Result<Bucket> {
        let prefix =
            Path::parse(prefix.trim_matches('/')).map_err(|e| BucketError::InvalidUrl {
                url: url.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(Bucket {
            store,
            layout: Layout { prefix },
            url: url.to_owned(),
            retry_window: super::DEFAULT_RETRY_WINDOW,
            s3_name: None,
            connector: None,
            pages: None,
            dir: None,
            owner: crate::process::Owner::current(),
            runtime: Some(Arc::new(runtime_for(url, io)?)),
        })
    }

    /// The same objects, through the same client and runtime
    /// ([`Remote::compressing`](super::Remote::compressing)); in the
    /// process that opened this one only.
    pub(crate) fn sibling(&self) -> Result<Bucket> {
        let runtime = Arc::clone(self.runtime()?);
        Ok(Bucket {
            store: Arc::clone(&self.store),
            layout: self.layout.clone(),
            url: self.url.clone(),
            retry_window: self.retry_window,
            s3_name: self.s3_name.clone(),
            connector: self.connector.clone(),
            pages: self.pages.clone(),
            dir: self.dir.clone(),
            owner: crate::process::Owner::current(),
            runtime: Some(runtime),
        })
    }

    /// Retry requests for `window`
    /// ([`Remote::with_retry_window`](super::Remote::with_retry_window)).
    pub(crate) fn set_retry_window(&mut self, window: Duration) -> Result<()> {
        if let Some(name) = &self.s3_name {
            let store = s3::s3_store(name, window, self.connector.clone())
                .map_err(|e| remote_error(&self.url, &self.url, "configuring", e))?;
            self.store = store.clone();
            self.pages = Some(store);
        }
        self.retry_window = window;
        Ok(())
    }

    /// Whether the bucket is there: for a `file://` URL, whether its
    /// directory exists; for `s3://`, whether the bucket answers a listing.
    pub(crate) fn exists(&self) -> Result<bool> {
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

    /// Run `f`, a request for `key`, to completion; its error becomes
    /// [`BucketError::Request`](crate::BucketError::Request) (or
    /// [`BucketError::NoBucket`](crate::BucketError::NoBucket)).
    pub(crate) fn block_on<T>(
        &self,
        op: &str,
        key: &Path,
        f: impl Future<Output = object_store::Result<T>>,
    ) -> Result<T> {
        self.run(f)?.map_err(|e| self.error(op, key, e))
    }

    /// Run `f` to completion on the remote's runtime, in the process that
    /// opened the remote only.
    pub(crate) fn run<F: Future>(&self, f: F) -> Result<F::Output> {
        Ok(self.runtime()?.block_on(f))
    }

    /// The runtime, in the process that opened the remote only.
    fn runtime(&self) -> Result<&Arc<tokio::runtime::Runtime>> {
        self.owner.check(&|| format!("remote {}", self.url))?;
        self.runtime.as_ref().ok_or_else(|| Error::Forked {
            what: format!("remote {}", self.url),
            opened_by: 0,
            this: std::process::id(),
        })
    }

    /// `e`, from a request for `key`, as this crate's error: a missing
    /// bucket said plainly.
    pub(crate) fn error(&self, op: &str, key: &Path, e: object_store::Error) -> Error {
        remote_error(&self.url, &self.layout.url_of(&self.url, key), op, e)
    }

    /// `e`, from a write of `key`: as [`error`](Self::error), and a 404
    /// (S3's answer to a write to a missing bucket) a missing bucket.
    fn write_error(&self, op: &str, key: &Path, e: object_store::Error) -> Error {
        match e {
            object_store::Error::NotFound { source, .. } => BucketError::NoBucket {
                url: self.url.clone(),
                source: Some(source),
            }
            .into(),
            e => self.error(op, key, e),
        }
    }

    pub(crate) fn put(&self, key: &Path, bytes: Vec<u8>) -> Result<()> {
        let payload = PutPayload::from(bytes);
        let put = self.run(self.store.put(key, payload))?;
        put.map(drop)
            .map_err(|e| self.write_error("writing", key, e))
    }

    /// The bytes at `key`, or `None` if there is no such object; an object
    /// larger than `cap` bytes is refused as [`Error::Corrupt`] before it
    /// is read.
    pub(crate) fn get_bytes(&self, key: &Path, cap: u64) -> Result<Option<bytes::Bytes>> {
        self.run(self.fetch_bytes(key, cap))?
    }

    /// [`get_bytes`](Self::get_bytes), as a future of this bucket's
    /// runtime (for several in flight).
    pub(crate) async fn fetch_bytes(&self, key: &Path, cap: u64) -> Result<Option<bytes::Bytes>> {
        let got = match self.store.get(key).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.error("reading", key, e)),
        };
        if got.meta.size > cap {
            let url = self.layout.url_of(&self.url, key);
            let size = got.meta.size;
            let why = format!("{url} is {size} bytes (at most {cap} are read)");
            return Err(Error::corrupt(None, why));
        }
        got.bytes()
            .await
            .map(Some)
            .map_err(|e| self.error("reading", key, e))
    }

    /// Delete `key`; a key already gone is fine.
    pub(crate) fn delete(&self, key: &Path) -> Result<()> {
        let deleted = self.run(async {
            match self.store.delete(key).await {
                Err(object_store::Error::NotFound { .. }) => Ok(()),
                other => other,
            }
        })?;
        deleted.map_err(|e| self.error("deleting", key, e))
    }
}

/// What a ranged read found ([`Bucket::get_span`]).
pub(crate) enum Fetched {
    /// The bytes asked for.
    Bytes(bytes::Bytes),
    /// The object holds fewer bytes than asked for (or, read whole, not
    /// exactly as many): it holds `size`.
    Short { size: u64 },
    /// There is no such object.
    Missing,
}

/// Requests to run several at a time on the bucket's runtime (inside
/// [`Bucket::run`]), each error mapped as the blocking ones are.
impl Bucket {
    /// Put `payload` at `key` (`op` names the request in an error).
    pub(crate) async fn put_async(&self, key: &Path, payload: PutPayload, op: &str) -> Result<()> {
        let put = self.store.put(key, payload).await;
        put.map(drop).map_err(|e| self.write_error(op, key, e))
    }

    /// The length of the object at `key`, if there is one (a HEAD).
    pub(crate) async fn size_of(&self, key: &Path) -> Result<Option<u64>> {
        match self.store.head(key).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error("looking for", key, e)),
        }
    }

    /// Whether there is an object at `key` (a HEAD).
    pub(crate) async fn has(&self, key: &Path) -> Result<bool> {
        Ok(self.size_of(key).await?.is_some())
    }

    /// Bytes `at..at + len` of the object at `key`, unchecked, or, with no
    /// `at`, the whole object, which must be `len` bytes long (refused as
    /// `Short` before its body is read).
    pub(crate) async fn get_span(
        &self,
        key: &Path,
        at: Option<u64>,
        len: usize,
    ) -> Result<Fetched> {
        let got = match at {
            None => match self.store.get(key).await {
                Ok(got) if usize::try_from(got.meta.size).ok() != Some(len) => Ok(Fetched::Short {
                    size: got.meta.size,
                }),
                Ok(got) => got.bytes().await.map(Fetched::Bytes),
                Err(e) => Err(e),
            },
            Some(at) => {
                let range = at..at + len as u64;
                match self.store.get_range(key, range.clone()).await {
                    // A server may answer a range that runs past the end
                    // with what there is.
                    Ok(bytes) if bytes.len() != len => Ok(Fetched::Short {
                        size: at + bytes.len() as u64,
                    }),
                    Ok(bytes) => Ok(Fetched::Bytes(bytes)),
                    Err(e @ object_store::Error::NotFound { .. }) => Err(e),
                    // A range the object does not hold is damage; else the
                    // bucket failed.
                    Err(e) => match self.store.head(key).await {
                        Ok(meta) if meta.size < range.end => Ok(Fetched::Short { size: meta.size }),
                        _ => Err(e),
                    },
                }
            }
        };
        match got {
            Ok(fetched) => Ok(fetched),
            Err(object_store::Error::NotFound { .. }) => Ok(Fetched::Missing),
            Err(e) => Err(self.error("reading", key, e)),
        }
    }
}

/// The runtime a bucket at `url` runs its requests on.
fn runtime_for(url: &str, io: bool) -> Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_time();
    if io {
        builder.enable_io();
    }
    builder.build().map_err(|source| Error::Io {
        op: "start the runtime for",
        path: url.into(),
        source,
    })
}

/// The one mapping of an `object_store` error to this crate's: `e`, from
/// `op` on `object` (a URL) of the remote at `url`. What the S3 backend
/// knows of the answer ([`s3::S3Answer`]) comes first: a missing bucket,
/// missing credentials.
pub(crate) fn remote_error(url: &str, object: &str, op: &str, e: object_store::Error) -> Error {
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
