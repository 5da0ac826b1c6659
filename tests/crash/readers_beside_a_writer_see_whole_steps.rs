//! Readers and `verify` beside a writer see a consistent store: a step is
//! whole, or gone, never damaged because the writer moved on (retention
//! deleting pack files, a commit's file in flight), and that holds for a
//! reader opened in the recovery view after a kill while a restarted
//! writer applies retention. `verify` streams: its memory is a few chunks
//! per thread, whatever the size of a step. Failed operations name what
//! to fix and leave nothing behind.
//!
//! Writers and measured readers run as children (the ignored
//! `reader_child` test, run by name with a mode saying what
//! to do).

use std::path::Path;
use std::process::{Command, Stdio};

use ckptstore::{CheckpointStore, Error, Retention, StoreOptions};

use crate::a_store_is_its_real_path::big;
use crate::common;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

fn child(mode: &str, store: &Path) -> Result<Command> {
    let name = "readers_beside_a_writer_see_whole_steps::reader_child";
    Ok(common::this_test_as_child(name, mode, store)?)
}

#[test]
#[ignore = "child-process entry point, run by the tests below"]
fn reader_child() -> Result {
    let (mode, store) = common::child_task()?;
    match mode.as_str() {
        // A training run that keeps its last two steps.
        "writer" => {
            let s = StoreOptions::new()
                .retention(Retention::new().keep_last(2))
                .open(&store)?;
            for step in 1..common::trials(30, 300) as u64 {
                s.commit(&big(step))?;
            }
        }
        // Commit four steps, then die without closing the store.
        "commit-and-die" => {
            let s = CheckpointStore::open(&store)?;
            for step in 1..=4 {
                s.commit(&big(step))?;
            }
            std::process::abort();
        }
        // Verify, then say how much memory that took at its peak.
        "verify-rss" => {
            let report = CheckpointStore::open_read_only(&store)?.verify()?;
            assert!(report.is_ok(), "{:?}", report.problems());
            let status = std::fs::read_to_string("/proc/self/status")?;
            let hwm = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .ok_or("no VmHWM")?;
            println!("CHECKED {} HWM {}", report.bytes_checked, hwm.trim());
        }
        other => return Err(format!("unknown child mode {other}").into()),
    }
    Ok(())
}

/// A step read beside a writer is whole (it reads back as written) or
/// gone.
fn whole_or_gone(store: &CheckpointStore, step: u64) -> Result {
    if let Some(got) = store.get(step)? {
        assert_eq!(got, big(step), "step {step} read damaged");
    }
    Ok(())
}

#[test]
fn verify_beside_a_writer_with_retention_reports_no_damage() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    CheckpointStore::open(&path)?.commit(&big(0))?;
    let mut writer = child("writer", &path)?.stdout(Stdio::null()).spawn()?;
    let reader = CheckpointStore::open_read_only(&path)?;
    let mut rounds = 0;
    while writer.try_wait()?.is_none() {
        let report = reader.verify()?;
        assert!(report.is_ok(), "beside the writer: {:?}", report.problems());
        assert_eq!(report.stray_pack_files, 0, "{report:?}");
        if let Some(step) = reader.latest_step()? {
            whole_or_gone(&reader, step)?;
        }
        rounds += 1;
    }
    assert!(writer.wait()?.success());
    assert!(rounds > 1, "the writer finished before a verification ran");
    let report = reader.verify()?;
    assert!(report.is_ok() && report.steps_gone.is_empty(), "{report:?}");
    Ok(())
}

#[test]
fn a_reader_in_the_recovery_view_sees_a_restarted_writer_whole() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let out = child("commit-and-die", &path)?.output()?;
    assert!(!out.status.success(), "the child was to abort");
    let early = CheckpointStore::open_read_only(&path)?;
    assert!(early.recovered_in_memory());
    assert_eq!(early.steps()?, [1, 2, 3, 4]);
    // Another reader opened before the writer, first used after it.
    let late = CheckpointStore::open_read_only(&path)?;
    // The restarted run keeps one step: steps 1-4 and their files go.
    let writer = StoreOptions::new()
        .retention(Retention::new().keep_last(1))
        .open(&path)?;
    writer.commit(&big(5))?;
    for reader in [&early, &late] {
        for step in 1..=5 {
            whole_or_gone(reader, step)?;
        }
        let report = reader.verify()?;
        assert!(report.is_ok(), "{:?}", report.problems());
        assert_eq!(reader.steps()?, [5]);
    }
    // And beside commits that go on.
    std::thread::scope(|s| -> Result {
        let commits = s.spawn(|| -> ckptstore::Result<()> {
            for step in 6..12 {
                writer.commit(&big(step))?;
            }
            Ok(())
        });
        while !commits.is_finished() {
            for step in 5..12 {
                whole_or_gone(&early, step)?;
            }
        }
        commits.join().map_err(|_| "writer panicked")??;
        Ok(())
    })?;
    Ok(())
}

