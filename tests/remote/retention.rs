//! Retention, garbage collection and verification in a bucket.

use std::path::Path;
use std::time::Duration;

use ckptstore::{CheckpointStore, Remote, Retention, ShardHash, StoreOptions};

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

/// Steps 1-3 of 1.5 MiB of frozen bytes and 4 MiB of their own each.
fn frozen_and_own(step: u64) -> Result<ckptstore::GradientCheckpoint> {
    use ckptstore::{ComputationGraphStore, Dtype, GradientCheckpoint, Tensor};
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    c.timestamp = 1_700_000_000 + step;
    let frozen = super::bytes(7, 3 << 19);
    c.set_tensor(
        "frozen",
        Tensor::new(Dtype::U8, vec![frozen.len() as u64], frozen)?,
    );
    c.set_optimizer_state("w", super::bytes(step, 4 << 20));
    Ok(c)
}

/// A pack whose step retention deleted, kept for the chunks a later step
/// shares (a frozen tensor), is mostly dead: a collection packs the live
/// chunks again and commits the steps that need them anew; the next one
/// deletes the old pack. Every step reads the same throughout, and a push
/// after it finds everything there.
#[test]
fn a_mostly_dead_pack_is_rewritten() -> Result {
    const MIB: usize = 1 << 20;
    let make = frozen_and_own;
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    for step in 1..=3 {
        store.commit(&make(step)?)?;
    }
    let remote = dir_remote(dir.path(), Duration::ZERO)?;
    remote.push(&store)?;
    assert_eq!(count(dir.path(), "packs"), 3);
    // Step 1's pack: its own 4 MiB and the frozen 1.5 MiB that steps 2
    // and 3 share.
    let gc = remote.gc(&Retention::new().keep_last(2))?;
    assert_eq!(gc.steps_removed, vec![1]);
    assert_eq!(gc.packs_repacked, 1, "{gc:?}");
    let frozen = (3 * MIB / 2) as u64;
    assert!(
        gc.bytes_repacked >= frozen && gc.bytes_repacked < frozen + MIB as u64,
        "{gc:?}"
    );
    assert_eq!(
        gc.packs_deleted, 0,
        "the old pack stays for readers: {gc:?}"
    );
    for step in [2, 3] {
        assert!(remote.get(step)? == Some(make(step)?), "step {step}");
    }
    let next = remote.collect_garbage()?;
    assert_eq!(
        (next.commits_superseded, next.packs_deleted),
        (2, 1),
        "{next:?}"
    );
    assert!(next.bytes_deleted >= frozen + 4 * MIB as u64, "{next:?}");
    assert_eq!(remote.collect_garbage()?.packs_repacked, 0);
    assert_eq!(count(dir.path(), "packs"), 3);
    assert_eq!(remote.verify()?.steps_ok, 2);
    let fresh = dir_remote(dir.path(), Duration::ZERO)?;
    for step in [2, 3] {
        assert!(fresh.get(step)? == Some(make(step)?), "step {step}");
    }
    // The store's push finds the repacked steps there: nothing uploaded,
    // no new commit.
    let again = fresh.push(&store)?;
    assert_eq!(
        (again.bytes_uploaded, again.steps_pushed.len()),
        (0, 0),
        "{again:?}"
    );
    assert_eq!(count(dir.path(), "commits"), 2);
    Ok(())
}

/// Retention with a repack that fails at any request (request k, for
/// every k it makes) leaves every listed step readable and whole, and the
/// next run finishes the job.
#[test]
fn a_repack_cut_short_at_any_request_loses_nothing() -> Result {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    type Failing = super::faults::Failing;
    let setup = || -> Result<(Arc<Failing>, CheckpointStore, tempfile::TempDir)> {
        let dir = tempfile::tempdir()?;
        let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
        for step in 1..=3 {
            store.commit(&frozen_and_own(step)?)?;
        }
        let memory = Arc::new(object_store::memory::InMemory::new());
        let failing = Arc::new(Failing::new(memory, 0));
        Remote::with_store(failing.clone(), "run", "mem://run")?.push(&store)?;
        Ok((failing, store, dir))
    };
    let open = |f: &Arc<Failing>| -> Result<Remote> {
        let remote = Remote::with_store(f.clone(), "run", "mem://run")?;
        Ok(remote.with_grace_period(Duration::ZERO))
    };
    let policy = Retention::new().keep_last(2);
    // How many requests retention and its collection make.
    let (failing, _, _dir) = setup()?;
    let before = failing.calls.load(Ordering::SeqCst);
    assert_eq!(open(&failing)?.gc(&policy)?.packs_repacked, 1);
    let requests = failing.calls.load(Ordering::SeqCst) - before;
    // The last request releases the lock, whose failure leaves a lock
    // that lapses: not an error.
    for k in 1..requests {
        let (failing, store, _dir) = setup()?;
        let at = failing.calls.load(Ordering::SeqCst) + k;
        failing.fail_at.store(at, Ordering::SeqCst);
        let cut = open(&failing)?.gc(&policy);
        failing.fail_at.store(0, Ordering::SeqCst);
        assert!(
            cut.is_err(),
            "request {k} of {requests} failed, the gc did not"
        );
        let remote = open(&failing)?;
        let listed = remote.steps()?;
        assert!(listed.ends_with(&[2, 3]), "cut at {k}: {listed:?}");
        for step in listed {
            assert!(
                remote.get(step)? == store.get(step)?,
                "cut at {k}: step {step}"
            );
        }
        remote.gc(&policy)?;
        remote.collect_garbage()?;
        let verified = remote.verify()?;
        assert!(
            verified.is_ok() && verified.steps_ok == 2,
            "cut at {k}: {verified:?}"
        );
        assert_eq!(remote.collect_garbage()?.packs_repacked, 0, "cut at {k}");
        assert_eq!(remote.steps()?, vec![2, 3], "cut at {k}");
    }
    eprintln!("retention with a repack cut at each of its {requests} requests: nothing lost");
    Ok(())
}

