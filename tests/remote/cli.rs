//! `ckpt push`, `ckpt pull`, and `ls`, `show`, `verify`, `gc` on a URL.

use ckptstore::CheckpointStore;

use super::{store_with, Result};

pub(crate) use crate::common::ckpt;

#[test]
fn push_ls_show_verify_gc_and_pull_from_the_shell() -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 0..4)?;
    drop(store);
    let path = dir.path().join("run.ckpt");
    let p = path.to_str().ok_or("path")?;
    let url = format!("file://{}/bucket", dir.path().display());

    let (code, out, err) = ckpt(&["push", p, &url])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("pushed 4 steps"), "{out}");
    let (code, out, _) = ckpt(&["push", p, &url])?;
    assert_eq!(code, 0);
    assert!(
        out.contains("pushed 0 steps") && out.contains("(4 were there)"),
        "{out}"
    );
    // Packs deleted by hand: `--repair` lists the bucket and uploads them.
    let packs = dir.path().join("bucket/packs");
    for entry in std::fs::read_dir(&packs)? {
        std::fs::remove_file(entry?.path())?;
    }
    let (code, out, err) = ckpt(&["push", "--repair", p, &url])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("pushed 4 steps"), "{out}");

    let (code, out, err) = ckpt(&["ls", &url, "--json"])?;
    assert_eq!(code, 0, "{err}");
    let listed: serde_json::Value = serde_json::from_str(&out)?;
    let steps: Vec<u64> = listed
        .as_array()
        .ok_or("array")?
        .iter()
        .filter_map(|s| s["step"].as_u64())
        .collect();
    assert_eq!(steps, vec![0, 1, 2, 3]);
    let (code, out, _) = ckpt(&["show", &url, "latest"])?;
    assert_eq!(code, 0);
    assert!(out.contains('3') && out.contains("frozen"), "{out}");
    let (code, out, _) = ckpt(&["verify", &url])?;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("4 steps ok"), "{out}");

    let (code, out, _) = ckpt(&["gc", &url, "--keep-last", "2", "--dry-run"])?;
    assert_eq!(code, 0);
    assert!(out.contains("would remove 2 steps: [0, 1]"), "{out}");
    let (code, out, err) = ckpt(&["gc", &url, "--keep-last", "2"])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("removed 2 steps: [0, 1]"), "{out}");

    // Restore on another machine: a store that does not exist yet.
    let fresh = dir.path().join("fresh.ckpt");
    let f = fresh.to_str().ok_or("path")?;
    let (code, out, err) = ckpt(&["pull", &url, f])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("pulled step 3"), "{out}");
    let (code, _, err) = ckpt(&["pull", &url, f, "--step", "2"])?;
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = ckpt(&["pull", &url, f, "--step", "3"])?;
    assert_eq!(code, 1);
    assert!(err.contains("already in"), "{err}");
    let (code, _, err) = ckpt(&["pull", &url, f, "--step", "0"])?;
    assert_eq!(code, 1);
    assert!(err.contains('0'), "{err}");
    let original = CheckpointStore::open_read_only(&path)?;
    let copy = CheckpointStore::open_read_only(&fresh)?;
    assert_eq!(copy.steps()?, vec![2, 3]);
    assert!(copy.get(3)? == original.get(3)?);

    // Damage: exit 3, naming the step.
    let bucket = dir.path().join("bucket/manifests");
    for entry in std::fs::read_dir(&bucket)? {
        let entry = entry?;
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(&format!("{:020}", 2))
        {
            std::fs::write(entry.path(), b"{}")?;
        }
    }
    let (code, out, _) = ckpt(&["verify", &url])?;
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("DAMAGED step 2"), "{out}");
    Ok(())
}

#[test]
fn bad_urls_and_unreachable_servers_are_one_line_errors() -> Result {
    let (code, _, err) = ckpt(&["ls", "ftp://host/x"])?;
    assert_eq!(code, 1);
    assert!(
        err.contains("ftp://host/x") && err.lines().count() == 1,
        "{err}"
    );
    // Nothing listens on port 9: refused at once, retried for the window
    // (2 s here, 30 by default), then one line.
    let started = std::time::Instant::now();
    let out = ls_through("http://127.0.0.1:9")?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("s3://nobucket/x") && err.lines().count() == 1,
        "{err}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    Ok(())
}

/// `ckpt ls s3://nobucket/x` against the S3 endpoint `endpoint` (plain
/// HTTP allowed), its requests retried for 2 s.
fn ls_through(endpoint: &str) -> std::io::Result<std::process::Output> {
    std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["ls", "s3://nobucket/x", "--retry-window", "2"])
        .env("AWS_ENDPOINT_URL", endpoint)
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "y")
        .env("AWS_REGION", "garage")
        .output()
}

