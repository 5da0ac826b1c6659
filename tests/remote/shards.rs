//! Global steps of N ranks (`Remote::commit_shard`): visible only when every
//! shard has landed, whatever was killed when.

use std::ops::RangeInclusive;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use ckptstore::{BucketError, Entry, Error, GradientCheckpoint, Remote, Retention, Step};
use object_store::memory::InMemory;

use super::{bytes, faults, Result};

/// Rank `rank`'s shard of `step`: 512 KiB of its own, a 1 MiB tensor the
/// same in every step (per rank), a small blob, a metric.
fn shard(step: u64, rank: u32) -> Result<Step> {
    let mut c = Step::new(step);
    c.timestamp = 1_790_000_000 + step; // the same step whenever it is made
    c.metrics.insert("loss".into(), 1.0 / (step as f64 + 1.0));
    c.insert(
        "params",
        Entry::Blob(bytes(step * 100 + u64::from(rank), 512 << 10)),
    );
    c.insert("rng", Entry::Blob(bytes(step + u64::from(rank), 64)));
    let frozen = ckptstore::Tensor::new(
        ckptstore::Dtype::U8,
        vec![1 << 20],
        bytes(u64::from(rank) + 7, 1 << 20),
    )?;
    c.insert("frozen", Entry::Tensor(frozen));
    Ok(c)
}

fn dir_remote(dir: &std::path::Path) -> Result<Remote> {
    Ok(Remote::open(&format!("file://{}/bucket", dir.display()))?)
}

/// Every listed step has all `world` shards, each as committed.
fn whole_global_steps(remote: &Remote, world: u32) -> Result<Vec<u64>> {
    let steps = remote.steps()?;
    for &step in &steps {
        assert_eq!(remote.world_size(step)?, Some(world), "step {step}");
        for rank in 0..world {
            let got = remote
                .get_shard(step, rank)?
                .ok_or("a shard of a listed step is gone")?;
            assert!(got == shard(step, rank)?, "step {step} rank {rank} differs");
        }
    }
    Ok(steps)
}

#[test]
fn a_step_is_visible_only_when_every_shard_landed() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = dir_remote(dir.path())?;
    for rank in 0..4 {
        remote.commit_shard(4, rank, 4, &shard(4, rank)?)?;
    }
    assert_eq!(remote.latest_step()?, Some(4));
    // Rank 3 of step 5 was killed before its shard landed.
    for rank in 0..3 {
        let info = remote.commit_shard(5, rank, 4, &shard(5, rank)?)?;
        assert!(!info.complete);
        // The frozen tensor of each rank is in the bucket since step 4
        // (but its last 128 bytes, which travel with the packed blobs).
        assert!(info.bytes_skipped >= (1 << 20) - 128, "{info:?}");
    }
    assert_eq!(remote.latest_step()?, Some(4));
    assert_eq!(remote.steps()?, vec![4]);
    let status = remote.shards(5)?;
    assert_eq!(
        (
            status.world_size,
            status.landed.clone(),
            status.missing.clone(),
            status.complete
        ),
        (Some(4), vec![0, 1, 2], vec![3], false)
    );
    assert_eq!(remote.get_shard(5, 1)?, Some(shard(5, 1)?));
    assert_eq!(remote.get_shard(5, 3)?, None);
    // Restarted, rank 3 redoes the step: it appears.
    let info = remote.commit_shard(5, 3, 4, &shard(5, 3)?)?;
    assert!(info.complete);
    assert_eq!(remote.latest_step()?, Some(5));
    assert!(remote.shards(5)?.complete);
    assert_eq!(whole_global_steps(&remote, 4)?, vec![4, 5]);
    assert!(matches!(
        remote.get(5),
        Err(Error::Bucket(BucketError::ShardedStep {
            step: 5,
            world_size: 4
        }))
    ));
    // A retry of a landed shard uploads nothing and leaves one shard.
    let again = remote.commit_shard(5, 2, 4, &shard(5, 2)?)?;
    assert_eq!((again.bytes_uploaded, again.complete), (0, true));
    let folder = dir.path().join(format!("bucket/shards/{:020}", 5));
    assert_eq!(std::fs::read_dir(folder)?.count(), 4);
    assert_eq!(
        std::fs::read_dir(dir.path().join("bucket/commits"))?.count(),
        2
    );
    assert!(remote.verify()?.is_ok());
    assert_eq!(remote.verify()?.steps_ok, 2);
    Ok(())
}

