//! A simulated S3 (issue 75), for the tests and the benchmark
//! (`bench/benches/sim.rs` includes this file): `object_store`'s own S3
//! client talks to it through an [`HttpConnector`], so a `Remote` opened
//! with `Remote::open_with_connector` runs what it runs against S3 (the
//! same requests, signed, retried with `object_store`'s jittered exponential
//! backoff), while the objects live in memory.
//!
//! Each request waits [`Limits::latency`] (and [`Limits::per_byte`] for
//! each byte it carries). Each prefix (a key up to its last `/`; a
//! listing's prefix) answers at most [`Limits::writes_per_s`] PUTs and
//! DELETEs and [`Limits::reads_per_s`] GETs, HEADs and listings in a
//! second, past which `503 SlowDown`, as S3 does (3,500 and 5,500 by
//! default). Listings return 1,000 keys a page, in key order.
//!
//! The subset of S3 the crate uses: PUT, GET (ranged), HEAD, DELETE,
//! `ListObjectsV2`, and the instance metadata endpoint's credentials (for a
//! client whose environment names none). Anything else is answered
//! `501 NotImplemented`.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::ops::Bound;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpResponseBody, HttpService,
};

/// How the simulated S3 answers.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// The wait before each answer.
    pub latency: Duration,
    /// The further wait for each byte of a request's or answer's body.
    pub per_byte: Duration,
    /// PUTs and DELETEs a prefix answers in a second before `503 SlowDown`.
    pub writes_per_s: usize,
    /// GETs, HEADs and listings a prefix answers in a second.
    pub reads_per_s: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            latency: Duration::from_millis(30),
            per_byte: Duration::ZERO,
            writes_per_s: 3_500,
            reads_per_s: 5_500,
        }
    }
}

/// One stored object.
struct Object {
    body: Bytes,
    modified: SystemTime,
}

/// A prefix's requests in the current second.
#[derive(Default)]
struct Window {
    start: Option<Instant>,
    writes: usize,
    reads: usize,
}

/// The simulated bucket, shared by every client.
pub struct SimS3 {
    bucket: String,
    limits: Limits,
    objects: Mutex<BTreeMap<String, Object>>,
    windows: Mutex<HashMap<String, Window>>,
    /// Every request answered (503s included): when, and its prefix.
    log: Mutex<Vec<(Instant, String)>>,
    slowdowns: AtomicUsize,
    /// Body bytes answered to GETs of objects, by prefix.
    read: Mutex<BTreeMap<String, usize>>,
}

impl std::fmt::Debug for SimS3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimS3({})", self.bucket)
    }
}

/// A connector to the simulated bucket that counts the requests sent
/// through it (one per rank: each rank's own count).
#[derive(Clone, Debug)]
pub struct Client {
    sim: Arc<SimS3>,
    pub requests: Arc<AtomicUsize>,
}

impl SimS3 {
    /// An empty bucket named `bucket`.
    pub fn new(bucket: &str, limits: Limits) -> Arc<SimS3> {
        Arc::new(SimS3 {
            bucket: bucket.to_owned(),
            limits,
            objects: Mutex::default(),
            windows: Mutex::default(),
            log: Mutex::default(),
            slowdowns: AtomicUsize::new(0),
            read: Mutex::default(),
        })
    }

    /// A client with a count of its own.
    pub fn client(self: &Arc<Self>) -> Client {
        Client {
            sim: Arc::clone(self),
            requests: Arc::default(),
        }
    }

    /// Requests answered `503 SlowDown` so far (each retried by the client).
    pub fn slowdowns(&self) -> usize {
        self.slowdowns.load(Ordering::SeqCst)
    }

    /// Store `body` at `key`, as a client's PUT would (no request counted).
    pub fn insert(&self, key: &str, body: &[u8]) {
        if let Ok(mut objects) = self.objects.lock() {
            let body = Bytes::copy_from_slice(body);
            let modified = SystemTime::now();
            objects.insert(key.to_owned(), Object { body, modified });
        }
    }