/// An `https://` endpoint is spoken to over TLS (the client's crypto
/// provider is there: a build without one panics at its first request):
/// the server sees a TLS handshake begin, and a server that then hangs
/// up is a one-line error.
#[test]
fn an_https_endpoint_gets_a_tls_handshake() -> Result {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let server = std::thread::spawn(move || -> std::io::Result<Vec<u8>> {
        let (mut conn, _) = listener.accept()?;
        let mut first = vec![0u8; 3];
        conn.read_exact(&mut first)?;
        Ok(first)
    });
    let out = ls_through(&format!("https://127.0.0.1:{port}"))?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.lines().count() == 1 && !err.contains("panicked"),
        "{err}"
    );
    let first = server.join().map_err(|_| "the server thread panicked")??;
    // A TLS record of type handshake (22), version 3.x.
    assert_eq!(&first[..2], &[0x16, 0x03], "{first:?}");
    Ok(())
}

/// A mistyped `file://` URL is an error for the commands that read, and
/// creates nothing; a pull that fails leaves no new store behind; a step
/// missing from a bucket is said to be missing from that bucket.
#[test]
fn reading_commands_refuse_a_missing_bucket_and_leave_nothing() -> Result {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("no/such/bucket");
    let url = format!("file://{}", missing.display());
    for args in [
        vec!["ls", &url],
        vec!["show", &url, "3"],
        vec!["verify", &url],
        vec!["gc", &url, "--keep-last", "1"],
    ] {
        let (code, out, err) = ckpt(&args)?;
        assert_eq!(code, 1, "{args:?}: {out}{err}");
        assert!(err.contains(&format!("no bucket at {url}")), "{err}");
    }
    assert!(!dir.path().join("no").exists(), "nothing is created");

    let store = store_with(dir.path(), 0..2)?;
    drop(store);
    let p = dir.path().join("run.ckpt");
    let bucket = format!("file://{}/bucket", dir.path().display());
    assert_eq!(ckpt(&["push", &p.to_string_lossy(), &bucket])?.0, 0);
    let target = dir.path().join("pulled.ckpt");
    let t = target.to_string_lossy();
    let (code, _, err) = ckpt(&["pull", &bucket, &t, "--step", "99"])?;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("step 99 is not in {bucket}")),
        "{err}"
    );
    assert!(!target.exists(), "a failed pull leaves no store");
    let (code, _, err) = ckpt(&["show", &bucket, "99"])?;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("step 99 is not in {bucket}")),
        "{err}"
    );
    assert_eq!(ckpt(&["pull", &bucket, &t, "--step", "1"])?.0, 0);
    assert_eq!(CheckpointStore::open(&target)?.steps()?, vec![1]);
    Ok(())
}

/// Issue 38, item 11: an object is named by its URL, with the directory's
/// leading `/` (object paths have none), in warnings and in errors.
#[test]
fn objects_are_named_by_their_url() -> Result {
    let dir = tempfile::tempdir()?;
    drop(store_with(dir.path(), 0..1)?);
    let path = dir.path().join("run.ckpt");
    let p = path.to_str().ok_or("path")?;
    let bucket = dir.path().join("bucket");
    let url = format!("file://{}", bucket.display());
    let (code, _, err) = ckpt(&["push", p, &url])?;
    assert_eq!(code, 0, "{err}");

    // A pack's name taken by a directory: the upload fails.
    let other = dir.path().join("other");
    for entry in std::fs::read_dir(bucket.join("packs"))? {
        let name = entry?.file_name();
        std::fs::create_dir_all(other.join("packs").join(&name).join("x"))?;
    }
    let other_url = format!("file://{}", other.display());
    let (code, _, err) = ckpt(&["push", p, &other_url])?;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("uploading {other_url}/packs/")),
        "{err}"
    );

    // A manifest gone: the step is skipped, naming the object.
    let manifests = bucket.join("manifests");
    let manifest = std::fs::read_dir(&manifests)?
        .next()
        .ok_or("a manifest")??;
    std::fs::remove_file(manifest.path())?;
    let (code, _, err) = ckpt(&["ls", &url])?;
    assert_eq!(code, 0, "{err}");
    let name = manifest.file_name();
    let named = format!("{url}/manifests/{}", name.to_string_lossy());
    assert!(err.contains(&format!("{named} is missing")), "{err}");
    Ok(())
}
