//! kill -9 of a committing process loses no acknowledged step and exposes no
//! partial one.
//!
//! The test re-runs its own binary as the writer (the ignored `writer_child`
//! test, run by name with `CKPT_KILL_STORE` set): it commits deterministic steps
//! and prints `COMMITTED n` after each `commit` returns. The parent kills it
//! with SIGKILL at seeded random moments, reopens the store and checks it.
//! 50 kills by default; `CKPT_LONG=1` runs 2,000. The same runs with
//! `commit_async`: the writer prints a step when its handle reports success,
//! and a kill may leave only steps after the last acknowledged one in
//! addition (the commit in flight and those queued, in order). And once more
//! with a 1 MiB cache, so that nearly every commit stages its chunks in
//! transactions of their own before the one that makes the step (a kill
//! between them must leave no step and, after the next writable open, no
//! staged chunk). And with pack files: a kill between a pack file's write
//! and the commit that records it must leave no step, and the next
//! writable open deletes the file.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use ckptstore::{CheckpointStore, StoreOptions};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

const STORE_VAR: &str = "CKPT_KILL_STORE";
const ASYNC_VAR: &str = "CKPT_KILL_ASYNC";
const CACHE_VAR: &str = "CKPT_KILL_CACHE";
const PACK_VAR: &str = "CKPT_KILL_PACKS";

/// The writer: runs only as a child of the test below.
#[test]
#[ignore = "child-process entry point, run by the tests below"]
fn writer_child() -> Result {
    let path = std::env::var_os(STORE_VAR).ok_or("run only as a child of the tests below")?;
    let mut options = StoreOptions::new();
    if let Some(cache) = std::env::var(CACHE_VAR).ok().and_then(|c| c.parse().ok()) {
        options = options.cache_size(cache);
    }
    // Chunks in the redb file, or (PACK_VAR) in pack files from 256 KiB.
    options = options.pack_files(std::env::var_os(PACK_VAR).is_some());
    options = options.pack_threshold(256 << 10);
    let store = options.open(Path::new(&path))?;
    let mut step = store.latest_step()?.map_or(0, |s| s + 1);
    let mut out = std::io::stdout().lock();
    if std::env::var_os(ASYNC_VAR).is_some() {
        let mut pending = std::collections::VecDeque::new();
        loop {
            pending.push_back(store.commit_async(common::deterministic(step))?);
            step += 1;
            while pending.len() > 2 {
                if let Some(h) = pending.pop_front() {
                    let info = h.wait()?;
                    writeln!(out, "COMMITTED {}", info.step)?;
                    out.flush()?;
                }
            }
        }
    }
    loop {
        store.commit(&common::deterministic(step))?;
        writeln!(out, "COMMITTED {step}")?;
        out.flush()?;
        step += 1;
    }
}

#[test]
fn kill9_during_commits_loses_no_acknowledged_step() -> Result {
    kill_loop(Mode::Commit, common::trials(50, 2_000), 0x5EED_CAFE)
}

#[test]
fn kill9_during_async_commits_loses_no_acknowledged_step() -> Result {
    kill_loop(Mode::Async, common::trials(30, 1_000), 0xA5_5EED)
}

#[test]
fn kill9_during_staged_commits_loses_no_acknowledged_step() -> Result {
    kill_loop(Mode::Staged, common::trials(30, 1_000), 0x0057_A6ED)
}

#[test]
fn kill9_during_commits_to_pack_files_loses_no_acknowledged_step() -> Result {
    kill_loop(Mode::Packed, common::trials(30, 1_000), 0x0BAC_CEDF)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Commit,
    Async,
    /// `commit` with a 1 MiB cache: commits over 256 KiB stage their chunks.
    Staged,
    /// `commit` with pack files for commits over 256 KiB.
    Packed,
}

/// Kill the writer `kills` times, on a fresh store every 50 kills (a crash
/// reopen repairs by reading the whole file, so one ever-growing store
/// would make long runs quadratic).
fn kill_loop(mode: Mode, kills: usize, seed: u64) -> Result {
    let dir = tempfile::tempdir()?;
    let mut rng = common::Rng(seed);
    let (mut steps, mut in_flight, mut staged) = (0, 0, 0);
    let mut done = 0;
    let mut epoch = 0;
    while done < kills {
        let n = (kills - done).min(50);
        let path = dir.path().join(format!("crash{epoch}.ckpt"));
        let (s, f, g) = kill_epoch(mode, n, &mut rng, &path)?;
        std::fs::remove_file(&path)?;
        let _ = std::fs::remove_dir_all(common::pack_dir(&path));
        steps += s;
        in_flight += f;
        staged += g;
        done += n;
        epoch += 1;
    }
    println!(
        "{mode:?}: {kills} kills, {steps} steps acknowledged and intact, \
         {in_flight} kills left in-flight steps committed, {staged} kills struck \
         a commit staging chunks or writing a pack file (deleted by the next writable open)"
    );
    assert!(
        !matches!(mode, Mode::Staged | Mode::Packed) || staged > 0,
        "no kill landed in a staged commit or a pack file's write: the test tests nothing"
    );
    Ok(())
}

