//! A 3-node Garage cluster (replication factor 3, quorum 2 of 3) on
//! 127.0.0.1, started by `scripts/garage.sh cluster-start`: pushes, pulls,
//! shards and background replication go on with one node killed (kill -9)
//! and after it comes back; with two nodes down, errors are clear, the
//! store keeps working locally, and the next flush after they return
//! succeeds. Skipped unless `target/garage-cluster/env` is sourced
//! (`.ci/run` does, after the single-node tests).

use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ckptstore::{BucketError, CheckpointStore, Error, GradientCheckpoint, Remote, StoreOptions};

use super::garage::fresh_prefix;
use super::Result;
use crate::common::bytes;

static CLUSTER: Mutex<()> = Mutex::new(());

/// The cluster to ourselves, or `None` (skipped).
struct Cluster {
    garage: String,
    dir: String,
    bucket: String,
    _guard: MutexGuard<'static, ()>,
}

impl Cluster {
    fn get(test: &str) -> Option<Cluster> {
        let (Ok(garage), Ok(dir), Ok(bucket)) = (
            std::env::var("CKPT_CLUSTER_GARAGE"),
            std::env::var("CKPT_CLUSTER_DIR"),
            std::env::var("CKPT_CLUSTER_BUCKET"),
        ) else {
            eprintln!("{test}: skipped: no Garage cluster (scripts/garage.sh cluster-start)");
            return None;
        };
        let guard = CLUSTER
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Some(Cluster {
            garage,
            dir,
            bucket,
            _guard: guard,
        })
    }

    fn url(&self) -> String {
        format!("s3://{}/{}", self.bucket, fresh_prefix())
    }

    fn config(&self, node: u32) -> String {
        format!("{}/n{node}/garage.toml", self.dir)
    }

    fn pid_file(&self, node: u32) -> String {
        format!("{}/n{node}/pid", self.dir)
    }

    fn kill(&self, node: u32) {
        let pid = std::fs::read_to_string(self.pid_file(node)).expect("pid file");
        let killed = Command::new("kill").args(["-9", pid.trim()]).status();
        assert!(killed.is_ok_and(|s| s.success()), "kill -9 node {node}");
        // Gone for sure before the test goes on.
        std::thread::sleep(Duration::from_millis(200));
    }

