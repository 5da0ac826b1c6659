//! The bucket keeps the promise "never a partial, stale or silently
//! damaged step": a redone step replaces the old one, a prefix holds one
//! run, no push commits on chunks a collection took while its lock had
//! lapsed, prefixes do not leak into each other, and a 0.3.0 bucket reads.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use ckptstore::{
    BucketError, CheckpointStore, ComputationGraphStore, ComputationNode, Dtype, Error,
    GradientCheckpoint, Remote, StoreOptions, Tensor,
};
use object_store::local::LocalFileSystem;

use super::{bytes, checkpoint, faults, store_of, store_with, Result};

fn dir_url(dir: &Path) -> String {
    format!("file://{}", dir.join("bucket").display())
}

/// Step `step` with other content than `checkpoint(step)`, one per `round`.
fn redone(step: u64, round: u64) -> Result<GradientCheckpoint> {
    let mut c = checkpoint(step)?;
    c.set_optimizer_state("adam_m", bytes(step + 1000 * round, 300_000));
    c.metrics.insert("loss".into(), round as f64);
    Ok(c)
}

fn other_run(step: u64) -> Result<GradientCheckpoint> {
    redone(step, 77)
}

/// The commit objects of `step` in a directory bucket.
fn commits_of(bucket: &Path, step: u64) -> Result<usize> {
    let names = common_names(&bucket.join("commits"))?;
    Ok(names
        .iter()
        .filter(|n| n.starts_with(&format!("{step:020}-")))
        .count())
}

/// A new folder `name` in `dir`.
fn sub(dir: &Path, name: &str) -> Result<std::path::PathBuf> {
    let path = dir.join(name);
    std::fs::create_dir_all(&path)?;
    Ok(path)
}

fn common_names(dir: &Path) -> Result<Vec<String>> {
    Ok(super::common::dir_names(dir)?)
}

#[test]
fn a_redone_step_replaces_the_old_one() -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 1..4)?;
    let remote = Remote::open(&dir_url(dir.path()))?.with_grace_period(Duration::ZERO);
    remote.push(&store)?;
    let mut last = None;
    for round in 1..=5 {
        // A rollback after a loss spike: step 3 again, other content.
        store.remove(3)?;
        let again = redone(3, round)?;
        store.commit(&again)?;
        let report = remote.push(&store)?;
        assert_eq!(report.steps_pushed, vec![3], "round {round}");
        assert!(remote.get(3)? == Some(again.clone()), "round {round}");
        assert_eq!(remote.steps()?, vec![1, 2, 3]);
        assert_eq!(remote.latest_step()?, Some(3));
        last = Some(again);
    }
    // A push with nothing new does nothing; the redone steps' commits are
    // superseded, and garbage collection deletes them.
    assert_eq!(remote.push(&store)?.steps_present, 3);
    assert_eq!(commits_of(&dir.path().join("bucket"), 3)?, 6);
    let gc = remote.collect_garbage()?;
    assert_eq!(gc.commits_superseded, 5, "{gc:?}");
    assert_eq!(commits_of(&dir.path().join("bucket"), 3)?, 1);
    assert!(remote.get(3)? == last);
    let report = remote.verify()?;
    assert!(report.is_ok() && report.steps_ok == 3, "{report:?}");
    Ok(())
}

#[test]
fn replication_serves_the_redone_step() -> Result {
    let dir = tempfile::tempdir()?;
    let url = dir_url(dir.path());
    let store = StoreOptions::new()
        .replicate_to(Remote::open(&url)?)
        .open(dir.path().join("run.ckpt"))?;
    for step in 1..4 {
        store.commit(&checkpoint(step)?)?;
    }
    store.flush()?;
    for round in 1..=5 {
        store.remove(3)?;
        let again = redone(3, round)?;
        store.commit(&again)?;
        store.flush()?;
        assert!(Remote::open(&url)?.get(3)? == Some(again), "round {round}");
    }
    Ok(())
}

#[test]
fn a_redone_global_step_never_mixes_attempts() -> Result {
    let dir = tempfile::tempdir()?;
    redo_a_global_step(&Remote::open(&dir_url(dir.path()))?)?;
    assert_eq!(commits_of(&dir.path().join("bucket"), 7)?, 2);
    if let Ok(bucket) = std::env::var("CKPT_TEST_BUCKET") {
        let _server = super::garage::SERVER
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let url = format!("s3://{bucket}/{}", super::garage::fresh_prefix());
        redo_a_global_step(&Remote::open(&url)?)?;
    }
    Ok(())
}

