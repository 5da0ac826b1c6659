//! Against the real Garage server `scripts/garage.sh start` runs (its
//! variables in target/garage/env, which `.ci/run` sources); each test
//! prints why it is skipped when they are not set. Tests that use the
//! server hold `SERVER`, so that the one that kills it runs alone.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ckptstore::{CheckpointStore, GradientCheckpoint, Remote};

use super::{bytes, checkpoint, round_trip, Result};

pub(crate) static SERVER: Mutex<()> = Mutex::new(());

/// The test bucket and the server to ourselves, or `None` (skipped).
pub(crate) fn server(test: &str) -> Option<(MutexGuard<'static, ()>, String)> {
    let Ok(bucket) = std::env::var("CKPT_TEST_BUCKET") else {
        eprintln!(
            "{test}: skipped: no S3 server (run scripts/garage.sh start and source \
             target/garage/env; .ci/run does)"
        );
        return None;
    };
    let guard = SERVER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    Some((guard, bucket))
}

/// A prefix no other test or run uses.
pub(crate) fn fresh_prefix() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("t-{t:x}-{}", std::process::id())
}

fn fresh(bucket: &str) -> String {
    format!("s3://{bucket}/{}", fresh_prefix())
}

/// A step with 4 MiB of its own (so that a push takes a while) and the
/// shared 4 MiB tensor.
fn big(step: u64) -> Result<GradientCheckpoint> {
    let mut c = checkpoint(step)?;
    c.set_optimizer_state("own", bytes(step + 1000, 4 << 20));
    Ok(c)
}

fn big_store(dir: &std::path::Path, steps: std::ops::Range<u64>) -> Result<CheckpointStore> {
    super::store_of(dir, steps, big)
}

/// Every step the bucket lists restores equal to the store's.
fn whole_steps(remote: &Remote, store: &CheckpointStore) -> Result<Vec<u64>> {
    let steps = remote.steps()?;
    for &step in &steps {
        let got = remote.get(step)?.ok_or("a listed step is gone")?;
        assert!(Some(got) == store.get(step)?, "step {step} differs");
    }
    Ok(steps)
}

#[test]
fn garage_round_trip() -> Result {
    let Some((_server, bucket)) = server("garage_round_trip") else {
        return Ok(());
    };
    round_trip(&Remote::open(&fresh(&bucket))?)
}

/// kill -9 of `ckpt push` at random moments, again and again: after each,
/// the bucket lists only whole steps; a last push completes the job.
#[test]
fn a_killed_push_leaves_whole_steps_and_the_rerun_completes() -> Result {
    let Some((_server, bucket)) = server("a_killed_push_leaves_whole_steps") else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let store = big_store(dir.path(), 0..2)?;
    let path = dir.path().join("run.ckpt");
    let push = |url: &str| -> Result<std::process::Child> {
        Ok(Command::new(env!("CARGO_BIN_EXE_ckpt"))
            .args(["push", path.to_str().ok_or("path")?, url])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?)
    };
    // How long a push takes here, first guessed from a push into a prefix
    // of its own, then set from each push that ended before its kill.
    let started = Instant::now();
    let status = push(&fresh(&bucket))?.wait()?;
    assert!(status.success());
    let mut whole = started.elapsed();

    // Each round commits two new steps, then kills a push part way; rounds
    // go on (up to three times as many) until half the wanted number were
    // cut short, so that a loaded machine cannot make the kills all late.
    let url = fresh(&bucket);
    let remote = Remote::open(&url)?;
    let rounds = if std::env::var_os("CKPT_LONG").is_some() {
        40
    } else {
        8
    };
    let mut rng = super::Rng(0x5EED);
    let (mut killed, mut round) = (0, 0);
    let mut next = 2;
    while round < rounds || (killed < rounds / 2 && round < 3 * rounds) {
        round += 1;
        for step in next..next + 2 {
            store.commit(&big(step)?)?;
        }
        next += 2;
        let started = Instant::now();
        let mut child = push(&url)?;
        let at = whole.mul_f64((rng.next() % 1000) as f64 / 1000.0);
        match ended_within(&mut child, at)? {
            None => {
                child.kill()?; // SIGKILL
                killed += 1;
            }
            Some(status) => {
                assert!(status.success(), "a push that was not killed failed");
                whole = started.elapsed();
            }
        }
        child.wait()?;
        whole_steps(&remote, &store)?;
    }
    assert!(
        killed >= rounds / 2,
        "only {killed} of {round} pushes were cut short"
    );
    let last = remote.push(&store)?;
    assert_eq!(last.steps_present + last.steps_pushed.len() as u64, next);
    assert_eq!(whole_steps(&remote, &store)?, (0..next).collect::<Vec<_>>());
    eprintln!("{killed} of {round} pushes killed (a whole push took {whole:?})");
    Ok(())
}