#[allow(clippy::too_many_lines)] // one loop: start a writer, kill it, check
fn kill_epoch(
    mode: Mode,
    kills: usize,
    rng: &mut common::Rng,
    path: &Path,
) -> Result<(usize, usize, usize)> {
    let mut acknowledged: Vec<u64> = Vec::new();
    let mut in_flight_found = 0;
    let mut staged_found = 0;

    for kill in 0..kills {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args([
            "--exact",
            "kill9_loses_nothing::writer_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(STORE_VAR, path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        cmd.env_remove(ASYNC_VAR)
            .env_remove(CACHE_VAR)
            .env_remove(PACK_VAR);
        match mode {
            Mode::Commit => {}
            Mode::Async => {
                cmd.env(ASYNC_VAR, "1");
            }
            Mode::Staged => {
                cmd.env(CACHE_VAR, (1u32 << 20).to_string());
            }
            Mode::Packed => {
                cmd.env(PACK_VAR, "1");
            }
        }
        let mut child = cmd.spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout)
                .lines()
                .map_while(std::result::Result::ok)
            {
                // The test harness may print on the same line first.
                if let Some((_, n)) = line.rsplit_once("COMMITTED ") {
                    if let Ok(n) = n.trim().parse::<u64>() {
                        let _ = tx.send(n);
                    }
                }
            }
        });
        // Kill at a random moment: sometimes during open, mostly mid-run.
        std::thread::sleep(Duration::from_micros(rng.below(150_000)));
        child.kill()?; // SIGKILL
        child.wait()?;
        reader.join().map_err(|_| "reader thread panicked")?;
        let acked_now: Vec<u64> = rx.try_iter().collect();
        acknowledged.extend(&acked_now);

        // Reopen and check: it opens, every acknowledged step is there and
        // byte-identical, and the only other steps allowed are those after
        // the last acknowledgement that were in flight: one for commit, the
        // queue and the running commit for commit_async, in order.
        if mode == Mode::Staged && staging_under_way(path)? {
            // The kill struck while a commit staged chunks: the writable
            // open below must delete them (checked by verify at the end).
            staged_found += 1;
        }
        let packs_before = common::pack_files(path).len();
        let store = CheckpointStore::open(path)?;
        if common::pack_files(path).len() < packs_before {
            // The kill struck between a pack file's write and its commit:
            // the writable open deleted the file no record names.
            staged_found += 1;
        }
        let steps = store.steps()?;
        let expected_next = acknowledged.last().map_or(0, |s| s + 1);
        let in_flight_max = if mode == Mode::Async { 3 } else { 1 };
        for &s in &acknowledged {
            assert!(
                steps.contains(&s),
                "kill {kill}: acknowledged step {s} lost"
            );
        }
        let extra: Vec<u64> = steps
            .iter()
            .copied()
            .filter(|s| !acknowledged.contains(s))
            .collect();
        assert!(
            extra.len() <= in_flight_max
                && extra
                    .iter()
                    .enumerate()
                    .all(|(i, &s)| s == expected_next + i as u64),
            "kill {kill}: unexpected steps {extra:?} (acknowledged up to {:?})",
            acknowledged.last()
        );
        if !extra.is_empty() {
            in_flight_found += 1;
            // Committed but killed before printing: they count now.
            acknowledged.extend(&extra);
        }
        let latest = store.latest()?;
        assert!(
            latest == steps.last().map(|&s| common::deterministic(s)),
            "kill {kill}: latest() is not the complete highest step of {steps:?}"
        );
        // Every step, not only the new ones, is intact.
        for &s in acknowledged.iter().rev().take(5) {
            assert!(
                store.get(s)? == Some(common::deterministic(s)),
                "kill {kill}: step {s} differs"
            );
        }
        drop(store);
    }

    let store = CheckpointStore::open(path)?;
    let report = store.verify()?;
    assert!(
        report.is_ok(),
        "damaged after {kills} kills: {:?}",
        report.damaged
    );
    assert_eq!(report.steps_ok as usize, acknowledged.len());
    // The writable open above deleted whatever a killed commit had staged
    // or left in a pack file no record names.
    assert_eq!(
        report.staged_chunks, 0,
        "staged chunks survived a writable open"
    );
    assert_eq!(
        common::pack_files(path).len() as u64,
        report.pack_files,
        "pack files no record names survived a writable open"
    );
    assert!(
        mode != Mode::Packed || report.pack_files > 0,
        "nothing was packed"
    );
    assert!(
        acknowledged.len() >= kills / 5,
        "the writer made too little progress to test anything: {} steps in {kills} kills",
        acknowledged.len()
    );
    Ok((acknowledged.len(), in_flight_found, staged_found))
}

/// Whether the store at `path` says a commit was staging chunks (read with
/// redb itself, which repairs the file after the kill, before ckptstore's
/// open deletes what was staged).
fn staging_under_way(path: &Path) -> Result<bool> {
    use redb::ReadableDatabase;
    const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");
    if !path.exists() {
        return Ok(false);
    }
    let db = redb::Database::builder()
        .set_concurrency_mode(redb::ConcurrencyMode::SingleWriter)
        .open(path)?;
    let txn = db.begin_read()?;
    let meta = match txn.open_table(META) {
        Ok(meta) => meta,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    let staging = meta.get("staging")?.is_some();
    Ok(staging)
}
