//! A body changed on its way to the bucket: bodies go unsigned (as
//! s3torchconnector sends them), so what refuses a changed one is the
//! CRC-64/NVME the client sends with each upload and the server checks
//! (`remote::s3`). Through a proxy in front of the real Garage that flips
//! one byte in the middle of the first large upload: by default the push
//! fails and lists nothing; with bodies unsigned and unchecked
//! (`AWS_UNSIGNED_PAYLOAD=true`, which turns the default off) the same
//! flip is stored, acknowledged, and caught only when the step is read.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::garage::{fresh_prefix, SERVER};
use super::{store_with, Result};

/// A request body at least this long is one the proxy may change.
const LARGE: usize = 64 << 10;

/// Forwards connections on a local port to `upstream`, flipping one byte
/// in the middle of the first PUT body of at least [`LARGE`] bytes (once,
/// over all connections; `flipped` says whether it has).
fn proxy(upstream: String, flipped: Arc<AtomicBool>) -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = TcpStream::connect(&upstream) else {
                continue;
            };
            let (Ok(mut back_from), Ok(mut back_to)) = (server.try_clone(), client.try_clone())
            else {
                continue;
            };
            std::thread::spawn(move || std::io::copy(&mut back_from, &mut back_to));
            let flipped = Arc::clone(&flipped);
            std::thread::spawn(move || forward_requests(client, server, &flipped));
        }
    });
    Ok(port)
}

/// Copies HTTP/1.1 requests from `from` to `to`, request by request (a
/// head, then a body of its Content-Length), flipping the middle byte of
/// the first large PUT body.
fn forward_requests(mut from: TcpStream, mut to: TcpStream, flipped: &AtomicBool) -> Option<()> {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 1 << 16];
    loop {
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = from.read(&mut chunk).ok().filter(|&n| n > 0)?;
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < end + length {
            let n = from.read(&mut chunk).ok().filter(|&n| n > 0)?;
            buf.extend_from_slice(&chunk[..n]);
        }
        if head.starts_with("put ") && length >= LARGE && !flipped.swap(true, Ordering::SeqCst) {
            buf[end + length / 2] ^= 0xff;
        }
        to.write_all(&buf[..end + length]).ok()?;
        buf.drain(..end + length);
    }
}

/// `ckpt ARGS` against endpoint `endpoint`, with `extra` in its
/// environment.
fn ckpt(endpoint: &str, extra: &[(&str, &str)], args: &[&str]) -> Result<Output> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ckpt"));
    cmd.args(args)
        .args(["--retry-window", "5"])
        .env("AWS_ENDPOINT_URL", endpoint)
        .env_remove("AWS_UNSIGNED_PAYLOAD")
        .env_remove("AWS_CHECKSUM_ALGORITHM");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    Ok(cmd.output()?)
}

#[test]
fn a_body_changed_on_its_way_to_the_bucket_fails_the_push_and_lists_nothing() -> Result {
    let (Ok(bucket), Ok(endpoint)) = (
        std::env::var("CKPT_TEST_BUCKET"),
        std::env::var("AWS_ENDPOINT_URL"),
    ) else {
        eprintln!("a_body_changed_on_its_way: skipped: no S3 server (scripts/garage.sh start)");
        return Ok(());
    };
    let _server = SERVER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let upstream = endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 0..1)?;
    let path = dir.path().join("run.ckpt");
    let path = path.to_str().ok_or("a path that is not UTF-8")?;
    drop(store);
    for unchecked in [false, true] {
        let flipped = Arc::new(AtomicBool::new(false));
        let via = format!(
            "http://127.0.0.1:{}",
            proxy(upstream.clone(), Arc::clone(&flipped))?
        );
        let url = format!("s3://{bucket}/{}", fresh_prefix());
        let extra: &[(&str, &str)] = if unchecked {
            &[("AWS_UNSIGNED_PAYLOAD", "true")]
        } else {
            &[]
        };
        let push = ckpt(&via, extra, &["push", path, &url])?;
        assert!(flipped.load(Ordering::SeqCst), "the proxy changed no body");
        let ls = ckpt(&endpoint, &[], &["ls", "--json", &url])?;
        let listed = String::from_utf8_lossy(&ls.stdout).into_owned();
        let err = String::from_utf8_lossy(&push.stderr).into_owned();
        if unchecked {
            // Stored as changed and acknowledged: only a read finds out.
            assert!(push.status.success(), "{err}");
            let verify = ckpt(&endpoint, &[], &["verify", &url])?;
            assert!(!verify.status.success(), "a changed chunk verified");
            continue;
        }
        assert_eq!(push.status.code(), Some(1), "{err}");
        assert!(
            err.lines().count() == 1 && !err.contains("panicked"),
            "{err}"
        );
        assert!(ls.status.success() && listed.trim() == "[]", "{listed}");
        // The same push, its bytes unchanged on the way, lands and verifies.
        let again = ckpt(&endpoint, &[], &["push", path, &url])?;
        assert!(
            again.status.success(),
            "{}",
            String::from_utf8_lossy(&again.stderr)
        );
        let verify = ckpt(&endpoint, &[], &["verify", &url])?;
        assert!(
            verify.status.success(),
            "{}",
            String::from_utf8_lossy(&verify.stdout)
        );
    }
    Ok(())
}