/// The child's exit status if it ends within `limit`, else `None`.
fn ended_within(
    child: &mut std::process::Child,
    limit: Duration,
) -> Result<Option<std::process::ExitStatus>> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        let left = limit.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Ok(None);
        }
        std::thread::sleep(left.min(Duration::from_millis(5)));
    }
}

/// The server killed (kill -9) part way through a push and started again
/// a second later: the push recovers within its retries or fails with an
/// error naming the URL; either way a rerun completes.
#[test]
fn a_server_killed_mid_push_and_restarted() -> Result {
    let Some((_server, bucket)) = server("a_server_killed_mid_push") else {
        return Ok(());
    };
    let Some(garage) = Server::from_env() else {
        eprintln!("a_server_killed_mid_push: skipped: CKPT_GARAGE* not set");
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let store = big_store(dir.path(), 0..6)?;
    let url = fresh(&bucket);
    let remote = Remote::open(&url)?;
    let mut restart = None;
    let outcome = remote.push_with(&store, &mut |_, uploaded| {
        if restart.is_none() && uploaded >= 8 << 20 {
            garage.kill();
            let garage = Server::from_env().expect("variables");
            restart = Some(std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(1));
                garage.start();
            }));
        }
        true
    });
    restart
        .ok_or("the push ended before the server was killed")?
        .join()
        .map_err(|_| "restart")?;
    match &outcome {
        Ok(report) => eprintln!("the push recovered: {report:?}"),
        Err(e) => {
            assert!(e.to_string().contains(&url), "{e}");
            eprintln!("the push failed clearly: {e}");
        }
    }
    // The server is back once it answers.
    Server::wait_for(&remote);
    whole_steps(&remote, &store)?;
    remote.push(&store)?;
    assert_eq!(whole_steps(&remote, &store)?, (0..6).collect::<Vec<_>>());
    Ok(())
}

/// Another process's view while a push runs: every listing holds only
/// whole steps, each restoring equal to what was committed.
#[test]
fn a_reader_during_a_push_sees_only_whole_steps() -> Result {
    let Some((_server, bucket)) = server("a_reader_during_a_push") else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let store = big_store(dir.path(), 0..6)?;
    let url = fresh(&bucket);
    let done = Arc::new(AtomicBool::new(false));
    let partial = Arc::new(AtomicUsize::new(0));
    let reader = {
        let (url, done, partial) = (url.clone(), done.clone(), partial.clone());
        std::thread::spawn(move || -> std::result::Result<usize, String> {
            let remote = Remote::open(&url).map_err(|e| e.to_string())?;
            let mut looks = 0;
            while !done.load(Ordering::SeqCst) {
                let steps = remote.steps().map_err(|e| e.to_string())?;
                if !steps.is_empty() && steps.len() < 6 {
                    partial.fetch_add(1, Ordering::SeqCst);
                }
                if let Some(&latest) = steps.last() {
                    let got = remote.get(latest).map_err(|e| e.to_string())?;
                    let want = big(latest).map_err(|e| e.to_string())?;
                    if got.as_ref().map(|c| (&c.optimizer_state, &c.tensors))
                        != Some((&want.optimizer_state, &want.tensors))
                    {
                        return Err(format!("step {latest} restored wrong"));
                    }
                }
                looks += 1;
            }
            Ok(looks)
        })
    };
    let pushed = Remote::open(&url)?.push(&store);
    done.store(true, Ordering::SeqCst);
    let looks = reader.join().map_err(|_| "reader panicked")??;
    assert_eq!(pushed?.steps_pushed.len(), 6);
    assert!(looks > 0);
    eprintln!(
        "{looks} looks, {} of them while the push was part way",
        partial.load(Ordering::SeqCst)
    );
    Ok(())
}