#[test]
fn ranks_that_disagree_on_the_world_size_are_told() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = dir_remote(dir.path())?;
    remote.commit_shard(1, 0, 4, &shard(1, 0)?)?;
    match remote.commit_shard(1, 1, 2, &shard(1, 1)?) {
        Err(Error::Bucket(BucketError::WorldSizeMismatch {
            step: 1,
            ours: 2,
            theirs: 4,
            ..
        })) => {}
        other => panic!("{other:?}"),
    }
    assert!(
        remote.commit_shard(1, 4, 4, &shard(1, 0)?).is_err(),
        "rank 4 of 4"
    );
    assert!(
        remote.commit_shard(2, 0, 4, &shard(1, 0)?).is_err(),
        "a step-1 checkpoint"
    );
    assert_eq!(remote.steps()?, Vec::<u64>::new());
    Ok(())
}

/// All ranks landing at once: one commit, one consistent step; in a
/// directory and, when it runs, on the Garage server.
#[test]
fn ranks_finishing_together_write_one_commit() -> Result {
    let dir = tempfile::tempdir()?;
    let url = format!("file://{}/bucket", dir.path().display());
    finish_together(&url)?;
    assert_eq!(
        std::fs::read_dir(dir.path().join("bucket/commits"))?.count(),
        1
    );
    if let Ok(bucket) = std::env::var("CKPT_TEST_BUCKET") {
        let _server = super::garage::SERVER
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for _ in 0..3 {
            finish_together(&format!("s3://{bucket}/{}", super::garage::fresh_prefix()))?;
        }
    }
    Ok(())
}

/// Four ranks commit their shards of step 9 at the same moment.
fn finish_together(url: &str) -> Result {
    let barrier = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4u32)
        .map(|rank| {
            let (url, barrier) = (url.to_owned(), barrier.clone());
            std::thread::spawn(move || -> std::result::Result<bool, String> {
                let remote = Remote::open(&url).map_err(|e| e.to_string())?;
                let ckpt = shard(9, rank).map_err(|e| e.to_string())?;
                barrier.wait();
                let info = remote
                    .commit_shard(9, rank, 4, &ckpt)
                    .map_err(|e| e.to_string())?;
                Ok(info.complete)
            })
        })
        .collect();
    let mut completes = 0;
    for t in threads {
        completes += usize::from(t.join().map_err(|_| "rank panicked")??);
    }
    assert!(completes >= 1);
    let remote = Remote::open(url)?;
    assert_eq!(whole_global_steps(&remote, 4)?, vec![9]);
    Ok(())
}

/// Every call of a 4-rank step failing in turn: each rank that errs
/// retries; the step never shows partial, and ends complete.
#[test]
fn a_four_rank_step_failing_at_any_call() -> Result {
    let counting = Arc::new(faults::Failing::new(Arc::new(InMemory::new()), 0));
    let remote = Remote::with_store(counting.clone(), "g", "mem://count")?;
    for rank in 0..4 {
        remote.commit_shard(1, rank, 4, &shard(1, rank)?)?;
    }
    let calls = counting.calls.load(Ordering::SeqCst);
    for k in 1..=calls {
        let memory = Arc::new(InMemory::new());
        let failing = Arc::new(faults::Failing::new(memory.clone(), k));
        let remote = Remote::with_store(failing.clone(), "g", "mem://failing")?;
        let mut failed = Vec::new();
        for rank in 0..4 {
            if remote.commit_shard(1, rank, 4, &shard(1, rank)?).is_err() {
                failed.push(rank);
            }
            // A reader meanwhile: an error (the fault), or whole steps.
            let _ = whole_global_steps(&remote, 4);
        }
        failing.fail_at.store(0, Ordering::SeqCst);
        let steps = whole_global_steps(&remote, 4)?;
        // Only a failed lock deletion leaves a rank's work whole.
        assert!(
            steps.is_empty() || failed.len() <= 1,
            "k={k}: {steps:?} {failed:?}"
        );
        for rank in failed {
            remote.commit_shard(1, rank, 4, &shard(1, rank)?)?;
        }
        assert_eq!(whole_global_steps(&remote, 4)?, vec![1], "k={k}");
    }
    Ok(())
}