    /// The bytes of the objects whose keys start with `prefix`.
    pub fn bytes_under(&self, prefix: &str) -> usize {
        let objects = self.objects.lock();
        objects.map_or(0, |o| {
            o.iter()
                .filter(|(k, _)| k.starts_with(prefix))
                .map(|(_, o)| o.body.len())
                .sum()
        })
    }

    /// Body bytes answered to GETs of objects whose keys start with
    /// `prefix`, since the last reset.
    pub fn bytes_read(&self, prefix: &str) -> usize {
        let read = self.read.lock();
        read.map_or(0, |r| {
            r.iter()
                .filter(|(k, _)| k.starts_with(prefix))
                .map(|(_, n)| n)
                .sum()
        })
    }

    /// Forget the requests answered so far (objects stay).
    pub fn reset(&self) {
        if let Ok(mut log) = self.log.lock() {
            log.clear();
        }
        self.slowdowns.store(0, Ordering::SeqCst);
        if let Ok(mut read) = self.read.lock() {
            read.clear();
        }
    }

    /// The most requests one prefix was sent within any second, and the
    /// prefix.
    pub fn hottest(&self) -> (usize, String) {
        let Ok(log) = self.log.lock() else {
            return (0, String::new());
        };
        let mut by_prefix: BTreeMap<&str, Vec<Instant>> = BTreeMap::new();
        for (at, prefix) in log.iter() {
            by_prefix.entry(prefix).or_default().push(*at);
        }
        let mut best = (0, String::new());
        for (prefix, mut times) in by_prefix {
            times.sort_unstable();
            let mut start = 0;
            for end in 0..times.len() {
                while times[end] - times[start] >= Duration::from_secs(1) {
                    start += 1;
                }
                if end + 1 - start > best.0 {
                    best = (end + 1 - start, prefix.to_owned());
                }
            }
        }
        best
    }

    /// Whether `prefix` may answer one more request of its kind now.
    fn admit(&self, prefix: &str, write: bool) -> bool {
        let now = Instant::now();
        if let Ok(mut log) = self.log.lock() {
            log.push((now, prefix.to_owned()));
        }
        let Ok(mut windows) = self.windows.lock() else {
            return true;
        };
        let w = windows.entry(prefix.to_owned()).or_default();
        if w.start.is_none_or(|s| now - s >= Duration::from_secs(1)) {
            *w = Window {
                start: Some(now),
                ..Window::default()
            };
        }
        let (count, rate) = if write {
            (&mut w.writes, self.limits.writes_per_s)
        } else {
            (&mut w.reads, self.limits.reads_per_s)
        };
        *count += 1;
        *count <= rate
    }