/// The same for a global step: each rank's shard manifest is written
/// again, and the step's commit names the new shards.
#[test]
fn a_global_step_is_repacked_shard_by_shard() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = dir_remote(dir.path(), Duration::ZERO)?;
    let shard = |step: u64, rank: u32| -> Result<ckptstore::Step> {
        let mut c = frozen_and_own(step)?.into_step();
        let w = super::bytes(step * 10 + u64::from(rank), 4 << 20);
        c.insert("w", ckptstore::Entry::Blob(w));
        Ok(c)
    };
    for step in 1..=3 {
        let names: Vec<ShardHash> = (0..2)
            .map(|rank| {
                Ok(remote
                    .upload_shard(step, rank, 2, &shard(step, rank)?)?
                    .shard)
            })
            .collect::<Result<_>>()?;
        remote.commit_global(step, &names)?;
    }
    let gc = remote.gc(&Retention::new().keep_last(2))?;
    // Rank 1's step 1 pack is all dead (its frozen bytes deduplicated
    // against rank 0's): deleted; rank 0's is mostly dead: rewritten.
    assert_eq!((gc.packs_repacked, gc.packs_deleted), (1, 1), "{gc:?}");
    remote.collect_garbage()?;
    let fresh = dir_remote(dir.path(), Duration::ZERO)?;
    assert_eq!(fresh.steps()?, vec![2, 3]);
    for step in [2, 3] {
        for rank in 0..2 {
            let got = fresh.get_shard(step, rank)?;
            assert!(got == Some(shard(step, rank)?), "step {step} rank {rank}");
        }
    }
    let verified = fresh.verify()?;
    assert!(verified.is_ok() && verified.steps_ok == 2, "{verified:?}");
    Ok(())
}

/// Retention's deletions hold against a push that lists the bucket rather
/// than trust what the store remembers of it (the URL spelled with a
/// trailing slash; a copy of the store adopting the prefix): nothing
/// retention deleted is uploaded again.
#[test]
fn a_push_that_lists_the_bucket_uploads_nothing_retention_deleted() -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 0..4)?;
    let remote = dir_remote(dir.path(), Duration::ZERO)?;
    remote.push(&store)?;
    let policy = Retention::new().keep_last(2);
    assert_eq!(remote.apply_retention(&policy)?, vec![0, 1]);
    let url = format!("file://{}/", dir.path().join("bucket").display());
    let again = Remote::open(&url)?.push(&store)?;
    assert!(again.steps_pushed.is_empty(), "{again:?}");
    assert_eq!(again.bytes_uploaded, 0);
    assert_eq!(remote.steps()?, vec![2, 3]);

    let copy = dir.path().join("copy.ckpt");
    store.copy_to(&copy, StoreOptions::new())?;
    let copy = CheckpointStore::open(&copy)?;
    remote.adopt(&copy)?;
    let adopted = remote.push(&copy)?;
    assert!(adopted.steps_pushed.is_empty(), "{adopted:?}");
    assert_eq!(remote.steps()?, vec![2, 3]);
    Ok(())
}

/// `verify` judges what readers get: a step saved twice is one step, and
/// one whose pack was lost and which was then saved again (its older
/// commits now broken) is sound at its newest commit.
#[test]
fn verify_judges_the_commit_readers_take() -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 1..2)?;
    let remote = dir_remote(dir.path(), Duration::from_secs(3600))?;
    remote.push(&store)?;
    let packs = dir.path().join("bucket/packs");
    let first: Vec<_> = std::fs::read_dir(&packs)?.collect::<std::io::Result<_>>()?;

    // Saved again with other content: two commits of one step.
    store.remove(1)?;
    let mut changed = checkpoint(1)?;
    changed.set_optimizer_state("adam_m", super::bytes(999, 300_000));
    store.commit(&changed)?;
    remote.push(&store)?;
    assert_eq!(count(dir.path(), "commits"), 2);
    let report = remote.verify()?;
    assert_eq!(
        (report.steps_ok, report.damaged.len()),
        (1, 0),
        "{report:?}"
    );

    // The first push's pack lost (the frozen tensor's chunks with it),
    // then the step pushed again: its newest commit names what is there.
    for entry in &first {
        std::fs::remove_file(entry.path())?;
    }
    remote.repair(&store)?;
    assert!(remote.get(1)? == Some(changed));
    let report = remote.verify()?;
    assert_eq!(
        (report.steps_ok, report.damaged.len()),
        (1, 0),
        "{report:?}"
    );
    Ok(())
}
