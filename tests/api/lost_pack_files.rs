//! Dedup never points at lost bytes (issue 65, item 1): a commit that
//! reuses a chunk whose pack file was deleted, cut short or replaced
//! writes the chunk again from its own bytes, so the step it acknowledges
//! loads; later commits then reuse the healed copy.

use std::path::{Path, PathBuf};

use ckptstore::{CheckpointStore, StoreOptions};

use super::pack_files::step_of;
use crate::common::{self, pack_files};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// How a pack file is lost.
#[derive(Clone, Copy, Debug)]
enum Loss {
    Deleted,
    /// Cut to half its length.
    Truncated,
    /// Replaced by a file of the same length with no pack header.
    Replaced,
    /// Replaced by the pack file of the same name and length of another
    /// store (a restore from the wrong backup, two runs sharing a
    /// directory): a valid header, another store's tag (issue 73, item 1).
    OtherStores,
}

const LOSSES: [Loss; 4] = [
    Loss::Deleted,
    Loss::Truncated,
    Loss::Replaced,
    Loss::OtherStores,
];

fn lose(file: &Path, loss: Loss) -> std::io::Result<()> {
    match loss {
        Loss::Deleted => std::fs::remove_file(file),
        Loss::Truncated => {
            let f = std::fs::OpenOptions::new().write(true).open(file)?;
            let len = f.metadata()?.len();
            f.set_len(len / 2)
        }
        Loss::Replaced => {
            let len = std::fs::metadata(file)?.len();
            let len = usize::try_from(len).map_err(std::io::Error::other)?;
            std::fs::write(file, vec![0x5a; len])
        }
        Loss::OtherStores => {
            let dir = tempfile::tempdir()?;
            let other = dir.path().join("other.ckpt");
            // The same sizes as step 1, other bytes.
            let mut ckpt = step_of(1);
            ckpt.set_optimizer_state("moving", common::bytes(100, 3 << 20));
            ckpt.set_optimizer_state("frozen", common::bytes(101, 2 << 20));
            packed()
                .open(&other)
                .map_err(std::io::Error::other)?
                .commit(&ckpt)
                .map_err(std::io::Error::other)?;
            let theirs = pack_files(&other);
            let name = file.file_name().ok_or(std::io::ErrorKind::InvalidInput)?;
            let same = theirs.iter().find(|p| p.file_name() == Some(name));
            let same = same.ok_or(std::io::ErrorKind::NotFound)?;
            assert_eq!(
                std::fs::metadata(same)?.len(),
                std::fs::metadata(file)?.len()
            );
            std::fs::copy(same, file).map(drop)
        }
    }
}

/// Commit step 1 (a frozen tensor and moving state) into pack files, lose
/// its pack file, commit steps 2 and 3 of the same frozen tensor with
/// `options`: each acknowledged step loads, step 2 says it healed, step 3
/// reuses the healed copy.
fn a_commit_after_a_lost_pack_loads(options: StoreOptions, loss: Loss) -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    packed().open(&path)?.commit(&step_of(1))?;
    let files: Vec<PathBuf> = pack_files(&path);
    assert!(!files.is_empty(), "{loss:?}: step 1 packed nothing");
    for f in &files {
        lose(f, loss)?;
    }
    let store = options.clone().open(&path)?;
    let info = store.commit(&step_of(2))?;
    // The frozen 2 MiB (two chunks and a tail piece) written again, and
    // said so.
    assert_eq!(info.chunks_healed, 3, "{loss:?}: {info:?}");
    assert_eq!(
        info.bytes_written + info.bytes_reused,
        5 << 20,
        "{loss:?}: {info:?}"
    );
    assert_eq!(store.get(2)?, Some(step_of(2)), "{loss:?}");
    let info = store.commit(&step_of(3))?;
    assert_eq!(
        (info.chunks_healed, info.bytes_reused),
        (0, 2 << 20),
        "{loss:?}: {info:?}"
    );
    assert_eq!(store.get(3)?, Some(step_of(3)), "{loss:?}");
    // Step 1's own moving bytes are gone: verify still reports it (and
    // the lost file), nothing else; the counters stay true.
    let report = store.verify()?;
    let damaged: Vec<u64> = report.damaged.iter().map(|(s, _)| *s).collect();
    assert_eq!(damaged, vec![1], "{loss:?}: {report:?}");
    let lost_file = files[0].display().to_string();
    assert!(
        report.accounting.iter().all(|a| a.contains(&lost_file)),
        "{loss:?}: {report:?}"
    );
    assert_eq!(store.stats()?.stored_bytes, 11 << 20, "{loss:?}");
    drop(store);
    // Reopened, the healed steps still load.
    let store = options.open(&path)?;
    assert_eq!(store.get(2)?, Some(step_of(2)), "{loss:?}");
    Ok(())
}

fn packed() -> StoreOptions {
    StoreOptions::new().pack_files(true).pack_threshold(1 << 20)
}

#[test]
fn a_commit_reusing_a_chunk_of_a_lost_pack_file_writes_it_again() -> Result {
    for loss in LOSSES {
        a_commit_after_a_lost_pack_loads(packed(), loss)?;
    }
    Ok(())
}

#[test]
fn a_staged_commit_reusing_a_chunk_of_a_lost_pack_file_writes_it_again() -> Result {
    // Reopened without pack files and with a small cache: large commits
    // stage their chunks in redb in parts first.
    let staging = || StoreOptions::new().pack_files(false).cache_size(4 << 20);
    for loss in LOSSES {
        a_commit_after_a_lost_pack_loads(staging(), loss)?;
    }
    Ok(())
}

#[test]
fn a_streamed_commit_reusing_a_chunk_of_a_lost_pack_file_writes_it_again() -> Result {
    // An import stages each part of the file as it reads it, and references
    // the staged chunks at the end with no bytes at hand: the check is made
    // as it stages.
    let dir = tempfile::tempdir()?;
    let other = packed().open(dir.path().join("other.ckpt"))?;
    other.commit(&step_of(2))?;
    let file = dir.path().join("2.safetensors");
    other.export_safetensors(2, &file)?;
    let path = dir.path().join("run.ckpt");
    let store = packed().open(&path)?;
    store.commit(&step_of(1))?;
    for f in pack_files(&path) {
        lose(&f, Loss::Deleted)?;
    }
    let info = store.import_safetensors(&file, 2)?;
    assert_eq!(info.chunks_healed, 3, "{info:?}");
    assert_eq!(store.get(2)?, Some(step_of(2)));
    Ok(())
}

#[test]
fn a_present_pack_file_is_reused_as_before() -> Result {
    let dir = tempfile::tempdir()?;
    let store: CheckpointStore = packed().open(dir.path().join("run.ckpt"))?;
    store.commit(&step_of(1))?;
    let info = store.commit(&step_of(2))?;
    assert_eq!(
        (info.chunks_healed, info.bytes_reused),
        (0, 2 << 20),
        "{info:?}"
    );
    Ok(())
}
