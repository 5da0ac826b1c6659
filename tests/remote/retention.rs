//! Retention, garbage collection and verification in a bucket.

use std::path::Path;
use std::time::Duration;

use ckptstore::{CheckpointStore, Remote, Retention};

use super::{checkpoint, store_with, Result};

fn dir_remote(dir: &Path, grace: Duration) -> Result<Remote> {
    let url = format!("file://{}", dir.join("bucket").display());
    Ok(Remote::open(&url)?.with_grace_period(grace))
}

fn count(dir: &Path, folder: &str) -> usize {
    std::fs::read_dir(dir.join("bucket").join(folder)).map_or(0, Iterator::count)
}

#[test]
fn retention_deletes_steps_and_what_only_they_need() -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 0..5)?;
    let remote = dir_remote(dir.path(), Duration::ZERO)?;
    remote.push(&store)?;
    let packs_before = count(dir.path(), "packs");

    assert!(remote
        .apply_retention(&Retention::new().keep_last(0))
        .is_err());
    let policy = Retention::new().keep_last(2);
    assert_eq!(remote.retention_preview(&policy)?, vec![0, 1, 2]);
    assert_eq!(remote.apply_retention(&policy)?, vec![0, 1, 2]);
    assert_eq!(remote.steps()?, vec![3, 4]);
    assert_eq!(remote.get(1)?, None);
    for step in [3, 4] {
        assert!(remote.get(step)? == store.get(step)?, "step {step}");
    }
    assert_eq!(count(dir.path(), "commits"), 2);
    assert_eq!(count(dir.path(), "manifests"), 2);
    // Each step has its own adam_m and packed chunks in a pack of its
    // own; the frozen tensor's chunks are shared: step 0's pack stays.
    let packs_after = count(dir.path(), "packs");
    assert_eq!((packs_before, packs_after), (5, 3));
    assert!(remote.verify()?.is_ok());
    // Nothing left to collect, and deleted steps are not pushed again.
    assert_eq!(remote.collect_garbage()?.packs_deleted, 0);
    let again = remote.push(&store)?;
    assert!(again.steps_pushed.is_empty(), "{again:?}");
    assert_eq!(again.bytes_uploaded, 0);

    // A step committed again with other content is a new step: pushed.
    store.remove(1)?;
    let mut changed = checkpoint(1)?;
    changed.metrics.insert("loss".into(), 42.0);
    store.commit(&changed)?;
    assert_eq!(remote.push(&store)?.steps_pushed, vec![1]);
    assert!(remote.get(1)? == Some(changed));
    Ok(())
}

/// Retention racing a push: while a push runs (it has listed the bucket's
/// chunks and counts on the shared ones), every step is deleted; the
/// collection must wait, and every step the push committed restores.
#[test]
fn a_collection_never_takes_a_chunk_a_push_counts_on() -> Result {
    let dir = tempfile::tempdir()?;
    let first = store_with(dir.path(), 0..2)?;
    let remote = dir_remote(dir.path(), Duration::ZERO)?;
    remote.push(&first)?;

    let other = tempfile::tempdir()?;
    let second = CheckpointStore::open(other.path().join("b.ckpt"))?;
    for step in 10..13 {
        second.commit(&checkpoint(step)?)?;
    }
    // The shared chunks are older than the grace period, the push's lock
    // is not: only the lock keeps the collection from them.
    let grace = Duration::from_secs(1);
    std::thread::sleep(grace + Duration::from_millis(100));
    let pusher = dir_remote(dir.path(), grace)?;
    // The prefix holds the first store's run: the second takes it over.
    pusher.adopt(&second)?;
    let collector = dir_remote(dir.path(), grace)?;
    let everything = Retention::new().keep_last(0).allow_deleting_all();
    let mut raced = false;
    let report = pusher.push_with(&second, &mut |_, _| {
        if !raced {
            raced = true;
            assert_eq!(
                collector.apply_retention(&everything).expect("retention"),
                vec![0, 1]
            );
            assert!(collector.collect_garbage().expect("gc").deferred);
        }
        true
    })?;
    assert!(raced);
    assert_eq!(report.steps_pushed, vec![10, 11, 12]);
    // The frozen tensor was counted on, not uploaded.
    assert!(report.bytes_skipped >= 3 * (4 << 20), "{report:?}");
    assert_eq!(remote.steps()?, vec![10, 11, 12]);
    for step in 10..13 {
        assert!(remote.get(step)? == second.get(step)?, "step {step}");
    }
    // With the push done, the collection runs; what the steps need stays.
    let gc = remote.collect_garbage()?;
    assert!(!gc.deferred && gc.packs_deleted > 0, "{gc:?}");
    assert!(remote.verify()?.is_ok());
    assert_eq!(remote.verify()?.steps_ok, 3);
    Ok(())
}

