//! A store is its real path: opened by a relative name and then `chdir`,
//! through a symbolic link that is later repointed, or with another
//! store's files beside it, no acknowledged step is lost and no store
//! writes into or deletes another's files. A removal is undone by a crash
//! only as a whole (its files stay until it is durable), and a failed
//! operation on damaged pack data leaves the handle usable.
//!
//! Tests that need a process of their own (a `chdir`, a crash) re-run this
//! binary as the child (the ignored `path_child` test, run by name with
//! a mode saying what to do).

use std::path::Path;

use ckptstore::{CheckpointStore, Durability, Error, Retention, StoreOptions};

use crate::common;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Step `step` of 6 MiB that change with it: every commit packs.
pub fn big(step: u64) -> ckptstore::GradientCheckpoint {
    let mut ckpt = common::deterministic(step);
    ckpt.set_optimizer_state("weights", common::bytes(step + 17, 6 << 20));
    ckpt
}

/// Every step of the store at `path` reads back as written and `verify`
/// finds nothing wrong; its steps.
pub fn check_whole(path: &Path) -> Result<Vec<u64>> {
    let store = CheckpointStore::open_read_only(path)?;
    for step in store.steps()? {
        let got = store.get(step)?.ok_or("a listed step is readable")?;
        assert_eq!(got, big(step), "step {step} of {}", path.display());
    }
    let report = store.verify()?;
    assert!(
        report.is_ok(),
        "{}: {:?}",
        path.display(),
        report.problems()
    );
    Ok(store.steps()?)
}

/// Run this binary's `path_child` with `mode`, in `cwd`, on `store`.
fn child(mode: &str, cwd: &Path, store: &Path) -> Result<std::process::Output> {
    let out = common::this_test_as_child("a_store_is_its_real_path::path_child", mode, store)?
        .current_dir(cwd)
        .output()?;
    Ok(out)
}

/// What a test's own process does.
#[test]
#[ignore = "child-process entry point, run by the tests below"]
fn path_child() -> Result {
    let (mode, store) = common::child_task()?;
    match mode.as_str() {
        // Open by a relative name, commit, chdir to where another store of
        // that name is, commit again.
        "chdir" => {
            let s = CheckpointStore::open(&store)?;
            s.commit(&big(1))?;
            std::env::set_current_dir("../b")?;
            s.commit(&big(2))?;
            s.apply_retention(&Retention::new().keep_last(1))?;
            s.commit(&big(3))?;
        }
        // Remove a step of an Eventual store, then die without closing it.
        "eventual-remove" => {
            let s = StoreOptions::new()
                .shared(false)
                .durability(Durability::Eventual)
                .open(&store)?;
            assert!(s.remove(1)?);
            s.apply_retention(&Retention::new().keep_last(1))?;
            println!("REMOVED");
            std::process::abort();
        }
        other => return Err(format!("unknown child mode {other}").into()),
    }
    Ok(())
}

#[test]
fn a_store_opened_by_a_relative_path_survives_chdir() -> Result {
    let dir = tempfile::tempdir()?;
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&a)?;
    std::fs::create_dir_all(&b)?;
    // Another run's store of the same name where the writer moves to.
    {
        let other = CheckpointStore::open(b.join("run.ckpt"))?;
        other.commit(&big(7))?;
        other.commit(&big(8))?;
    }
    let out = child("chdir", &a, Path::new("run.ckpt"))?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(check_whole(&a.join("run.ckpt"))?, [2, 3]);
    assert_eq!(check_whole(&b.join("run.ckpt"))?, [7, 8]);
    assert!(!b
        .join("run.ckpt.packs")
        .read_dir()?
        .any(|e| e.ok().is_some_and(|e| e.file_name() == "00000002.pack")));
    Ok(())
}

#[test]
fn two_names_of_a_store_are_one_store_and_a_repointed_link_takes_nothing() -> Result {
    let dir = tempfile::tempdir()?;
    let (run7, run8, latest) = (
        dir.path().join("run-7.ckpt"),
        dir.path().join("run-8.ckpt"),
        dir.path().join("latest.ckpt"),
    );
    std::os::unix::fs::symlink("run-7.ckpt", &latest)?;
    {
        let through_link = CheckpointStore::open(&latest)?;
        assert_eq!(
            through_link.path(),
            std::fs::canonicalize(dir.path())?.join("run-7.ckpt")
        );
        through_link.commit(&big(1))?;
    }
    CheckpointStore::open(&run7)?.commit(&big(2))?;
    assert_eq!(check_whole(&latest)?, [1, 2]);
    assert_eq!(check_whole(&run7)?, [1, 2]);
    // Held open under one name, the store is not opened again under another.
    let held = CheckpointStore::open(&run7)?;
    let e = CheckpointStore::open(&latest).expect_err("one writer per store");
    assert!(
        matches!(e, Error::AlreadyOpen { .. }) && e.is_locked(),
        "{e}"
    );
    drop(held);
    // Repointed at a run not there yet: the link's target is created, and
    // the old run's files are not touched.
    std::fs::remove_file(&latest)?;
    std::os::unix::fs::symlink("run-8.ckpt", &latest)?;
    CheckpointStore::open(&latest)?.commit(&big(3))?;
    assert!(run8.exists() && !dir.path().join("latest.ckpt.packs").exists());
    assert_eq!(check_whole(&run7)?, [1, 2]);
    assert_eq!(check_whole(&run8)?, [3]);
    Ok(())
}

