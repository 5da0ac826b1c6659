//! Pack files (`StoreOptions::pack_files`): a large commit's chunks go to a
//! file of their own beside the store, are read back byte for byte, are
//! deduplicated with the rest, and their file goes when its last step does.

use std::path::Path;

use ckptstore::{
    CheckpointStore, ComputationGraphStore, GradientCheckpoint, Retention, StoreOptions,
};

use crate::common;
use common::pack_files;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// A store with pack files for commits of 1 MiB of chunks and more.
pub fn packed(path: &Path) -> ckptstore::Result<CheckpointStore> {
    options().open(path)
}

/// The options of [`packed`].
fn options() -> StoreOptions {
    StoreOptions::new().pack_files(true).pack_threshold(1 << 20)
}

/// Step `step`: 3 MiB that change with the step, 2 MiB that never do.
pub fn step_of(step: u64) -> GradientCheckpoint {
    let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    ckpt.timestamp = 1_750_000_000 + step;
    ckpt.set_optimizer_state("moving", common::bytes(step, 3 << 20));
    ckpt.set_optimizer_state("frozen", common::bytes(u64::MAX, 2 << 20));
    ckpt
}

#[test]
fn large_commits_keep_their_chunks_in_pack_files() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = packed(&path)?;
    for step in 0..3 {
        let info = store.commit(&step_of(step))?;
        let written = if step == 0 { 5 << 20 } else { 3 << 20 };
        assert_eq!(info.bytes_written, written, "step {step}");
    }
    // One pack file per commit; the chunks are not in the redb file.
    assert_eq!(pack_files(&path).len(), 3);
    let packed_bytes: u64 = pack_files(&path)
        .iter()
        .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .sum();
    // Each file: a 32-byte header (the store that wrote it), the chunks.
    assert_eq!(packed_bytes, (11 << 20) + 3 * 32);
    assert!(
        std::fs::metadata(&path)?.len() < 4 << 20,
        "chunks went into redb"
    );
    for step in 0..3 {
        assert_eq!(store.get(step)?, Some(step_of(step)));
    }
    let report = store.verify()?;
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.pack_files, 3);
    assert_eq!(
        (report.pack_bytes, report.pack_live_bytes),
        ((11 << 20) + 3 * 32, 11 << 20)
    );
    assert_eq!(store.stats()?.stored_bytes, 11 << 20);
    drop(store);

    // Read without the option, and read-only: the same steps.
    let plain = CheckpointStore::open(&path)?;
    assert_eq!(plain.get(2)?, Some(step_of(2)));
    // A small commit without pack files stays in redb.
    plain.commit(&common::deterministic(10))?;
    assert_eq!(pack_files(&path).len(), 3);
    drop(plain);
    let reader = CheckpointStore::open_read_only(&path)?;
    assert_eq!(reader.get(1)?, Some(step_of(1)));
    assert_eq!(reader.get(10)?, Some(common::deterministic(10)));
    Ok(())
}

#[test]
fn a_pack_file_goes_with_its_last_step() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = options()
        .retention(Retention::new().keep_last(2))
        .open(&path)?;
    for step in 0..6 {
        store.commit(&step_of(step))?;
    }
    // Steps 4 and 5 remain: their own packs, and step 0's pack, which
    // holds the frozen chunks they still use.
    assert_eq!(store.steps()?, vec![4, 5]);
    let names: Vec<String> = pack_files(&path)
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    assert_eq!(names, ["00000000.pack", "00000004.pack", "00000005.pack"]);
    let report = store.verify()?;
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(store.stats()?.stored_bytes, (2 << 20) + (6 << 20));

    // Removing the last steps removes every pack file.
    store.remove(4)?;
    store.remove(5)?;
    assert!(pack_files(&path).is_empty(), "{:?}", pack_files(&path));
    assert!(store.verify()?.is_ok());
    Ok(())
}