#[test]
fn a_stale_lock_holds_nothing_and_young_garbage_is_kept() -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 0..2)?;
    let remote = dir_remote(dir.path(), Duration::from_secs(3600))?;
    remote.push(&store)?;
    // A killed push left its lock, an unreferenced pack, and (an older
    // build) an unreferenced chunk.
    std::fs::write(dir.path().join("bucket/locks/push-killed"), b"{}")?;
    std::fs::write(dir.path().join("bucket/packs").join("ef".repeat(32)), b"z")?;
    std::fs::create_dir_all(dir.path().join("bucket/chunks"))?;
    std::fs::write(dir.path().join("bucket/chunks").join("ab".repeat(32)), b"x")?;
    remote.apply_retention(&Retention::new().keep_last(1))?;
    assert!(remote.collect_garbage()?.deferred, "a live lock defers");
    // Judged with a short grace period, both are old.
    std::thread::sleep(Duration::from_millis(20));
    let short = dir_remote(dir.path(), Duration::from_millis(10))?;
    let gc = short.collect_garbage()?;
    assert!(!gc.deferred, "{gc:?}");
    // The strays go; step 0's pack holds the frozen tensor step 1 needs:
    // it stays.
    assert_eq!((gc.chunks_deleted, gc.packs_deleted), (1, 1), "{gc:?}");
    assert_eq!(short.steps()?, vec![1]);
    assert!(short.verify()?.is_ok());
    // A young stray is kept.
    std::fs::remove_file(dir.path().join("bucket/locks/push-killed"))?;
    std::fs::write(dir.path().join("bucket/chunks").join("cd".repeat(32)), b"y")?;
    let gc = remote.collect_garbage()?;
    assert_eq!((gc.chunks_deleted, gc.young_kept), (0, 1), "{gc:?}");
    Ok(())
}

#[test]
fn verify_names_each_damaged_step_and_readers_skip_them() -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 0..3)?;
    let remote = dir_remote(dir.path(), Duration::from_secs(3600))?;
    remote.push(&store)?;
    assert_eq!(remote.verify()?.steps_ok, 3);

    // Step 2: a byte of its own adam_m chunk flipped. Step 1: its
    // manifest gone.
    let bucket = dir.path().join("bucket");
    let manifest_of = |step: u64| -> Result<std::path::PathBuf> {
        let prefix = format!("{step:020}-");
        let found = std::fs::read_dir(bucket.join("manifests"))?
            .filter_map(std::result::Result::ok)
            .find(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .ok_or("no manifest")?;
        Ok(found.path())
    };
    let m2: serde_json::Value = serde_json::from_slice(&std::fs::read(manifest_of(2)?)?)?;
    let chunk = m2["blobs"]["adam_m"]["chunks"][0]
        .as_str()
        .ok_or("no chunk")?;
    // Where the index says it lies: a pack, from an offset.
    let at = &m2["index"][chunk];
    let (pack, offset) = (at[0].as_u64().ok_or("pack")?, at[1].as_u64().ok_or("at")?);
    let pack = m2["packs"][usize::try_from(pack)?]["hash"]
        .as_str()
        .ok_or("no pack")?;
    let path = bucket.join("packs").join(pack);
    let mut bytes = std::fs::read(&path)?;
    bytes[usize::try_from(offset)? + 1000] ^= 0x40;
    std::fs::write(&path, bytes)?;
    std::fs::remove_file(manifest_of(1)?)?;

    let report = remote.verify()?;
    assert_eq!(report.steps_ok, 1);
    let damaged: Vec<u64> = report.damaged.iter().map(|(s, _)| *s).collect();
    assert_eq!(damaged, vec![1, 2]);
    assert!(
        report.damaged[1].1.to_string().contains(chunk),
        "{}",
        report.damaged[1].1
    );
    // Listing is the commit listing: both stay listed until collected;
    // `skipped_steps` names the one without a manifest, the newest step
    // whose manifest checks out is 2, and restoring it fails its hash check
    // instead of returning bad data.
    assert_eq!(remote.steps()?, vec![0, 1, 2]);
    let skipped: Vec<u64> = remote.skipped_steps()?.iter().map(|(s, _)| *s).collect();
    assert_eq!(skipped, vec![1]);
    assert_eq!(remote.latest_step()?, Some(2));
    assert!(remote.get(2).is_err());
    assert_eq!(remote.get(1)?, None);
    Ok(())
}