#[test]
fn a_writable_open_deletes_and_overwrites_only_its_own_pack_files() -> Result {
    let dir = tempfile::tempdir()?;
    let a = dir.path().join("a.ckpt");
    CheckpointStore::open(&a)?.commit(&big(1))?;
    let a_files = common::pack_files(&a);
    // A file without a header (as 0.4's first builds wrote them) that no
    // record names.
    let legacy = common::pack_dir(&a).join("00000040.pack");
    std::fs::write(&legacy, b"written before pack files had headers")?;
    // The store file moved away without its pack directory, and a new
    // store made in its place: the old files are not the new store's,
    // whose first pack id is the old store's first.
    std::fs::rename(&a, dir.path().join("a-moved.ckpt"))?;
    let store = CheckpointStore::open(&a)?;
    for f in a_files.iter().chain([&legacy]) {
        assert!(
            f.exists(),
            "{} was deleted by another store's open",
            f.display()
        );
    }
    let before: Vec<Vec<u8>> = a_files
        .iter()
        .map(std::fs::read)
        .collect::<std::io::Result<_>>()?;
    store.commit(&big(3))?;
    let after: Vec<Vec<u8>> = a_files
        .iter()
        .map(std::fs::read)
        .collect::<std::io::Result<_>>()?;
    assert_eq!(before, after, "another store's pack file was overwritten");
    assert_eq!(store.get(3)?, Some(big(3)));
    let report = store.verify()?;
    assert!(report.is_ok(), "{:?}", report.problems());
    let unrecorded = report.stray_pack_files + report.in_flight_pack_files;
    assert_eq!(unrecorded, a_files.len() as u64 + 1);
    Ok(())
}

#[test]
fn a_removal_undone_by_a_crash_leaves_the_step_whole() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    {
        let s = CheckpointStore::open(&path)?;
        for step in 1..=3 {
            s.commit(&big(step))?;
        }
    }
    let out = child("eventual-remove", dir.path(), &path)?;
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("REMOVED"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The crash took back what was not durable: each step listed is whole.
    let steps = check_whole(&path)?;
    assert!(!steps.is_empty() && steps.contains(&3), "{steps:?}");
    // Closed cleanly, an Eventual store's removal deletes the files.
    {
        let s = StoreOptions::new()
            .shared(false)
            .durability(Durability::Eventual)
            .open(&path)?;
        s.apply_retention(&Retention::new().keep_last(1))?;
    }
    assert_eq!(check_whole(&path)?, [3]);
    let report = CheckpointStore::open_read_only(&path)?.verify()?;
    assert_eq!(
        common::pack_files(&path).len() as u64,
        report.pack_files,
        "files of removed steps are left: {report:?}"
    );
    Ok(())
}

#[test]
fn a_failed_compaction_leaves_the_handle_usable_and_releases_the_lock() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = CheckpointStore::open(&path)?;
    // One pack file, four fifths of it dead once step 1 is replaced.
    let keep = common::bytes(5, 2 << 20);
    let mut ckpt = ckptstore::GradientCheckpoint::new(ckptstore::ComputationGraphStore::new(), 1);
    ckpt.set_optimizer_state("a_keep", keep.clone());
    ckpt.set_optimizer_state("b_drop", common::bytes(6, 8 << 20));
    store.commit(&ckpt)?;
    ckpt.optimizer_state.remove("b_drop");
    store.replace(&ckpt)?;
    common::flip_stored_byte(&path, &keep[..64], 10)?;
    let e = store
        .compact()
        .expect_err("a damaged chunk stops compaction");
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    // Still usable, and its drop releases the lock.
    store.commit(&big(3))?;
    drop(store);
    let again = CheckpointStore::open(&path)?;
    assert_eq!(again.get(3)?, Some(big(3)));
    Ok(())
}
