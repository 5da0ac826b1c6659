//! Replication to object storage: push, list, restore and pull, against a
//! directory, an in-memory store failing each call in turn, and (when
//! `scripts/garage.sh start` has run: `.ci/run` does) a real Garage server.

#![allow(clippy::cast_possible_truncation)] // test sizes and indices are small; 64-bit only

#[path = "../common/mod.rs"]
mod common;

mod cli;
mod cluster;
mod compressed;
mod coordinated;
mod counted;
mod faults;
mod files;
mod format3;
mod garage;
mod hf;
mod in_transit;
mod lost_packs;
mod promise;
mod rank_local;
mod remembered;
mod replicate;
mod retention;
mod save_records;
mod shards;
mod sim_ranks;
mod sim_s3;
mod simulated;
mod stats;
mod tails;
mod uncompressed;
mod untrusted;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ckptstore::{
    CheckpointStore, ComputationGraphStore, ComputationNode, Dtype, GradientCheckpoint, Remote,
    Tensor,
};
use futures::TryStreamExt;
use object_store::memory::InMemory;
use object_store::ObjectStore;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

use common::bytes;

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// A step with a graph, metrics, small and large blobs and tensors; the
/// 4 MiB "frozen" tensor is the same in every step.
fn checkpoint(step: u64) -> Result<GradientCheckpoint> {
    let mut graph = ComputationGraphStore::new();
    let id = graph.add_node(ComputationNode::new("matmul", vec!["cid_x".into()]));
    graph.record_output(&id, format!("cid_y_{step}"))?;
    let mut c = GradientCheckpoint::new(graph, step).with_loss_cid(format!("cid_loss_{step}"));
    c.metrics.insert("loss".into(), 1.0 / (step as f64 + 1.0));
    c.set_optimizer_state("rng", bytes(step, 100));
    c.set_optimizer_state("adam_m", bytes(step + 100, 300_000));
    c.set_tensor(
        "frozen",
        Tensor::new(Dtype::F32, vec![1024, 1024], bytes(7, 4 << 20))?,
    );
    c.set_tensor(
        "head",
        Tensor::new(Dtype::BF16, vec![4, 8], bytes(step + 200, 64))?,
    );
    Ok(c)
}

fn store_with(dir: &std::path::Path, steps: std::ops::Range<u64>) -> Result<CheckpointStore> {
    store_of(dir, steps, checkpoint)
}

/// A store at `dir/run.ckpt` holding `make(step)` for each of `steps`.
fn store_of(
    dir: &std::path::Path,
    steps: std::ops::Range<u64>,
    make: fn(u64) -> Result<GradientCheckpoint>,
) -> Result<CheckpointStore> {
    let store = CheckpointStore::open(dir.join("run.ckpt"))?;
    for step in steps {
        store.commit(&make(step)?)?;
    }
    Ok(store)
}

/// Push, list, restore, pull and dedup against `remote`, which is empty.
pub(crate) fn round_trip(remote: &Remote) -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 0..3)?;
    assert_eq!(remote.latest_step()?, None);
    let first = remote.push(&store)?;
    assert_eq!(first.steps_pushed, vec![0, 1, 2]);
    // The frozen tensor is uploaded once for the three steps.
    assert!(first.bytes_skipped >= 2 * (4 << 20), "{first:?}");
    assert!(first.bytes_uploaded < (4 << 20) + 3 * 400_000, "{first:?}");
    let again = remote.push(&store)?;
    assert_eq!(
        (
            again.steps_pushed.len(),
            again.steps_present,
            again.bytes_uploaded
        ),
        (0, 3, 0)
    );

    assert_eq!(remote.steps()?, vec![0, 1, 2]);
    assert_eq!(remote.latest_step()?, Some(2));
    for step in 0..3 {
        assert!(remote.get(step)? == store.get(step)?, "step {step}");
    }
    assert_eq!(remote.get(9)?, None);

    // A step whose 4 MiB tensor is unchanged uploads little.
    store.commit(&checkpoint(3)?)?;
    let next = remote.push(&store)?;
    assert_eq!(next.steps_pushed, vec![3]);
    let total = checkpoint(3)?.logical_bytes();
    assert!(
        next.bytes_uploaded * 100 <= total * 15,
        "{next:?} of {total}"
    );

    // Restore anywhere: a new local store from the bucket alone.
    let other = tempfile::tempdir()?;
    let fresh = CheckpointStore::open(other.path().join("copy.ckpt"))?;
    remote.pull(3, &fresh)?;
    assert!(fresh.get(3)? == store.get(3)?);
    assert!(fresh.verify()?.is_ok());
    assert!(matches!(
        remote.pull(42, &fresh),
        Err(ckptstore::Error::StepsNotFound { .. })
    ));
    Ok(())
}

#[test]
fn a_directory_works_as_a_bucket() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = Remote::open(&format!("file://{}/bucket/run1", dir.path().display()))?;
    round_trip(&remote)?;
    // Plain names, readable by anyone.
    let commits = std::fs::read_dir(dir.path().join("bucket/run1/commits"))?.count();
    assert_eq!(commits, 4);
    Ok(())
}