/// The AWS CLI, a real S3 client, lists the bucket and downloads a
/// manifest and a pack by their plain names; a chunk is where the index
/// says.
#[test]
fn the_aws_cli_reads_the_layout() -> Result {
    let Some((_server, bucket)) = server("the_aws_cli_reads_the_layout") else {
        return Ok(());
    };
    let endpoint = std::env::var("AWS_ENDPOINT_URL")?;
    let aws = |args: &[&str]| -> Result<Vec<u8>> {
        let out = Command::new("aws")
            .args(args)
            .args(["--endpoint-url", &endpoint])
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "aws {args:?}: {err}");
        Ok(out.stdout)
    };
    if Command::new("aws").arg("--version").output().is_err() {
        eprintln!("the_aws_cli_reads_the_layout: skipped: no `aws` on PATH");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let store = super::store_with(dir.path(), 0..2)?;
    let url = fresh(&bucket);
    Remote::open(&url)?.push(&store)?;
    let prefix = url.trim_start_matches("s3://");

    let listing = String::from_utf8(aws(&["s3", "ls", &format!("s3://{prefix}/commits/")])?)?;
    let commits: Vec<&str> = listing
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .collect();
    assert_eq!(commits.len(), 2, "{listing}");
    assert!(commits[1].starts_with(&format!("{:020}-", 1)), "{listing}");
    let hash = commits[1].rsplit('-').next().ok_or("name")?;
    let manifest = aws(&[
        "s3",
        "cp",
        &format!("s3://{prefix}/manifests/{:020}-{hash}.json", 1),
        "-",
    ])?;
    assert_eq!(blake3::hash(&manifest).to_hex().as_str(), hash);
    let m: serde_json::Value = serde_json::from_slice(&manifest)?;
    assert_eq!(m["step"], 1);
    let chunk = m["blobs"]["frozen"]["chunks"][0].as_str().ok_or("chunk")?;
    let at = &m["index"][chunk];
    let (pack, offset) = (at[0].as_u64().ok_or("pack")?, at[1].as_u64().ok_or("at")?);
    let pack = m["packs"][usize::try_from(pack)?]["hash"]
        .as_str()
        .ok_or("pack")?;
    let bytes = aws(&["s3", "cp", &format!("s3://{prefix}/packs/{pack}"), "-"])?;
    // The tensor's first chunk: 1 MiB - 128 B (docs/design.md).
    let offset = usize::try_from(offset)?;
    let chunk_bytes = bytes.get(offset..offset + (1 << 20) - 128).ok_or("short")?;
    assert_eq!(blake3::hash(chunk_bytes).to_hex().as_str(), chunk);
    Ok(())
}

/// The server process of `scripts/garage.sh start`: kill it (-9) and start
/// it again. `None` when the variables are not set.
struct Server {
    garage: String,
    config: String,
    pid_file: String,
}

impl Server {
    fn from_env() -> Option<Server> {
        Some(Server {
            garage: std::env::var("CKPT_GARAGE").ok()?,
            config: std::env::var("CKPT_GARAGE_CONFIG").ok()?,
            pid_file: std::env::var("CKPT_GARAGE_PID").ok()?,
        })
    }

    fn kill(&self) {
        let pid = std::fs::read_to_string(&self.pid_file).expect("pid file");
        let killed = Command::new("kill").args(["-9", pid.trim()]).status();
        assert!(killed.is_ok_and(|s| s.success()), "kill -9 garage");
    }

    fn start(&self) {
        // Its log goes on where `garage.sh start` began it: every request
        // the server answers stays countable there.
        let log = std::fs::File::options()
            .append(true)
            .create(true)
            .open(std::path::Path::new(&self.config).with_file_name("server.log"))
            .expect("log");
        // The server outlives the test: `garage.sh stop` ends it.
        #[allow(clippy::zombie_processes)]
        let child = Command::new(&self.garage)
            .args(["-c", &self.config, "server"])
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("restart garage");
        std::fs::write(&self.pid_file, child.id().to_string()).expect("pid file");
    }