    /// The answer to `req` (whose body is `body`), after the simulated
    /// wait.
    async fn answer(&self, req: &http::request::Parts, body: Bytes) -> HttpResponse {
        let path = decode(req.uri.path());
        if std::env::var_os("SIM_TRACE").is_some() {
            eprintln!(
                "sim: {} {} {:?}",
                req.method,
                req.uri,
                req.headers.get("range")
            );
        }
        if path.starts_with("/latest/") {
            return metadata(&path);
        }
        let query = query_of(req.uri.query().unwrap_or(""));
        let key = path
            .trim_start_matches('/')
            .strip_prefix(&self.bucket)
            .unwrap_or("")
            .trim_start_matches('/')
            .to_owned();
        let listing = req.method == Method::GET && query.contains_key("list-type");
        let deleting = req.method == Method::POST && query.contains_key("delete");
        let deleted: Vec<String> = if deleting { keys_in(&body) } else { Vec::new() };
        let prefix = match (listing, deleted.first()) {
            (true, _) => query.get("prefix").map_or("", |p| p.trim_end_matches('/')),
            (false, Some(first)) => first.rsplit_once('/').map_or("", |(p, _)| p),
            (false, None) => key.rsplit_once('/').map_or("", |(p, _)| p),
        };
        let write = matches!(req.method, Method::PUT | Method::DELETE | Method::POST);
        let admitted = self.admit(prefix, write);
        let mut wait = self.limits.latency;
        wait += self.limits.per_byte * u32::try_from(body.len()).unwrap_or(u32::MAX);
        if !admitted {
            tokio::time::sleep(wait).await;
            self.slowdowns.fetch_add(1, Ordering::SeqCst);
            return error(StatusCode::SERVICE_UNAVAILABLE, "SlowDown");
        }
        let answer = match (&req.method, listing) {
            (&Method::GET, true) => self.list(&query),
            (&Method::PUT, _) if req.headers.contains_key("x-amz-copy-source") => {
                error(StatusCode::NOT_IMPLEMENTED, "NotImplemented")
            }
            (&Method::PUT, _) => self.put(key, body),
            (&Method::GET, _) => self.get(&key, req.headers.get(http::header::RANGE), true),
            (&Method::HEAD, _) => self.get(&key, None, false),
            (&Method::POST, _) if deleting => self.delete(&deleted),
            (&Method::DELETE, _) => {
                if let Ok(mut objects) = self.objects.lock() {
                    objects.remove(&key);
                }
                empty(StatusCode::NO_CONTENT)
            }
            _ => error(StatusCode::NOT_IMPLEMENTED, "NotImplemented"),
        };
        let sent = answer.headers().get(http::header::CONTENT_LENGTH);
        let sent: u32 = sent
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(0);
        if req.method == Method::GET {
            wait += self.limits.per_byte * sent;
        }
        tokio::time::sleep(wait).await;
        answer
    }

    /// `DeleteObjects`: each key deleted, each reported deleted.
    fn delete(&self, keys: &[String]) -> HttpResponse {
        let mut xml = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?><DeleteResult>");
        if let Ok(mut objects) = self.objects.lock() {
            for key in keys {
                objects.remove(key);
                let _ = write!(xml, "<Deleted><Key>{}</Key></Deleted>", escape(key));
            }
        }
        xml.push_str("</DeleteResult>");
        response(StatusCode::OK)
            .body(HttpResponseBody::from(xml))
            .unwrap_or_else(|_| broken())
    }

    fn put(&self, key: String, body: Bytes) -> HttpResponse {
        let etag = etag(&body);
        let modified = SystemTime::now();
        if let Ok(mut objects) = self.objects.lock() {
            objects.insert(key, Object { body, modified });
        }
        response(StatusCode::OK)
            .header(http::header::ETAG, etag)
            .body(HttpResponseBody::from(Bytes::new()))
            .unwrap_or_else(|_| broken())
    }

    fn get(&self, key: &str, range: Option<&http::HeaderValue>, body: bool) -> HttpResponse {
        let Some((bytes, modified)) = self
            .objects
            .lock()
            .ok()
            .and_then(|o| o.get(key).map(|o| (o.body.clone(), o.modified)))
        else {
            return error(StatusCode::NOT_FOUND, "NoSuchKey");
        };
        let len = bytes.len();
        let wanted = range.and_then(|r| range_of(r.to_str().ok()?, len));
        if range.is_some() && wanted.is_none() {
            return error(StatusCode::RANGE_NOT_SATISFIABLE, "InvalidRange");
        }
        let (status, (a, b)) = match wanted {
            Some(r) => (StatusCode::PARTIAL_CONTENT, r),
            None => (StatusCode::OK, (0, len)),
        };
        let mut answer = response(status)
            .header(http::header::ETAG, etag(&bytes))
            .header(http::header::LAST_MODIFIED, http_date(modified))
            .header(http::header::CONTENT_LENGTH, b - a);
        if wanted.is_some() {
            let range = format!("bytes {a}-{}/{len}", b.saturating_sub(1));
            answer = answer.header(http::header::CONTENT_RANGE, range);
        }
        let body = if body {
            bytes.slice(a..b)
        } else {
            Bytes::new()
        };
        if let Ok(mut read) = self.read.lock() {
            *read
                .entry(key.rsplit_once('/').map_or("", |p| p.0).to_owned())
                .or_default() += body.len();
        }
        answer
            .body(HttpResponseBody::from(body))
            .unwrap_or_else(|_| broken())
    }