/// Step 7 of two ranks, then redone: the old attempt is served until every
/// rank of the new one has landed.
fn redo_a_global_step(remote: &Remote) -> Result {
    let shard = |rank: u32, round: u64| -> Result<ckptstore::Step> {
        let mut c = ckptstore::Step::new(7);
        c.timestamp = 1_700_000_000; // the same each time it is built
        let params = bytes(u64::from(rank) + 10 * round, 100_000);
        c.insert("params", ckptstore::Entry::Blob(params));
        Ok(c)
    };
    assert!(!remote.commit_shard(7, 0, 2, &shard(0, 1)?)?.complete);
    assert!(remote.commit_shard(7, 1, 2, &shard(1, 1)?)?.complete);
    // The step is redone: rank 0 with new content, rank 1 with the same.
    // Until rank 1 has landed again, the first attempt is the step.
    std::thread::sleep(Duration::from_millis(20));
    assert!(!remote.commit_shard(7, 0, 2, &shard(0, 2)?)?.complete);
    assert!(remote.get_shard(7, 0)? == Some(shard(0, 1)?));
    assert!(remote.commit_shard(7, 1, 2, &shard(1, 1)?)?.complete);
    assert!(remote.get_shard(7, 0)? == Some(shard(0, 2)?));
    assert!(remote.get_shard(7, 1)? == Some(shard(1, 1)?));
    assert_eq!(remote.steps()?, vec![7]);
    assert!(remote.verify()?.is_ok());
    Ok(())
}

#[test]
fn a_prefix_holds_one_run() -> Result {
    let dir = tempfile::tempdir()?;
    let url = dir_url(dir.path());
    let remote = Remote::open(&url)?;
    let first = store_with(&sub(dir.path(), "a")?, 1..9)?;
    let second = store_of(&sub(dir.path(), "b")?, 1..9, other_run)?;
    let report = remote.push(&first)?;
    assert_eq!(report.steps_pushed.len(), 8);
    assert_eq!(remote.owner()?, Some(first.store_id()?));
    match remote.push(&second) {
        Err(e @ Error::Bucket(BucketError::PrefixOwned { .. })) => {
            let message = e.to_string();
            assert!(message.contains(&first.store_id()?), "{message}");
            assert!(message.contains(&second.store_id()?), "{message}");
            assert!(message.contains(&url), "{message}");
        }
        other => panic!("a second run's push: {other:?}"),
    }
    for step in 1..9 {
        assert!(remote.get(step)? == first.get(step)?, "step {step}");
    }
    // The CLI says the same, and exits 1.
    let path = dir.path().join("b/run.ckpt");
    drop(second);
    let (code, _, err) = super::common::ckpt(&["push", &path.to_string_lossy(), &url])?;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("holds the run of store"), "{err}");

    // A store pulled from the prefix continues its run there.
    let resumed = CheckpointStore::open(dir.path().join("resumed.ckpt"))?;
    remote.pull(8, &resumed)?;
    assert_eq!(resumed.store_id()?, first.store_id()?);
    resumed.commit(&checkpoint(9)?)?;
    assert_eq!(remote.push(&resumed)?.steps_pushed, vec![9]);

    // Adopting the prefix hands it to another store.
    let (code, out, err) =
        super::common::ckpt(&["push", "--adopt", &path.to_string_lossy(), &url])?;
    assert_eq!(code, 0, "{out}{err}");
    let second = CheckpointStore::open(&path)?;
    assert_eq!(remote.owner()?, Some(second.store_id()?));
    for step in 1..9 {
        assert!(remote.get(step)? == second.get(step)?, "step {step}");
    }
    assert!(matches!(
        remote.push(&first),
        Err(Error::Bucket(BucketError::PrefixOwned { .. }))
    ));
    Ok(())
}

/// Stores pushing first into an empty prefix at once: one run wins it.
#[test]
fn stores_racing_for_an_empty_prefix_leave_one_run() -> Result {
    let dir = tempfile::tempdir()?;
    race_for(&dir_url(dir.path()), dir.path())?;
    assert_eq!(common_names(&dir.path().join("bucket/owner"))?.len(), 1);
    if let Ok(bucket) = std::env::var("CKPT_TEST_BUCKET") {
        let _server = super::garage::SERVER
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let url = format!("s3://{bucket}/{}", super::garage::fresh_prefix());
        race_for(&url, &sub(dir.path(), "garage")?)?;
    }
    Ok(())
}