#[test]
fn files_no_record_names_are_swept_by_a_writable_open() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    packed(&path)?.commit(&step_of(1))?;
    // Left by a transaction of this store that never committed (its
    // header names the store), and a file of no store's.
    let ours = pack_files(&path)[0].with_file_name("00000009.pack");
    std::fs::copy(&pack_files(&path)[0], &ours)?;
    let foreign = ours.with_file_name("00000005.pack");
    std::fs::write(&foreign, b"a file of no store: it has no pack header")?;
    // A read-only open changes nothing; verify counts the files: at or
    // past the next id, in flight; before it, stray.
    let report = CheckpointStore::open_read_only(&path)?.verify()?;
    assert_eq!(
        (
            report.pack_files,
            report.in_flight_pack_files,
            report.stray_pack_files
        ),
        (1, 2, 0)
    );
    assert!(report.is_ok(), "a stray file is not damage: {report:?}");
    assert!(ours.exists());
    let store = CheckpointStore::open(&path)?;
    assert!(!ours.exists(), "this store's unrecorded file is swept");
    assert!(foreign.exists(), "a file not provably this store's is left");
    assert_eq!(pack_files(&path).len(), 2);
    assert_eq!(store.get(1)?, Some(step_of(1)));
    Ok(())
}

#[test]
fn compact_rewrites_pack_files_that_are_mostly_dead() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = options()
        .retention(Retention::new().keep_last(1))
        .open(&path)?;
    for step in 0..3 {
        store.commit(&step_of(step))?;
    }
    // Step 0's pack file keeps the frozen 2 MiB of its 5 MiB: compaction
    // moves them to a new file and deletes it; step 2's file is all live.
    let on_disk = |path: &Path| -> u64 {
        pack_files(path)
            .iter()
            .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
            .sum()
    };
    assert_eq!(on_disk(&path), (5 << 20) + (3 << 20) + 2 * 32);
    assert!(store.compact()?);
    assert_eq!(on_disk(&path), (2 << 20) + (3 << 20) + 2 * 32);
    let names: Vec<String> = pack_files(&path)
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    assert_eq!(names, ["00000002.pack", "00000003.pack"]);
    assert_eq!(store.get(2)?, Some(step_of(2)));
    let report = store.verify()?;
    assert!(report.is_ok(), "{report:?}");
    // Nothing is left to rewrite; new commits go on.
    store.compact()?;
    assert_eq!(pack_files(&path).len(), 2);
    store.commit(&step_of(3))?;
    assert_eq!(store.get(3)?, Some(step_of(3)));
    assert!(store.verify()?.is_ok());
    Ok(())
}

#[test]
fn a_compaction_that_finds_a_damaged_chunk_moves_nothing() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = options()
        .retention(Retention::new().keep_last(1))
        .open(&path)?;
    store.commit(&step_of(0))?;
    store.commit(&step_of(1))?;
    // Damage the frozen chunks (the first 2 MiB of step 0's file).
    let first = &pack_files(&path)[0];
    let mut bytes = std::fs::read(first)?;
    bytes[100] ^= 1;
    std::fs::write(first, &bytes)?;
    let err = store.compact().expect_err("a damaged chunk stops it");
    assert!(matches!(err, ckptstore::Error::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("00000000.pack"), "{err}");
    assert_eq!(pack_files(&path).len(), 2, "nothing moved, nothing deleted");
    Ok(())
}

#[test]
fn a_step_whose_chunks_span_many_pack_files_reads_whole() -> Result {
    // Each step adds one blob and keeps the others: the last step's
    // chunks are in 100 pack files, more than a read keeps open at once.
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = StoreOptions::new()
        .pack_files(true)
        .pack_threshold(64 << 10)
        .open(&path)?;
    let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 0);
    for step in 0..100 {
        ckpt.step = step;
        ckpt.set_optimizer_state(format!("b{step:04}"), common::bytes(step, 70 << 10));
        let info = store.commit(&ckpt)?;
        assert_eq!(info.bytes_written, 70 << 10, "step {step}");
    }
    assert_eq!(pack_files(&path).len(), 100);
    assert_eq!(store.get(99)?, Some(ckpt));
    assert!(store.verify()?.is_ok());
    Ok(())
}
