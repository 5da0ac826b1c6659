//! `cargo bench -p ckptstore-bench --bench sim [-- RANKS...]`
//!
//! The coordinator's commit of one global step of 1,000 and 10,000
//! simulated ranks (default; or the world sizes given) against an
//! in-memory bucket that answers every request 30 ms late
//! (`object_store::throttle::ThrottledStore`): the shards are uploaded
//! first with no wait (each rank's `Remote` of its own, 8 at a time), then
//! the commit is timed and its requests counted. A commit that read the
//! ranks' shard manifests one after another would take ranks x 30 ms.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ckptstore::{Entry, Remote, ShardHash, Step};
use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::throttle::{ThrottleConfig, ThrottledStore};
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

type Result<T = (), E = Box<dyn std::error::Error + Send + Sync>> = std::result::Result<T, E>;

const LATENCY: Duration = Duration::from_millis(30);
const THREADS: u32 = 8;

/// Counts the requests made through it, and when each went to which
/// prefix (the key up to its last `/`: how S3 is taken to partition here).
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn ObjectStore>,
    calls: AtomicUsize,
    log: Mutex<Vec<(Instant, String)>>,
}

impl fmt::Display for Counting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Counting({})", self.inner)
    }
}

impl Counting {
    fn new(inner: Arc<dyn ObjectStore>) -> Counting {
        let (calls, log) = (AtomicUsize::new(0), Mutex::new(Vec::new()));
        Counting { inner, calls, log }
    }

    fn count(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }

    fn logged(&self, key: &Path) {
        self.count();
        let key = key.as_ref();
        let prefix = key.rsplit_once('/').map_or("", |(p, _)| p).to_owned();
        if let Ok(mut log) = self.log.lock() {
            log.push((Instant::now(), prefix));
        }
    }

    /// Start counting again.
    fn reset(&self) {
        self.calls.store(0, Ordering::SeqCst);
        if let Ok(mut log) = self.log.lock() {
            log.clear();
        }
    }

    /// The most requests to one prefix within any second, and the prefix.
    fn hottest(&self) -> (usize, String) {
        let Ok(log) = self.log.lock() else {
            return (0, String::new());
        };
        let mut by_prefix: std::collections::BTreeMap<&str, Vec<Instant>> = Default::default();
        for (at, prefix) in log.iter() {
            by_prefix.entry(prefix).or_default().push(*at);
        }
        let mut hottest = (0, String::new());
        for (prefix, times) in by_prefix {
            let mut start = 0;
            for end in 0..times.len() {
                while times[end].duration_since(times[start]) >= Duration::from_secs(1) {
                    start += 1;
                }
                if end + 1 - start > hottest.0 {
                    hottest = (end + 1 - start, prefix.to_owned());
                }
            }
        }
        hottest
    }
}

#[async_trait::async_trait]
impl ObjectStore for Counting {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.logged(location);
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.count();
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.logged(location);
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.count();
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.count();
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.count();
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.count();
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.count();
        self.inner.copy_opts(from, to, options).await
    }
}

/// Every request `latency` late.
fn late(latency: Duration) -> ThrottleConfig {
    ThrottleConfig {
        wait_delete_per_call: latency,
        wait_get_per_call: latency,
        wait_list_per_call: latency,
        wait_list_with_delimiter_per_call: latency,
        wait_put_per_call: latency,
        ..ThrottleConfig::default()
    }
}

/// One world size: (seconds, requests) of the coordinator's commit, and
/// its hottest prefix (requests in a second, the prefix).
fn commit_of(n: u32) -> Result<(f64, usize, (usize, String))> {
    let throttled = Arc::new(ThrottledStore::new(
        InMemory::new(),
        ThrottleConfig::default(),
    ));
    let counting = Arc::new(Counting::new(throttled.clone()));
    let store: Arc<dyn ObjectStore> = counting.clone();
    let names: Mutex<Vec<(u32, ShardHash)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| -> Result {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (store, names) = (store.clone(), &names);
                s.spawn(move || -> Result {
                    for rank in (t..n).step_by(THREADS as usize) {
                        let remote = Remote::with_store(store.clone(), "run", "mem://run")?;
                        let mut shard = Step::new(1);
                        shard.insert("rank", Entry::Blob(rank.to_le_bytes().to_vec()));
                        let info = remote.upload_shard(1, rank, n, &shard)?;
                        names.lock().map_err(|_| "lock")?.push((rank, info.shard));
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().map_err(|_| "a worker panicked")??;
        }
        Ok(())
    })?;
    let mut names = names.into_inner().map_err(|_| "lock")?;
    names.sort_by_key(|(rank, _)| *rank);
    let names: Vec<ShardHash> = names.into_iter().map(|(_, name)| name).collect();
    throttled.config_mut(|c| *c = late(LATENCY));
    let coordinator = Remote::with_store(store, "run", "mem://run")?;
    counting.reset();
    let started = Instant::now();
    coordinator.commit_global(1, &names)?;
    let seconds = started.elapsed().as_secs_f64();
    let requests = counting.calls.load(Ordering::SeqCst);
    Ok((seconds, requests, counting.hottest()))
}

fn main() -> Result {
    let given: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let worlds = if given.is_empty() {
        vec![1_000, 10_000]
    } else {
        given
    };
    println!(
        "the coordinator's commit, every request {} ms late",
        LATENCY.as_millis()
    );
    println!("| ranks | commit (s) | one after another (s, ranks x latency) | requests | requests per rank | hottest prefix (requests in a second) |");
    println!("|---|---|---|---|---|---|");
    for n in worlds {
        let (seconds, requests, (hot, prefix)) = commit_of(n)?;
        let serial = f64::from(n) * LATENCY.as_secs_f64();
        println!(
            "| {n} | {seconds:.2} | {serial:.1} | {requests} | {:.2} | {hot} (`{prefix}/`) |",
            requests as f64 / f64::from(n)
        );
    }
    Ok(())
}
