//! Readers see only complete steps while a writer commits: on other threads
//! of the writing process, and in another process that opened the store
//! read-only (the default store is shared).

use crate::common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ckptstore::CheckpointStore;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

const STORE_VAR: &str = "CKPT_READERS_STORE";
const STEPS: u64 = 40;

/// The writer process: runs only as a child of the cross-process test.
#[test]
#[ignore = "child-process entry point, run by the tests below"]
fn writer_child() -> Result {
    let path = std::env::var_os(STORE_VAR).ok_or("run only as a child of the tests below")?;
    let store = CheckpointStore::open(Path::new(&path))?;
    println!("READY");
    std::io::stdout().flush()?;
    for step in 0..STEPS {
        store.commit(&common::deterministic(step))?;
        std::thread::sleep(Duration::from_millis(15));
    }
    Ok(())
}

#[test]
fn threads_reading_during_commits_see_whole_steps() -> Result {
    let dir = tempfile::tempdir()?;
    let store = Arc::new(CheckpointStore::open(dir.path().join("run.ckpt"))?);
    let done = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (store, done) = (store.clone(), done.clone());
            std::thread::spawn(move || -> std::result::Result<usize, String> {
                let mut seen = std::collections::BTreeSet::new();
                while !done.load(Ordering::SeqCst) {
                    if let Some(c) = store.latest().map_err(|e| e.to_string())? {
                        if c != common::deterministic(c.step) {
                            return Err(format!("step {} read back partial", c.step));
                        }
                        seen.insert(c.step);
                    }
                    let steps = store.steps().map_err(|e| e.to_string())?;
                    if steps.iter().enumerate().any(|(i, &s)| s != i as u64) {
                        return Err(format!("listing has a hole: {steps:?}"));
                    }
                }
                Ok(seen.len())
            })
        })
        .collect();
    for step in 0..STEPS {
        store.commit(&common::deterministic(step))?;
    }
    done.store(true, Ordering::SeqCst);
    for r in readers {
        let seen = r.join().map_err(|_| "reader panicked")??;
        assert!(seen >= 1, "reader saw no step");
    }
    Ok(())
}

#[test]
fn another_process_reads_while_this_one_commits() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("shared.ckpt");
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "concurrent_readers::writer_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(STORE_VAR, &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    // Wait until the writer has created the store.
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    loop {
        let line = lines.next().ok_or("writer exited before it was ready")??;
        if line.contains("READY") {
            break;
        }
    }

    let reader = CheckpointStore::open_read_only(&path)?;
    let mut latest_seen = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait()?.is_none() {
        assert!(Instant::now() < deadline, "writer did not finish");
        if let Some(c) = reader.latest()? {
            assert!(
                c == common::deterministic(c.step),
                "step {} partial in reader",
                c.step
            );
            latest_seen.insert(c.step);
        }
    }
    let status = child.wait()?;
    assert!(status.success(), "writer failed: {status}");
    // The reader followed the writer's commits as they happened...
    assert!(
        latest_seen.len() >= 3,
        "reader saw too few distinct steps: {latest_seen:?}"
    );
    // ...and, with the writer gone, sees every step.
    assert_eq!(reader.steps()?, (0..STEPS).collect::<Vec<_>>());
    for s in 0..STEPS {
        assert!(reader.get(s)? == Some(common::deterministic(s)), "step {s}");
    }
    Ok(())
}

/// Step `step` with one blob of `len` bytes that differ from step to step
/// (above the pack threshold the tests set), at a fixed time.
fn large_step(step: u64, len: usize) -> ckptstore::GradientCheckpoint {
    use ckptstore::{ComputationGraphStore, GradientCheckpoint};
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    c.timestamp = 1_750_000_000 + step;
    c.set_optimizer_state("w", common::bytes(step, len));
    c
}

/// With pack files and a retention that keeps one step, every commit
/// deletes the previous step's pack file, often while a reader is reading
/// that step: each read returns the whole step (the store reads again in a
/// new transaction when a file goes under it), never damaged data, a
/// corrupt-data error or `Error::ReadInterrupted` (which needs three lost
/// races in a row; without the retry, a read here now and then loses one).
#[test]
fn reads_racing_with_pack_file_deletion_are_whole() -> Result {
    use ckptstore::{Error, Retention, StoreOptions};
    let big = |step: u64| large_step(step, 6 << 20);
    let dir = tempfile::tempdir()?;
    let store = Arc::new(
        StoreOptions::new()
            .pack_files(true)
            .pack_threshold(1 << 20)
            .retention(Retention::new().keep_last(1))
            .open(dir.path().join("run.ckpt"))?,
    );
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (store, done) = (store.clone(), done.clone());
        std::thread::spawn(move || -> std::result::Result<(u64, u64), String> {
            let (mut whole, mut interrupted) = (0, 0);
            while !done.load(Ordering::SeqCst) {
                match store.latest() {
                    Ok(Some(c)) if c == big(c.step) => whole += 1,
                    Ok(Some(c)) => return Err(format!("step {} read back wrong", c.step)),
                    Ok(None) => {}
                    Err(Error::ReadInterrupted { .. }) => interrupted += 1,
                    Err(e) => return Err(e.to_string()),
                }
            }
            Ok((whole, interrupted))
        })
    };
    for step in 0..60 {
        store.commit(&big(step))?;
    }
    done.store(true, Ordering::SeqCst);
    let (whole, interrupted) = reader.join().map_err(|_| "reader panicked")??;
    println!("{whole} whole reads, {interrupted} told to read again");
    assert!(whole > 0, "the reader never read a step");
    assert_eq!(interrupted, 0, "reads were not retried");
    assert_eq!(common::pack_files(&dir.path().join("run.ckpt")).len(), 1);
    Ok(())
}

/// A step removed while `verify` runs (its pack file deleted after the
/// verification listed it) is reported as gone, not as damaged; a pack
/// file missing that the store still records is damage.
#[test]
fn verify_tells_a_step_removed_meanwhile_from_damage() -> Result {
    use ckptstore::StoreOptions;
    let big = |step: u64| large_step(step, 2 << 20);
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = StoreOptions::new().pack_threshold(1 << 20).open(&path)?;
    for step in 0..3 {
        store.commit(&big(step))?;
    }
    // The verification lists steps 0-2; step 1 goes as step 0 is checked.
    let mut removed = false;
    let report = store.verify_with(&mut |step, _| {
        if step == 0 && !removed {
            removed = store.remove(1).expect("remove step 1");
        }
    })?;
    assert!(removed);
    assert!(report.is_ok(), "{:?}", report.damaged);
    assert_eq!(report.steps_gone, [1]);
    assert_eq!(report.steps_ok, 2);

    // A recorded file that is missing is damage, naming the step.
    let packs = common::pack_files(&path);
    std::fs::remove_file(&packs[packs.len() - 1])?;
    let report = store.verify()?;
    assert!(report.steps_gone.is_empty());
    let steps: Vec<u64> = report.damaged.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, [2]);
    Ok(())
}