#[test]
fn verify_holds_a_few_chunks_not_a_step() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    {
        let store = CheckpointStore::open(&path)?;
        let mut ckpt = big(1);
        ckpt.set_optimizer_state("huge", common::bytes(3, 256 << 20));
        store.commit(&ckpt)?;
    }
    let out = child("verify-rss", &path)?.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // libtest may print the test's name on the same line.
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("CHECKED ").map(|(_, r)| r))
        .ok_or("no report")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let checked: u64 = words[0].parse()?;
    let hwm_kib: u64 = words[2].parse()?;
    assert!(checked > 256 << 20, "{line}");
    println!("verify of a 262 MiB step: peak RSS {hwm_kib} KiB");
    assert!(
        hwm_kib < 96 << 10,
        "verify of a 262 MiB step peaked at {hwm_kib} KiB: {line}"
    );
    Ok(())
}

#[test]
fn a_failed_import_into_a_new_store_leaves_no_file_and_no_directory() -> Result {
    let dir = tempfile::tempdir()?;
    // A safetensors file of 96 MiB whose loss CID is refused only after
    // its tensor has been staged.
    let len = 96usize << 20;
    let header = format!(
        r#"{{"__metadata__":{{"ckptstore.loss_cid":"{}"}},"t":{{"dtype":"U8","shape":[{len}],"data_offsets":[0,{len}]}}}}"#,
        "c".repeat(70_000)
    );
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend(common::bytes(8, len));
    let src = dir.path().join("big.safetensors");
    std::fs::write(&src, file)?;
    let new = dir.path().join("new.ckpt");
    let (p, s) = (new.to_str().ok_or("path")?, src.to_str().ok_or("path")?);
    let (code, _, err) = common::ckpt(&["import", p, s, "--step", "1"])?;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("loss CID"), "{err}");
    assert_eq!(common::dir_names(dir.path())?, ["big.safetensors"]);
    // So a copy to that name works.
    let other = dir.path().join("other.ckpt");
    CheckpointStore::open(&other)?.commit(&big(1))?;
    let (code, _, err) = common::ckpt(&["cp", other.to_str().ok_or("path")?, p])?;
    assert_eq!(code, 0, "{err}");
    Ok(())
}

#[test]
fn refusals_name_what_to_fix_and_leave_nothing_behind() -> Result {
    let dir = tempfile::tempdir()?;
    // remove_store refuses what is not already a store, and deletes nothing.
    let empty = dir.path().join("empty.ckpt");
    std::fs::write(&empty, b"")?;
    assert!(CheckpointStore::remove_store(&empty).is_err());
    assert_eq!(
        std::fs::read(&empty)?,
        b"",
        "remove_store initialised the file"
    );
    // A copy into a missing directory names that directory.
    let src = dir.path().join("src.ckpt");
    CheckpointStore::open(&src)?.commit(&big(1))?;
    let missing = dir.path().join("missing/dir");
    let (code, _, err) = common::ckpt(&[
        "cp",
        src.to_str().ok_or("path")?,
        missing.join("x").to_str().ok_or("path")?,
    ])?;
    assert_eq!(code, 1);
    assert!(
        err.contains(&format!("{}:", missing.display())) && !err.contains(".x."),
        "{err}"
    );
    // A pack file replaced by a directory: damage naming the step.
    let pack = common::pack_files(&src)[0].clone();
    std::fs::remove_file(&pack)?;
    std::fs::create_dir(&pack)?;
    let e = CheckpointStore::open_read_only(&src)?
        .get(1)
        .expect_err("no pack file");
    assert!(matches!(e, Error::Corrupt { step: Some(1), .. }), "{e}");
    // A file where the pack directory goes: refused before anything is made.
    let blocked = dir.path().join("a.ckpt");
    std::fs::write(common::pack_dir(&blocked), b"not a directory")?;
    let e = CheckpointStore::open(&blocked).expect_err("the pack directory is a file");
    assert!(e.to_string().contains("a.ckpt.packs"), "{e}");
    assert!(!blocked.exists(), "a refused open created the store file");
    Ok(())
}
