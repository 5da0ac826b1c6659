//! An object store that fails its k-th call, over an in-memory one.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use futures::stream::{self, BoxStream, StreamExt};
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

/// Fails call number `fail_at` (counting from 1; 0 never fails), and
/// every call while `down`.
#[derive(Debug)]
pub struct Failing {
    pub inner: Arc<InMemory>,
    pub calls: AtomicUsize,
    pub fail_at: AtomicUsize,
    pub down: AtomicBool,
    /// Panic instead of failing (a bug in a dependency).
    pub panics: AtomicBool,
    /// The keys of every GET, in order.
    pub gets: std::sync::Mutex<Vec<String>>,
    /// Objects returned by listings (S3 returns 1,000 per request).
    pub listed: Arc<AtomicUsize>,
    /// Writes of keys holding this (none if empty) are answered 404, as S3
    /// answers a write to a bucket that is gone.
    pub gone_for: std::sync::Mutex<String>,
    /// How long each GET waits before it is answered (a bucket some way
    /// off: zero, the default, answers at once).
    pub get_delay: std::sync::Mutex<std::time::Duration>,
    /// GETs waiting for their answer now, and the most at once.
    pub gets_in_flight: AtomicUsize,
    pub most_gets_in_flight: AtomicUsize,
}

impl Failing {
    pub fn new(inner: Arc<InMemory>, fail_at: usize) -> Self {
        Failing {
            inner,
            calls: AtomicUsize::new(0),
            fail_at: AtomicUsize::new(fail_at),
            down: AtomicBool::new(false),
            panics: AtomicBool::new(false),
            gets: std::sync::Mutex::new(Vec::new()),
            listed: Arc::new(AtomicUsize::new(0)),
            gone_for: std::sync::Mutex::new(String::new()),
            get_delay: std::sync::Mutex::new(std::time::Duration::ZERO),
            gets_in_flight: AtomicUsize::new(0),
            most_gets_in_flight: AtomicUsize::new(0),
        }
    }

    /// The requests made so far as S3 would count them: each call, and a
    /// listing's further pages of 1,000 objects.
    pub fn requests(&self) -> usize {
        self.calls.load(Ordering::SeqCst) + self.listed.load(Ordering::SeqCst) / 1000
    }

    /// Objects returned by listings since the count started.
    pub fn listed(&self) -> usize {
        self.listed.load(Ordering::SeqCst)
    }

    /// Start counting again.
    pub fn reset(&self) {
        self.calls.store(0, Ordering::SeqCst);
        self.listed.store(0, Ordering::SeqCst);
    }

    fn check(&self, op: &str) -> Result<()> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        assert!(
            !self.panics.load(Ordering::SeqCst),
            "injected panic of call {n} ({op})"
        );
        if n == self.fail_at.load(Ordering::SeqCst) || self.down.load(Ordering::SeqCst) {
            return Err(object_store::Error::Generic {
                store: "Failing",
                source: format!("injected failure of call {n} ({op})").into(),
            });
        }
        Ok(())
    }
}

impl fmt::Display for Failing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Failing({})", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for Failing {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.check("put")?;
        let gone = self
            .gone_for
            .lock()
            .map(|g| !g.is_empty() && location.as_ref().contains(g.as_str()));
        if gone.unwrap_or(false) {
            return Err(object_store::Error::NotFound {
                path: location.to_string(),
                source: "injected: the bucket is gone".into(),
            });
        }
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.check("put_multipart")?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.check("get")?;
        if let Ok(mut gets) = self.gets.lock() {
            gets.push(location.to_string());
        }
        let delay = self
            .get_delay
            .lock()
            .map_or(std::time::Duration::ZERO, |d| *d);
        if delay.is_zero() {
            return self.inner.get_opts(location, options).await;
        }
        let now = self.gets_in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_gets_in_flight.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(delay).await;
        let got = self.inner.get_opts(location, options).await;
        self.gets_in_flight.fetch_sub(1, Ordering::SeqCst);
        got
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        if let Err(e) = self.check("delete") {
            return stream::once(async move { Err(e) }).boxed();
        }
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        if let Err(e) = self.check("list") {
            return stream::once(async move { Err(e) }).boxed();
        }
        let listed = self.listed.clone();
        self.inner
            .list(prefix)
            .inspect(move |_| {
                listed.fetch_add(1, Ordering::SeqCst);
            })
            .boxed()
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        if let Err(e) = self.check("list") {
            return stream::once(async move { Err(e) }).boxed();
        }
        let listed = self.listed.clone();
        self.inner
            .list_with_offset(prefix, offset)
            .inspect(move |_| {
                listed.fetch_add(1, Ordering::SeqCst);
            })
            .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.check("list_with_delimiter")?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.check("copy")?;
        self.inner.copy_opts(from, to, options).await
    }
}

/// Holds the first `count` writes of keys containing `infix` for `delay`
/// each (blocking the caller's runtime): an upload that stalls.
#[derive(Debug)]
pub struct Slow {
    inner: Arc<dyn ObjectStore>,
    infix: &'static str,
    delay: std::time::Duration,
    count: AtomicUsize,
}

impl Slow {
    pub fn new(
        inner: Arc<dyn ObjectStore>,
        infix: &'static str,
        delay: std::time::Duration,
        count: usize,
    ) -> Self {
        Slow {
            inner,
            infix,
            delay,
            count: AtomicUsize::new(count),
        }
    }
}

impl fmt::Display for Slow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Slow({})", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for Slow {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        let slow = format!("/{location}").contains(self.infix)
            && self
                .count
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if slow {
            std::thread::sleep(self.delay);
        }
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}