#[test]
fn retention_counts_complete_steps_and_collects_stale_shards() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = dir_remote(dir.path())?.with_grace_period(Duration::ZERO);
    for step in 1..=3 {
        for rank in 0..2 {
            remote.commit_shard(step, rank, 2, &shard(step, rank)?)?;
        }
    }
    // Step 4 never completes: rank 1 died for good.
    remote.commit_shard(4, 0, 2, &shard(4, 0)?)?;
    assert_eq!(
        remote.apply_retention(&Retention::new().keep_last(2))?,
        vec![1]
    );
    assert_eq!(whole_global_steps(&remote, 2)?, vec![2, 3]);
    // Step 1's shards and step 4's stale one are gone.
    let shards = |step: u64| {
        std::fs::read_dir(dir.path().join(format!("bucket/shards/{step:020}")))
            .map_or(0, Iterator::count)
    };
    assert_eq!((shards(1), shards(2), shards(4)), (0, 2, 0));
    assert_eq!(remote.shards(4)?.landed, Vec::<u32>::new());
    assert!(remote.verify()?.is_ok());
    Ok(())
}

/// The child process of the kill loop: rank `CKPT_RANK` of `CKPT_WORLD`
/// commits its shard of steps `CKPT_FIRST..=CKPT_LAST` into `CKPT_URL`.
#[test]
#[ignore = "a child process of four_ranks_killed_at_random"]
fn rank_child() -> Result {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("{name} is not set"));
    let rank: u32 = var("CKPT_RANK")?.parse()?;
    let world: u32 = var("CKPT_WORLD")?.parse()?;
    let (first, last): (u64, u64) = (var("CKPT_FIRST")?.parse()?, var("CKPT_LAST")?.parse()?);
    let remote = Remote::open(&var("CKPT_URL")?)?;
    for step in first..=last {
        remote.commit_shard(step, rank, world, &shard(step, rank)?)?;
    }
    Ok(())
}

/// The four processes of `rank_child`, committing `steps`.
fn ranks(url: &str, steps: &RangeInclusive<u64>) -> Result<Vec<Child>> {
    (0..4u32)
        .map(|rank| {
            Ok(Command::new(std::env::current_exe()?)
                .args(["shards::rank_child", "--exact", "--ignored", "--quiet"])
                .env("CKPT_RANK", rank.to_string())
                .env("CKPT_WORLD", "4")
                .env("CKPT_FIRST", steps.start().to_string())
                .env("CKPT_LAST", steps.end().to_string())
                .env("CKPT_URL", url)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?)
        })
        .collect()
}

/// Every listed step of `steps` has its four shards as committed.
fn whole_global_steps_in(remote: &Remote, steps: &RangeInclusive<u64>) -> Result<Vec<u64>> {
    let listed: Vec<u64> = remote
        .steps()?
        .into_iter()
        .filter(|s| steps.contains(s))
        .collect();
    for &step in &listed {
        for rank in 0..4 {
            let got = remote
                .get_shard(step, rank)?
                .ok_or("a shard of a listed step is gone")?;
            assert!(got == shard(step, rank)?, "step {step} rank {rank} differs");
        }
    }
    Ok(listed)
}

/// Four rank processes commit 20 new steps a round while ranks are killed
/// (SIGKILL) at random moments: after each round, every listed step of the
/// round has its four shards as committed, and the latest step is whole. A
/// last run without kills completes every step.
#[test]
fn four_ranks_killed_at_random() -> Result {
    let dir = tempfile::tempdir()?;
    let url = if let Ok(bucket) = std::env::var("CKPT_TEST_BUCKET") {
        format!("s3://{bucket}/{}", super::garage::fresh_prefix())
    } else {
        eprintln!("four_ranks_killed_at_random: no S3 server, using a directory");
        format!("file://{}/bucket", dir.path().display())
    };
    let _server = super::garage::SERVER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // How long an uninterrupted round takes here, into a prefix of its own.
    let started = Instant::now();
    for mut r in ranks(&format!("{url}-timing"), &(1..=20))? {
        assert!(r.wait()?.success());
    }
    let round = started.elapsed();

    let remote = Remote::open(&url)?;
    let rounds = if std::env::var_os("CKPT_LONG").is_some() {
        30
    } else {
        5
    };
    let mut rng = super::Rng(0x00C0_FFEE);
    let (mut kills, mut cut_short) = (0, 0);
    for r in 0..rounds {
        let steps = 20 * r + 1..=20 * r + 20;
        let mut children = ranks(&url, &steps)?;
        std::thread::sleep(round.mul_f64((rng.next() % 1000) as f64 / 1000.0));
        for child in &mut children {
            if rng.next() % 2 == 0 && child.try_wait()?.is_none() {
                child.kill()?;
                kills += 1;
            }
        }
        for child in &mut children {
            child.wait()?;
        }
        let listed = whole_global_steps_in(&remote, &steps)?;
        if listed.len() < 20 {
            cut_short += 1;
        }
        if let Some(latest) = remote.latest_step()? {
            assert_eq!(remote.steps()?.last(), Some(&latest));
        }
    }
    let all = 1..=20 * rounds;
    for mut r in ranks(&url, &all)? {
        assert!(r.wait()?.success());
    }
    assert_eq!(remote.steps()?, all.clone().collect::<Vec<_>>());
    // Every commit reads back whole. A rank restarted mid-run packs the
    // chunks its killed process had packed again (it remembers nothing),
    // so a redone shard may differ and its step get a newer commit.
    let report = remote.verify()?;
    assert!(
        report.is_ok() && report.steps_ok >= 20 * rounds,
        "{report:?}"
    );
    assert!(
        kills > 0 && cut_short > 0,
        "{kills} kills, {cut_short} rounds cut short"
    );
    eprintln!(
        "{kills} ranks killed over {rounds} rounds, {cut_short} rounds left steps incomplete \
         (never listed); an uninterrupted round of 20 steps took {round:?}"
    );
    Ok(())
}