/// Four stores (in `dir`) push first into `url` at once: exactly one wins.
fn race_for(url: &str, dir: &Path) -> Result {
    let url = url.to_owned();
    let stores: Vec<CheckpointStore> = (0..4)
        .map(|i| store_of(&sub(dir, &format!("s{i}"))?, 1..3, checkpoint))
        .collect::<Result<_>>()?;
    let barrier = Barrier::new(stores.len());
    let won: Vec<bool> = std::thread::scope(|s| {
        let handles: Vec<_> = stores
            .iter()
            .map(|store| {
                let (barrier, url) = (&barrier, &url);
                s.spawn(move || {
                    let remote = Remote::open(url).expect("remote");
                    barrier.wait();
                    match remote.push(store) {
                        Ok(_) => true,
                        Err(Error::Bucket(
                            BucketError::PrefixOwned { .. } | BucketError::Busy { .. },
                        )) => false,
                        Err(e) => panic!("{e}"),
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    assert_eq!(won.iter().filter(|&&w| w).count(), 1, "{won:?}");
    let winner = won.iter().position(|&w| w).ok_or("a winner")?;
    assert_eq!(
        Remote::open(&url)?.owner()?,
        Some(stores[winner].store_id()?)
    );
    Ok(())
}

/// A step whose commit is there but whose packs or manifest are not
/// (deleted by hand) is not "present": a repair uploads them again, under
/// the same commit (the same chunks make the same packs).
#[test]
fn a_step_missing_chunks_is_repaired_by_the_next_push() -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 1..3)?;
    let remote = Remote::open(&dir_url(dir.path()))?;
    remote.push(&store)?;
    let packs = dir.path().join("bucket/packs");
    for name in common_names(&packs)? {
        std::fs::remove_file(packs.join(name))?;
    }
    assert_eq!(remote.verify()?.damaged.len(), 2);
    // A plain push trusts what the store remembers (only a collection
    // makes it look again); `repair` lists the bucket.
    assert!(remote.push(&store)?.steps_pushed.is_empty());
    let report = remote.repair(&store)?;
    assert_eq!(report.steps_pushed, vec![1, 2]);
    let verified = remote.verify()?;
    assert!(verified.is_ok() && verified.steps_ok == 2, "{verified:?}");
    assert_eq!(commits_of(&dir.path().join("bucket"), 1)?, 1);
    // A commit whose manifest is gone: the same.
    let manifests = dir.path().join("bucket/manifests");
    let first = common_names(&manifests)?
        .into_iter()
        .next()
        .ok_or("a manifest")?;
    std::fs::remove_file(manifests.join(first))?;
    assert_eq!(remote.verify()?.damaged.len(), 1);
    assert_eq!(remote.repair(&store)?.steps_pushed, vec![1]);
    assert!(remote.verify()?.is_ok());
    Ok(())
}

/// A push whose uploads stall for longer than the grace period, while
/// garbage collection runs in a loop: collections take the unreferenced
/// packs it uploaded, and the push, finding its lock lapsed, checks and
/// uploads them again before each commit. No listed step ever lacks a
/// chunk.
#[test]
fn a_push_whose_lock_lapsed_never_commits_on_collected_chunks() -> Result {
    let dir = tempfile::tempdir()?;
    let make = |step: u64| -> Result<GradientCheckpoint> {
        let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step);
        c.timestamp = 1_700_000_000 + step; // the same each time it is built
        c.set_optimizer_state("w", bytes(step, 3 << 20));
        Ok(c)
    };
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    for step in 1..=2 {
        store.commit(&make(step)?)?;
    }
    let bucket = dir.path().join("bucket");
    std::fs::create_dir_all(&bucket)?;
    let grace = Duration::from_millis(300);
    let slow = Arc::new(faults::Slow::new(
        Arc::new(LocalFileSystem::new()),
        "/packs/",
        Duration::from_millis(450),
        5,
    ));
    let prefix = bucket.to_string_lossy().into_owned();
    // A pack per chunk: uploads one after another, the first ones old
    // enough to collect before the step's commit.
    let pusher = Remote::with_store(slow, &prefix, "slow://bucket")?
        .with_grace_period(grace)
        .with_pack_size(1 << 20);
    let collector = Remote::open(&dir_url(dir.path()))?.with_grace_period(grace);
    let stop = AtomicBool::new(false);
    let deleted = AtomicU64::new(0);
    let report = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                let gc = collector.collect_garbage().expect("gc");
                deleted.fetch_add(gc.packs_deleted, Ordering::SeqCst);
                // Every listed step is whole, whenever it is looked at.
                for step in collector.steps().expect("steps") {
                    let got = collector.get(step).expect("a listed step reads");
                    assert!(got.is_some_and(|c| c.step == step));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let report = pusher.push(&store);
        stop.store(true, Ordering::SeqCst);
        report
    })?;
    assert_eq!(report.steps_pushed, vec![1, 2]);
    assert!(
        deleted.load(Ordering::SeqCst) > 0,
        "no collection took a pack: the race did not happen"
    );
    let verified = collector.verify()?;
    assert!(verified.is_ok() && verified.steps_ok == 2, "{verified:?}");
    for step in 1..=2 {
        assert!(collector.get(step)? == store.get(step)?);
    }
    Ok(())
}

/// Objects of another prefix below this one (`outer/chunks/...` of a push
/// to `outer/chunks`) are not this prefix's chunks.
#[test]
fn prefixes_do_not_leak_into_each_other() -> Result {
    let dir = tempfile::tempdir()?;
    let inner = store_with(&sub(dir.path(), "inner")?, 1..3)?;
    let outer = store_with(&sub(dir.path(), "outer")?, 1..3)?;
    let base = dir.path().join("bucket/outer");
    Remote::open(&format!("file://{}/chunks", base.display()))?.push(&inner)?;
    let remote = Remote::open(&format!("file://{}", base.display()))?;
    let report = remote.push(&outer)?;
    assert!(report.bytes_uploaded > 4 << 20, "{report:?}");
    let verified = remote.verify()?;
    assert!(verified.is_ok() && verified.steps_ok == 2, "{verified:?}");
    Ok(())
}

/// The fixture `tests/fixtures/bucket-0.3.0` was pushed by ckptstore
/// 0.3.0: steps 1-3 (1 deleted by retention), a global step 5 of 2 ranks.
#[test]
fn a_bucket_of_0_3_0_still_reads() -> Result {
    let dir = tempfile::tempdir()?;
    let bucket = dir.path().join("bucket");
    copy_dir(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bucket-0.3.0"),
        &bucket,
    )?;
    let remote = Remote::open(&dir_url(dir.path()))?;
    assert_eq!(remote.steps()?, vec![2, 3, 5]);
    assert_eq!(remote.owner()?, None);
    for step in [2, 3] {
        let got = remote.get(step)?.ok_or("a listed step reads")?;
        assert_eq!(got.graph.node_count(), 1);
        let mut want = fixture_step(step)?;
        want.graph = got.graph.clone(); // its node id was random
        assert!(got == want, "step {step}");
    }
    assert_eq!(remote.world_size(5)?, Some(2));
    for rank in 0..2u32 {
        let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 5);
        c.timestamp = 1_700_000_005;
        c.set_optimizer_state("params", vec![rank as u8 + 1; 66_000]);
        c.set_tensor(
            "bias",
            Tensor::new(Dtype::F32, vec![2], vec![rank as u8; 8])?,
        );
        assert!(
            remote.get_shard(5, rank)? == Some(c.into_step()),
            "rank {rank}"
        );
    }
    let verified = remote.verify()?;
    assert!(verified.is_ok() && verified.steps_ok == 3, "{verified:?}");
    // A redone step 3 supersedes the 0.3.0 commit; the first push claims
    // the prefix; collection keeps what the steps need.
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let mut three = fixture_step(3)?;
    three.metrics.insert("loss".into(), 0.25);
    store.commit(&three)?;
    store.commit(&fixture_step(4)?)?;
    let report = remote.push(&store)?;
    assert_eq!(report.steps_pushed, vec![3, 4]);
    // The new steps in format 3, beside 0.3.0's chunk objects.
    assert!(std::fs::read_dir(bucket.join("packs"))?.count() >= 2);
    assert_eq!(remote.owner()?, Some(store.store_id()?));
    assert!(remote.get(3)? == Some(three));
    assert_eq!(remote.steps()?, vec![2, 3, 4, 5]);
    let gc = remote.with_grace_period(Duration::ZERO).collect_garbage()?;
    assert_eq!(gc.commits_superseded, 1, "{gc:?}");
    let remote = Remote::open(&dir_url(dir.path()))?;
    let verified = remote.verify()?;
    assert!(verified.is_ok() && verified.steps_ok == 4, "{verified:?}");
    Ok(())
}

/// Step `step` of the 0.3.0 fixture, as it was made.
pub(crate) fn fixture_step(step: u64) -> Result<GradientCheckpoint> {
    let mut g = ComputationGraphStore::new();
    let id = g.add_node(ComputationNode::new("matmul", vec!["cid_x".into()]));
    g.record_output(&id, format!("cid_y_{step}"))?;
    let mut c = GradientCheckpoint::new(g, step).with_loss_cid(format!("cid_loss_{step}"));
    c.timestamp = 1_700_000_000 + step;
    c.metrics.insert("loss".into(), 1.0 / step as f64);
    c.set_optimizer_state("rng", vec![step as u8; 100]);
    c.set_optimizer_state("frozen", (0..70_000u32).map(|i| (i % 251) as u8).collect());
    c.set_tensor(
        "head",
        Tensor::new(Dtype::BF16, vec![2, 4], vec![step as u8; 16])?,
    );
    Ok(c)
}

pub(crate) fn copy_dir(from: &Path, to: &Path) -> Result {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &to.join(entry.file_name()))?;
        } else {
            std::fs::copy(entry.path(), to.join(entry.file_name()))?;
        }
    }
    Ok(())
}