    fn start(&self, node: u32) {
        let log = std::fs::File::options()
            .append(true)
            .create(true)
            .open(format!("{}/n{node}/server.log", self.dir))
            .expect("log");
        // The node outlives the test: `garage.sh cluster-stop` ends it.
        #[allow(clippy::zombie_processes)]
        let child = Command::new(&self.garage)
            .args(["-c", &self.config(node), "server"])
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("restart garage");
        std::fs::write(self.pid_file(node), child.id().to_string()).expect("pid file");
        // Up once node 1 counts it healthy again.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let status = Command::new(&self.garage)
                .args(["-c", &self.config(1), "status"])
                .output()
                .expect("garage status");
            let text = String::from_utf8_lossy(&status.stdout);
            let failed = text.split("FAILED NODES").nth(1).unwrap_or("");
            if status.status.success() && !failed.contains(&format!("39{node}1")) {
                break;
            }
            assert!(Instant::now() < deadline, "node {node} did not come back");
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Wait until node 1 takes writes again (a quorum of nodes connected):
    /// a write under a prefix of its own.
    fn wait_writable(&self) -> Result {
        let dir = tempfile::tempdir()?;
        let probe = CheckpointStore::open(dir.path().join("probe.ckpt"))?;
        let remote = Remote::open(&self.url())?.with_retry_window(Duration::from_secs(1))?;
        let deadline = Instant::now() + Duration::from_secs(120);
        while remote.adopt(&probe).is_err() {
            assert!(Instant::now() < deadline, "the cluster takes no writes");
            std::thread::sleep(Duration::from_millis(250));
        }
        Ok(())
    }
}

fn step(n: u64) -> GradientCheckpoint {
    let mut c = GradientCheckpoint::new(ckptstore::ComputationGraphStore::new(), n);
    c.timestamp = 1_700_000_000 + n;
    c.set_optimizer_state("w", bytes(n, 4 << 20));
    c
}

#[test]
fn one_node_killed_and_restarted_loses_nothing() -> Result {
    let Some(cluster) = Cluster::get("one_node_killed_and_restarted_loses_nothing") else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let url = cluster.url();
    let store = StoreOptions::new()
        .replicate_to(Remote::open(&url)?)
        .open(dir.path().join("run.ckpt"))?;
    for n in 0..3 {
        store.commit(&step(n))?;
    }
    store.flush()?;

    cluster.kill(3);
    // Replication, a push, shards and reads with two nodes of three.
    let started = Instant::now();
    for n in 3..6 {
        store.commit(&step(n))?;
    }
    store.flush()?;
    let waited = started.elapsed();
    println!("3 replicated steps of 4 MiB with node 3 down: {waited:?}");
    let remote = Remote::open(&url)?;
    assert_eq!(remote.steps()?, (0..6).collect::<Vec<_>>());
    assert_eq!(remote.get(4)?, Some(step(4)));
    let shards_url = cluster.url();
    let shards = Remote::open(&shards_url)?;
    for rank in 0..2 {
        let mut c = step(100 + u64::from(rank));
        c.step = 7;
        let info = shards.commit_shard(7, rank, 2, &c.into_step())?;
        assert_eq!(info.complete, rank == 1);
    }
    assert_eq!(shards.steps()?, vec![7]);
    let pulled = tempfile::tempdir()?;
    let copy = CheckpointStore::open(pulled.path().join("copy.ckpt"))?;
    remote.pull(5, &copy)?;
    assert_eq!(copy.get(5)?, Some(step(5)));

    cluster.start(3);
    cluster.wait_writable()?;
    // Everything reads back whole once it returns; writing goes on.
    store.commit(&step(6))?;
    store.flush()?;
    let verified = remote.verify()?;
    assert!(verified.is_ok() && verified.steps_ok == 7, "{verified:?}");
    Ok(())
}

#[test]
fn two_nodes_down_fail_clearly_and_the_store_goes_on() -> Result {
    let Some(cluster) = Cluster::get("two_nodes_down_fail_clearly_and_the_store_goes_on") else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let url = cluster.url();
    let remote = Remote::open(&url)?.with_retry_window(Duration::from_secs(3))?;
    let store = StoreOptions::new()
        .replicate_to(remote)
        .open(dir.path().join("run.ckpt"))?;
    store.commit(&step(0))?;
    store.flush()?;

    cluster.kill(2);
    cluster.kill(3);
    let started = Instant::now();
    store.commit(&step(1))?; // durable locally, whatever the bucket does
    let err = store.flush().expect_err("a flush without quorum succeeded");
    println!(
        "flush with two nodes of three down failed after {:?}: {err}",
        started.elapsed()
    );
    match &err {
        Error::Bucket(BucketError::ReplicationFailed { url: u, steps, .. }) => {
            assert_eq!(u, &url);
            assert_eq!(steps, &vec![1]);
        }
        e => panic!("{e:?}"),
    }
    assert!(err.to_string().contains(&url), "{err}");
    let status = store.replication_status()?.ok_or("no status")?;
    assert!(
        status.consecutive_failures >= 1 && status.last_error.is_some(),
        "{status:?}"
    );
    assert_eq!(status.pending, vec![1]);
    assert_eq!(store.get(1)?, Some(step(1)));
    store.commit(&step(2))?;

    let down = Instant::now();
    cluster.start(2);
    cluster.start(3);
    cluster.wait_writable()?;
    println!(
        "the cluster took writes again {:?} after the restarts",
        down.elapsed()
    );
    let started = Instant::now();
    store.flush()?;
    println!("flush after the nodes returned: {:?}", started.elapsed());
    let remote = Remote::open(&url)?;
    assert_eq!(remote.steps()?, vec![0, 1, 2]);
    assert_eq!(remote.get(2)?, Some(step(2)));
    assert!(store
        .replication_status()?
        .ok_or("no status")?
        .pending
        .is_empty());
    Ok(())
}

#[test]
fn a_node_killed_mid_push_leaves_whole_steps() -> Result {
    let Some(cluster) = Cluster::get("a_node_killed_mid_push_leaves_whole_steps") else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    for n in 0..8 {
        store.commit(&step(n))?;
    }
    let url = cluster.url();
    let remote = Remote::open(&url)?;
    let started = Instant::now();
    let pushed = std::thread::scope(|s| {
        let push = s.spawn(|| remote.push(&store));
        std::thread::sleep(Duration::from_millis(150));
        cluster.kill(2);
        push.join().expect("push thread")
    });
    println!(
        "push of 8 steps of 4 MiB, node 2 killed 150 ms in: {:?} ({})",
        started.elapsed(),
        if pushed.is_ok() { "done" } else { "failed" }
    );
    // Whatever is listed is whole; the rerun completes.
    for n in remote.steps()? {
        assert_eq!(remote.get(n)?, Some(step(n)), "step {n}");
    }
    remote.push(&store)?;
    assert_eq!(remote.steps()?, (0..8).collect::<Vec<_>>());
    cluster.start(2);
    cluster.wait_writable()?;
    assert!(remote.verify()?.is_ok());
    Ok(())
}