    /// `ListObjectsV2`: up to 1,000 keys a page, in key order.
    fn list(&self, query: &HashMap<String, String>) -> HttpResponse {
        let prefix = query.get("prefix").cloned().unwrap_or_default();
        let after = match (query.get("continuation-token"), query.get("start-after")) {
            (Some(token), _) => token.clone(),
            (None, Some(after)) => after.clone(),
            (None, None) => String::new(),
        };
        let delimiter = query.get("delimiter").cloned();
        let max: usize = query
            .get("max-keys")
            .and_then(|m| m.parse().ok())
            .unwrap_or(1000)
            .min(1000);
        let Ok(objects) = self.objects.lock() else {
            return error(StatusCode::INTERNAL_SERVER_ERROR, "InternalError");
        };
        let mut xml = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult>");
        let (mut count, mut last, mut prefixes) = (0, None, Vec::<String>::new());
        let start = if after.as_str() >= prefix.as_str() {
            Bound::Excluded(after)
        } else {
            Bound::Included(prefix.clone())
        };
        let mut more = false;
        for (key, object) in objects.range::<String, _>((start, Bound::Unbounded)) {
            if !key.starts_with(&prefix) {
                break;
            }
            let rest = &key[prefix.len()..];
            let common = delimiter
                .as_deref()
                .filter(|d| rest.contains(*d))
                .map(|d| format!("{prefix}{}{d}", rest.split(d).next().unwrap_or("")));
            if count == max && common.as_ref().is_none_or(|c| prefixes.last() != Some(c)) {
                more = true;
                break;
            }
            last = Some(key.clone());
            if let Some(common) = common {
                if prefixes.last() != Some(&common) {
                    prefixes.push(common);
                    count += 1;
                }
                continue;
            }
            let _ = write!(
                xml,
                "<Contents><Key>{}</Key><LastModified>{}</LastModified><ETag>{}</ETag>\
                 <Size>{}</Size></Contents>",
                escape(key),
                iso_date(object.modified),
                escape(&etag(&object.body)),
                object.body.len()
            );
            count += 1;
        }
        for p in prefixes {
            let _ = write!(
                xml,
                "<CommonPrefixes><Prefix>{}</Prefix></CommonPrefixes>",
                escape(&p)
            );
        }
        if let (true, Some(last)) = (more, last) {
            let _ = write!(
                xml,
                "<NextContinuationToken>{}</NextContinuationToken>",
                escape(&last)
            );
        }
        xml.push_str("</ListBucketResult>");
        response(StatusCode::OK)
            .body(HttpResponseBody::from(xml))
            .unwrap_or_else(|_| broken())
    }
}

impl HttpConnector for Client {
    fn connect(&self, _: &object_store::ClientOptions) -> object_store::Result<HttpClient> {
        Ok(HttpClient::new(self.clone()))
    }
}

#[async_trait::async_trait]
impl HttpService for Client {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        // The instance metadata endpoint's requests are no bucket's.
        if !req.uri().path().starts_with("/latest/") {
            self.requests.fetch_add(1, Ordering::SeqCst);
        }
        let (parts, body) = req.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok(self.sim.answer(&parts, body).await)
    }
}

/// The instance metadata endpoint's answers: a token, a role, and
/// credentials for it (the simulated bucket checks no signature).
fn metadata(path: &str) -> HttpResponse {
    let text = match path {
        "/latest/api/token" => "token".to_owned(),
        p if p.ends_with("/security-credentials/") => "sim".to_owned(),
        _ => r#"{"AccessKeyId":"sim","SecretAccessKey":"sim","Token":"sim","Expiration":"2100-01-01T00:00:00Z"}"#.to_owned(),
    };
    response(StatusCode::OK)
        .body(HttpResponseBody::from(text))
        .unwrap_or_else(|_| broken())
}