    /// Wait until `remote` answers again.
    fn wait_for(remote: &Remote) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while remote.steps().is_err() {
            assert!(Instant::now() < deadline, "garage did not come back");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// An outage of the server shorter than the retry window (30 s by
/// default), mid-push, is waited out: the push succeeds. A longer one
/// fails the push with one error naming the URL, at about the window.
#[test]
fn outages_within_the_retry_window_are_waited_out() -> Result {
    let Some((_server, bucket)) = server("outages_within_the_retry_window") else {
        return Ok(());
    };
    let Some(garage) = Server::from_env() else {
        eprintln!("outages_within_the_retry_window: skipped: CKPT_GARAGE* not set");
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let store = big_store(dir.path(), 0..4)?;
    for outage in [5, 9] {
        let url = fresh(&bucket);
        let remote = Remote::open(&url)?;
        let mut restart = None;
        let pushed = remote.push_with(&store, &mut |_, uploaded| {
            if restart.is_none() && uploaded >= 4 << 20 {
                garage.kill();
                let garage = Server::from_env().expect("variables");
                restart = Some(std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_secs(outage));
                    garage.start();
                }));
            }
            true
        });
        restart
            .ok_or("the push ended first")?
            .join()
            .map_err(|_| "restart")?;
        let report = pushed.map_err(|e| format!("a {outage} s outage: {e}"))?;
        assert_eq!(report.steps_pushed, vec![0, 1, 2, 3], "{outage} s");
        assert_eq!(whole_steps(&remote, &store)?, vec![0, 1, 2, 3]);
    }
    // Past the window: one clear error, in about the window.
    let url = fresh(&bucket);
    let remote = Remote::open(&url)?.with_retry_window(Duration::from_secs(3))?;
    garage.kill();
    let started = Instant::now();
    let failed = remote.push(&store).expect_err("the server is down");
    let took = started.elapsed();
    garage.start();
    assert!(failed.to_string().contains(&url), "{failed}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    eprintln!("with the server down, a 3 s window failed after {took:?}: {failed}");
    Server::wait_for(&remote);
    Ok(())
}

#[test]
fn a_push_to_a_missing_bucket_says_so() -> Result {
    let Some((_server, _bucket)) = server("a_push_to_a_missing_bucket") else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let store = super::store_with(dir.path(), 0..1)?;
    let url = format!("s3://no-such-bucket-{}/run", fresh_prefix());
    let e = Remote::open(&url)?
        .push(&store)
        .expect_err("no such bucket");
    assert!(
        e.to_string().starts_with(&format!("no bucket at {url}")),
        "{e}"
    );
    assert!(!Remote::open(&url)?.exists()?);
    Ok(())
}

/// A missing bucket is `Error::NoBucket` on every path, reads too (S3's
/// `NoSuchBucket` code, told by type: a listing's 404 and a GET's look
/// alike to `object_store`).
#[test]
fn reads_of_a_missing_bucket_say_so() -> Result {
    let Some((_server, _bucket)) = server("reads_of_a_missing_bucket") else {
        return Ok(());
    };
    let url = format!("s3://no-such-bucket-{}/run", fresh_prefix());
    let remote = Remote::open(&url)?;
    for (what, e) in [
        ("steps", remote.steps().map(drop)),
        ("latest_step", remote.latest_step().map(drop)),
        ("get", remote.get(1).map(drop)),
    ] {
        let e = e.expect_err(what);
        assert!(
            matches!(
                e,
                ckptstore::Error::Bucket(ckptstore::BucketError::NoBucket { .. })
            ),
            "{what}: {e:?}"
        );
        assert!(
            e.to_string().starts_with(&format!("no bucket at {url}")),
            "{e}"
        );
    }
    Ok(())
}

/// Without credentials in the environment the client asks the instance
/// metadata endpoint (here Garage's S3 port, which refuses the token
/// request): the error says that credentials are missing.
#[test]
fn missing_credentials_are_named() -> Result {
    let Some((_server, bucket)) = server("missing_credentials_are_named") else {
        return Ok(());
    };
    let endpoint = std::env::var("AWS_ENDPOINT_URL")?;
    let out = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["ls", &format!("s3://{bucket}/{}", fresh_prefix())])
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env("AWS_METADATA_ENDPOINT", &endpoint)
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("(no credentials: set AWS_ACCESS_KEY_ID"),
        "{err}"
    );
    Ok(())
}