#[test]
fn bad_urls_are_refused_clearly() {
    for url in ["ftp://x/y", "s3://", "file://relative/dir"] {
        let e = Remote::open(url).expect_err(url);
        assert!(e.to_string().contains(url), "{e}");
    }
}

/// Every call of a push failing in turn: the push fails or completes, the
/// bucket then shows only whole steps, and a rerun completes the job.
#[test]
fn a_push_failing_at_any_call_resumes() -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 0..3)?;
    // Count the calls of a whole push.
    let counting = Arc::new(faults::Failing::new(Arc::new(InMemory::new()), 0));
    Remote::with_store(counting.clone(), "p", "mem://count")?.push(&store)?;
    let calls = counting.calls.load(Ordering::SeqCst);
    assert!(calls > 10, "{calls}");
    for k in 1..=calls {
        let memory = Arc::new(InMemory::new());
        let failing = Arc::new(faults::Failing::new(memory.clone(), k));
        let remote = Remote::with_store(failing.clone(), "p", "mem://failing")?;
        let failed = remote.push(&store).is_err();
        failing.fail_at.store(0, Ordering::SeqCst);
        if k == calls {
            // The last call deletes the push's lock: failing it leaves a
            // lock that goes stale, and the push itself done.
            assert!(!failed, "only the lock's deletion failed");
            assert_eq!(remote.steps()?, vec![0, 1, 2]);
            let objects: Vec<_> =
                futures::executor::block_on(memory.list(None).try_collect::<Vec<_>>())?;
            let locks = objects
                .iter()
                .filter(|m| m.location.as_ref().starts_with("p/locks/push-"))
                .count();
            assert_eq!(locks, 1);
            continue;
        }
        assert!(failed, "call {k} of {calls} failed, so must the push");
        for step in remote.steps()? {
            assert!(remote.get(step)? == store.get(step)?, "k={k}");
        }
        let rerun = remote.push(&store)?;
        assert_eq!(rerun.steps_present + rerun.steps_pushed.len() as u64, 3);
        assert_eq!(remote.steps()?, vec![0, 1, 2], "k={k}");
    }
    Ok(())
}

/// Every call of a restore failing in turn: `get` errs (never a wrong or
/// partial checkpoint), then succeeds.
#[test]
fn a_restore_failing_at_any_call_never_returns_wrong_data() -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 0..1)?;
    let memory = Arc::new(InMemory::new());
    Remote::with_store(memory.clone(), "p", "mem://m")?.push(&store)?;
    let counting = Arc::new(faults::Failing::new(memory.clone(), 0));
    let remote = Remote::with_store(counting.clone(), "p", "mem://count")?;
    assert!(remote.get(0)?.is_some());
    let calls = counting.calls.load(Ordering::SeqCst);
    for k in 1..=calls {
        let failing = Arc::new(faults::Failing::new(memory.clone(), k));
        let remote = Remote::with_store(failing, "p", "mem://failing")?;
        match remote.get(0) {
            Ok(got) => panic!("call {k} failed but get returned {:?}", got.map(|c| c.step)),
            Err(e) => assert!(e.to_string().contains("mem://failing"), "{e}"),
        }
        assert!(remote.get(0)? == store.get(0)?, "k={k}");
    }
    // A pull streams into the store: a failure leaves no step and nothing
    // staged; the next pull succeeds.
    let into = tempfile::tempdir()?;
    let fresh = CheckpointStore::open(into.path().join("fresh.ckpt"))?;
    for k in 1..=calls {
        let failing = Arc::new(faults::Failing::new(memory.clone(), k));
        let remote = Remote::with_store(failing, "p", "mem://failing")?;
        assert!(remote.pull(0, &fresh).is_err(), "call {k} failed");
        assert_eq!(fresh.steps()?, Vec::<u64>::new());
        let report = fresh.verify()?;
        assert!(
            report.is_ok() && report.staged_chunks == 0,
            "k={k}: {report:?}"
        );
    }
    Remote::with_store(memory, "p", "mem://m")?.pull(0, &fresh)?;
    assert!(fresh.get(0)? == store.get(0)?);
    Ok(())
}

/// A write answered 404 (S3's answer to a write to a bucket that is gone)
/// is `NoBucket` whichever request met it: a pack's upload (several at a
/// time) as a lock's or a manifest's.
#[test]
fn a_write_to_a_bucket_that_is_gone_says_so_on_every_path() -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_with(dir.path(), 0..1)?;
    for infix in ["/packs/", "/locks/", "/manifests/"] {
        let failing = Arc::new(faults::Failing::new(Arc::new(InMemory::new()), 0));
        *failing.gone_for.lock().map_err(|_| "poisoned")? = infix.to_owned();
        let e = Remote::with_store(failing.clone(), "p", "mem://gone")?
            .push(&store)
            .expect_err(infix);
        assert!(
            matches!(
                e,
                ckptstore::Error::Bucket(ckptstore::BucketError::NoBucket { .. })
            ),
            "{infix}: {e:?}"
        );
        assert!(e.to_string().starts_with("no bucket at mem://gone"), "{e}");
    }
    Ok(())
}