/// The answer when one could not be built.
fn broken() -> HttpResponse {
    let mut answer = http::Response::new(HttpResponseBody::from(Bytes::new()));
    *answer.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    answer
}

fn response(status: StatusCode) -> http::response::Builder {
    http::Response::builder().status(status)
}

fn empty(status: StatusCode) -> HttpResponse {
    response(status)
        .body(HttpResponseBody::from(Bytes::new()))
        .unwrap_or_else(|_| broken())
}

/// An S3 error document with `code`.
fn error(status: StatusCode, code: &str) -> HttpResponse {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>\
         <Message>simulated</Message></Error>"
    );
    response(status)
        .body(HttpResponseBody::from(body))
        .unwrap_or_else(|_| broken())
}

fn etag(body: &[u8]) -> String {
    format!("\"{}\"", &blake3::hash(body).to_hex()[..32])
}

/// The keys a `DeleteObjects` body names.
fn keys_in(body: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(body);
    text.split("<Key>")
        .skip(1)
        .filter_map(|rest| rest.split_once("</Key>").map(|(key, _)| unescape(key)))
        .collect()
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

/// `bytes=a-b`, `bytes=a-` or `bytes=-n` of an object of `len` bytes, as
/// a half-open range.
fn range_of(header: &str, len: usize) -> Option<(usize, usize)> {
    let (a, b) = header.strip_prefix("bytes=")?.split_once('-')?;
    let (a, b) = match (a.parse::<usize>().ok(), b.parse::<usize>().ok()) {
        (Some(a), Some(b)) => (a, (b + 1).min(len)),
        (Some(a), None) => (a, len),
        (None, Some(n)) => (len.saturating_sub(n), len),
        (None, None) => return None,
    };
    (a < b).then_some((a, b))
}

fn query_of(query: &str) -> HashMap<String, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// `%XX` escapes decoded.
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A moment as S3 writes it.
struct Civil {
    year: i64,
    month: u32,
    day: u32,
    /// 0 for Monday.
    weekday: usize,
    hour: i64,
    minute: i64,
    second: i64,
    millis: u32,
}

impl Civil {
    /// `when`, by Howard Hinnant's `civil_from_days`.
    fn of(when: SystemTime) -> Civil {
        let since = when.duration_since(UNIX_EPOCH).unwrap_or_default();
        let secs = i64::try_from(since.as_secs()).unwrap_or(0);
        let (days, into_day) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = u32::try_from(doy - (153 * mp + 2) / 5 + 1).unwrap_or(1);
        let month = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).unwrap_or(1);
        Civil {
            year: yoe + era * 400 + i64::from(month <= 2),
            month,
            day,
            // 1970-01-01 was a Thursday.
            weekday: usize::try_from((days + 3).rem_euclid(7)).unwrap_or(0),
            hour: into_day / 3600,
            minute: into_day / 60 % 60,
            second: into_day % 60,
            millis: since.subsec_millis(),
        }
    }
}

/// `2026-12-07T23:00:00.123Z`.
fn iso_date(when: SystemTime) -> String {
    let c = Civil::of(when);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        c.year, c.month, c.day, c.hour, c.minute, c.second, c.millis
    )
}

/// `Mon, 07 Dec 2026 23:00:00 GMT`.
fn http_date(when: SystemTime) -> String {
    const DAYS: [&str; 7] = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let c = Civil::of(when);
    let month = MONTHS[(c.month - 1) as usize];
    format!(
        "{}, {:02} {month} {} {:02}:{:02}:{:02} GMT",
        DAYS[c.weekday], c.day, c.year, c.hour, c.minute, c.second
    )
}