#[test]
fn ckpt_ls_shows_ranks_and_with_all_the_steps_not_complete() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = dir_remote(dir.path())?;
    for rank in 0..2 {
        remote.commit_shard(1, rank, 2, &shard(1, rank)?)?;
    }
    remote.commit_shard(2, 1, 2, &shard(2, 1)?)?;
    let url = remote.url().to_owned();
    let (code, out, err) = super::cli::ckpt(&["ls", &url])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("ranks") && out.contains("1 steps"), "{out}");
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with("1 "))
        .ok_or("row")?;
    assert_eq!(row.split_whitespace().nth(1), Some("2"), "{out}");
    let (code, out, _) = super::cli::ckpt(&["ls", &url, "--all"])?;
    assert_eq!(code, 0);
    assert!(
        out.contains(
            "2  incomplete: 1 of 2 ranks of the newest coordinated save landed (1), missing 0"
        ),
        "{out}"
    );
    let (code, out, _) = super::cli::ckpt(&["ls", &url, "--all", "--json"])?;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(v["steps"][0]["world_size"], 2);
    assert_eq!(v["incomplete"][0]["missing"], serde_json::json!([0]));
    let (code, _, err) = super::cli::ckpt(&["show", &url, "1"])?;
    assert_eq!(code, 1);
    assert!(err.contains("get_shard"), "{err}");
    Ok(())
}

/// Each rank commits to its own local store first, then pushes its shard.
#[test]
fn local_stores_take_part_with_push_shard() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = dir_remote(dir.path())?;
    for rank in 0..3 {
        let store = ckptstore::CheckpointStore::open(dir.path().join(format!("rank{rank}.ckpt")))?;
        store.commit(&GradientCheckpoint::from(shard(6, rank)?))?;
        let info = remote.push_shard(&store, 6, rank, 3)?;
        assert_eq!(info.complete, rank == 2);
        assert!(matches!(
            remote.push_shard(&store, 7, rank, 3),
            Err(Error::StepNotFound { step: 7 })
        ));
    }
    assert_eq!(whole_global_steps(&remote, 3)?, vec![6]);
    Ok(())
}

/// A reader can open exactly the commit another reader opened, after the
/// step was saved again: what keeps the ranks of one DCP load on one save.
#[test]
fn a_step_saved_again_is_still_read_from_the_commit_first_opened() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = dir_remote(dir.path())?;
    let save = |data_of: u64| -> Result {
        let mut shards = Vec::new();
        for rank in 0..2 {
            let mut c = shard(data_of, rank)?;
            c.step = 1;
            shards.push(remote.upload_shard(1, rank, 2, &c)?.shard);
        }
        Ok(remote.commit_global(1, &shards)?)
    };
    save(1)?;
    let first = remote.open_global(1)?.ok_or("step 1")?;
    save(2)?;
    let newest = remote.open_global(1)?.ok_or("step 1")?;
    assert_ne!(first.commit(), newest.commit());
    let again = remote
        .open_global_commit(1, first.commit())?
        .ok_or("the first commit is still there")?;
    assert_eq!(again.commit(), first.commit());
    let params = |g: &ckptstore::GlobalStep| remote.read_pieces(g, &[(1, "params", 0, 64)]);
    assert_eq!(params(&again)?[0], bytes(101, 512 << 10)[..64]);
    assert_eq!(params(&newest)?[0], bytes(201, 512 << 10)[..64]);
    assert!(remote
        .open_global_commit(1, "00000000000000000001-nonsense")?
        .is_none());
    Ok(())
}
