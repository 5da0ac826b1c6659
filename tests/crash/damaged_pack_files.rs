//! Damaged pack files never lie: a flipped byte, a truncated file or a
//! missing one fails the read of exactly the steps whose chunks are there,
//! with `Error::Corrupt` naming the step and the file, and `verify` finds
//! it; the other steps read as they were.

use std::path::{Path, PathBuf};

use ckptstore::{CheckpointStore, ComputationGraphStore, Error, GradientCheckpoint, StoreOptions};

use crate::common;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Steps 1 and 2, each 3 MiB in a pack file of its own, and step 3 under
/// 2 MiB
/// (in redb). Returns the store's path and the pack file of step 2.
fn store_with_packs(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let path = dir.join("run.ckpt");
    let store = StoreOptions::new()
        .pack_files(true)
        .pack_threshold(2 << 20)
        .open(&path)?;
    store.commit(&big(1))?;
    store.commit(&big(2))?;
    store.commit(&common::deterministic(3))?;
    let packs = common::pack_files(&path);
    assert_eq!(packs.len(), 2);
    Ok((path, packs[1].clone()))
}

fn big(step: u64) -> GradientCheckpoint {
    let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    ckpt.timestamp = 1_750_000_000 + step;
    ckpt.set_optimizer_state("w", common::bytes(step, 3 << 20));
    ckpt
}

/// Step 2 fails with a corrupt-data error that names it and `what`; steps
/// 1 and 3 read back intact; verify reports step 2 alone.
fn only_step_2_fails(path: &Path, what: &str) -> Result {
    let store = CheckpointStore::open(path)?;
    match store.get(2) {
        Err(Error::Corrupt { step, detail }) => {
            assert_eq!(step, Some(2), "{detail}");
            assert!(detail.contains(what), "{detail}");
        }
        other => panic!("step 2 read as {other:?}"),
    }
    assert_eq!(store.get(1)?, Some(big(1)));
    assert_eq!(store.get(3)?, Some(common::deterministic(3)));
    let report = store.verify()?;
    let damaged: Vec<u64> = report.damaged.iter().map(|(s, _)| *s).collect();
    assert_eq!(damaged, [2], "{report:?}");
    assert_eq!(report.steps_ok, 2);
    Ok(())
}

#[test]
fn a_flipped_byte_in_a_pack_file_is_found() -> Result {
    let dir = tempfile::tempdir()?;
    let (path, pack) = store_with_packs(dir.path())?;
    let mut bytes = std::fs::read(&pack)?;
    bytes[(2 << 20) + 12_345] ^= 0x10;
    std::fs::write(&pack, bytes)?;
    only_step_2_fails(&path, "fails its hash check in pack file 00000001.pack")
}

#[test]
fn a_truncated_pack_file_is_found() -> Result {
    let dir = tempfile::tempdir()?;
    let (path, pack) = store_with_packs(dir.path())?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&pack)?
        .set_len(1 << 20)?;
    only_step_2_fails(&path, "is past the end of pack file 00000001.pack")?;
    let report = CheckpointStore::open(&path)?.verify()?;
    assert!(
        report.accounting.is_empty(),
        "accounting is checked only when no step is damaged"
    );
    Ok(())
}

#[test]
fn a_missing_pack_file_is_found() -> Result {
    let dir = tempfile::tempdir()?;
    let (path, pack) = store_with_packs(dir.path())?;
    std::fs::remove_file(&pack)?;
    // A read-only open: a writable one would not recreate it either.
    let reader = CheckpointStore::open_read_only(&path)?;
    let err = reader.get(2).expect_err("its pack file is gone");
    assert!(
        matches!(&err, Error::Corrupt { .. })
            && err.to_string().contains("00000001.pack is missing"),
        "{err}"
    );
    assert_eq!(reader.get(1)?, Some(big(1)));
    drop(reader);
    let store = CheckpointStore::open(&path)?;
    let report = store.verify()?;
    assert_eq!(report.damaged.len(), 1, "{report:?}");
    assert_eq!(report.damaged[0].0, 2);
    Ok(())
}

#[test]
fn a_pack_file_damaged_beside_a_healthy_store_keeps_the_store_usable() -> Result {
    let dir = tempfile::tempdir()?;
    let (path, pack) = store_with_packs(dir.path())?;
    std::fs::write(&pack, vec![0u8; 3 << 20])?;
    let store = StoreOptions::new()
        .pack_files(true)
        .pack_threshold(2 << 20)
        .open(&path)?;
    assert!(store.get(2).is_err());
    // Removing the damaged step deletes its file; new commits go on.
    store.remove(2)?;
    assert!(!pack.exists());
    store.commit(&big(4))?;
    assert_eq!(store.get(4)?, Some(big(4)));
    assert!(store.verify()?.is_ok());
    Ok(())
}
