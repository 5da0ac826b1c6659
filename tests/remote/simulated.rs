//! Ranks on a simulated S3 (issue 75; `sim_s3`): `object_store`'s S3 client
//! and every line of `Remote` as against S3, each rank its own `Remote`
//! and count, the bucket answering 5 ms late with S3's per-prefix rates.
//! `cargo bench -p ckptstore-bench --bench sim` runs the same at 10,000
//! ranks, 30 ms a request.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ckptstore::{Piece, SaveId, ShardHash, ShardSource, ShardUpload, ShardWrite};

use super::sim_ranks::{at_once, rank_remote, shard, spread, Result};
use super::sim_s3::{Limits, SimS3};

fn limits() -> Limits {
    Limits {
        latency: Duration::from_millis(5),
        ..Limits::default()
    }
}

/// A push's lock listing stops at the collections' locks on a bucket
/// that lists in key order: one request however many pushes hold locks
/// (here 2,500, three pages), and a collection's lock is still seen.
#[test]
fn a_push_lists_only_the_collections_locks() -> Result {
    let sim = SimS3::new("sim", limits());
    for i in 0..2_500 {
        sim.insert(&format!("run/locks/push-{i:032x}"), b"{}");
    }
    let (remote, count) = rank_remote(&sim)?;
    remote.upload_shard(1, 0, 1, &shard(1, 0))?;
    let upload = count.load(Ordering::SeqCst);
    // The lock written, listed, the collection mark read and written (a
    // new bucket), the pack, the shard, the lock deleted.
    assert!(upload <= 7, "{upload} requests");

    sim.insert("run/locks/gc-0", b"{}");
    let remote = remote.with_grace_period(Duration::from_millis(800));
    let busy = remote.upload_shard(2, 0, 1, &shard(2, 0));
    let busy = busy.err().ok_or("a push beside a live collection's lock")?;
    assert!(
        matches!(busy.bucket(), Some(ckptstore::BucketError::Busy { .. })),
        "{busy}"
    );
    Ok(())
}

/// 1,000 ranks of a rank-local save land at once: each uploads its shard
/// and announces it (an atomic count and the names beside it, as the
/// job's rendezvous store holds them); the rank whose announcement
/// completes the save commits in its upload's lock cycle. Each rank makes
/// at most 7 requests (6 where the bucket has its collection mark; 10 for
/// the completing one), none reads another's manifest, the step is whole,
/// and a striped restore (each rank reads its own shard) reads each
/// stored byte once.
#[test]
fn a_thousand_ranks_save_rank_locally_in_requests_constant_per_rank() -> Result {
    let world = std::env::var("SIM_RANKS").ok().and_then(|n| n.parse().ok());
    let world: u32 = world.unwrap_or(1_000);
    let sim = SimS3::new("sim", limits());
    let landed = AtomicUsize::new(0);
    let names: Mutex<Vec<Option<ShardHash>>> = Mutex::new(vec![None; world as usize]);
    let last_landed = Mutex::new(Instant::now());
    let costs = at_once(world, |rank, gate| {
        let (remote, count) = rank_remote(&sim)?;
        let state = shard(7, rank);
        let then = ShardUpload::RankLocalShard(SaveId::of("s"));
        gate.wait()?;
        let write = ShardWrite::new((7, rank, world), ShardSource::Owned(&state), then);
        let mut announce = |name: ShardHash| {
            let mut all = names.lock().ok()?;
            all[rank as usize] = Some(name);
            *last_landed.lock().ok()? = Instant::now();
            if landed.fetch_add(1, Ordering::SeqCst) + 1 != world as usize {
                return None;
            }
            all.iter().copied().collect()
        };
        let info = remote.write_shard_announced(write, &mut announce)?;
        Ok((count.load(Ordering::SeqCst), info.complete, Instant::now()))
    })?;
    let committed = costs.iter().filter(|c| c.1).map(|c| c.2).max();
    let listed = committed.ok_or("no rank committed")? - *last_landed.lock().map_err(|_| "lock")?;
    let requests: Vec<usize> = costs.iter().map(|c| c.0).collect();
    let completing: Vec<usize> = costs.iter().filter(|c| c.1).map(|c| c.0).collect();
    let (hot, prefix) = sim.hottest();
    eprintln!(
        "{world} ranks at once, rank-local: requests per rank median {} max {}, completing {completing:?}; \
         listed {listed:?} after the last shard landed; hottest prefix {prefix}: {hot} in a second; 503s retried {}",
        spread(&requests).0,
        requests.iter().max().unwrap_or(&0),
        sim.slowdowns()
    );
    assert_eq!(completing.len(), 1, "one commit");
    let others = costs.iter().filter(|c| !c.1).map(|c| c.0);
    assert!(others.clone().all(|n| n <= 7), "{requests:?}");
    // Its upload, then the step's commits listed, its manifest, the
    // latest-step hint and the commit, in the same lock cycle.
    assert!(completing[0] <= 11, "{completing:?}");

    // The step, as a new job reads it: each rank its own shard.
    let (reader, _) = rank_remote(&sim)?;
    assert_eq!(reader.steps()?, vec![7]);
    sim.reset();
    let started = Instant::now();
    let read = at_once(world, |rank, gate| {
        let (remote, count) = rank_remote(&sim)?;
        gate.wait()?;
        let global = remote.open_global(7)?.ok_or("no step 7")?;
        let piece: Piece<'_> = (rank, "w", 0, 4096);
        let got = remote.read_pieces(&global, &[piece])?;
        let want = shard(7, rank);
        assert!(
            got[0].as_slice() == want.entries["w"].bytes(),
            "rank {rank}"
        );
        Ok(count.load(Ordering::SeqCst))
    })?;
    let (stored, fetched) = (sim.bytes_under("run/packs/"), sim.bytes_read("run/packs"));
    eprintln!(
        "{world} ranks restore in {:?}: requests per rank median {} max {}; {fetched} bytes of \
         packs read of {stored}; {} bytes of manifests",
        started.elapsed(),
        spread(&read).0,
        read.iter().max().unwrap_or(&0),
        sim.bytes_read("run/manifests") + sim.bytes_read("run/shards"),
    );
    assert!(read.iter().all(|&n| n <= 5), "{read:?}");
    assert_eq!(fetched, stored, "each byte read once");
    Ok(())
}

/// A bucket that answers `503 SlowDown` past a prefix's rate (here 40
/// writes a second, so that 100 ranks landing at once exceed it): every
/// such answer is retried with backoff by the client, and the save
/// completes, whole.
#[test]
fn slow_down_answers_are_retried_and_the_save_completes() -> Result {
    const WORLD: u32 = 100;
    let sim = SimS3::new(
        "sim",
        Limits {
            writes_per_s: 40,
            ..limits()
        },
    );
    let landed = AtomicUsize::new(0);
    let names: Mutex<Vec<Option<ShardHash>>> = Mutex::new(vec![None; WORLD as usize]);
    let done = at_once(WORLD, |rank, gate| {
        let (remote, _) = rank_remote(&sim)?;
        let state = shard(3, rank);
        gate.wait()?;
        let then = ShardUpload::RankLocalShard(SaveId::of("s"));
        let write = ShardWrite::new((3, rank, WORLD), ShardSource::Owned(&state), then);
        let mut announce = |name: ShardHash| {
            let mut all = names.lock().ok()?;
            all[rank as usize] = Some(name);
            let count = landed.fetch_add(1, Ordering::SeqCst) + 1;
            (count == WORLD as usize).then(|| all.iter().copied().collect())?
        };
        Ok(remote.write_shard_announced(write, &mut announce)?.complete)
    })?;
    eprintln!("{} answers 503 SlowDown, each retried", sim.slowdowns());
    assert!(sim.slowdowns() > 0, "the rate was never exceeded");
    assert_eq!(done.iter().filter(|&&c| c).count(), 1);
    let (reader, _) = rank_remote(&sim)?;
    assert_eq!(reader.steps()?, vec![3]);
    for rank in [0, WORLD / 2, WORLD - 1] {
        assert_eq!(reader.get_shard(3, rank)?, Some(shard(3, rank)));
    }
    Ok(())
}

/// A save with collectives at 1,000 ranks landing at once: every rank
/// uploads its shard (a handful of requests each), then the coordinator
/// uploads its own and commits the names the ranks reported
/// (`ShardUpload::CommitReported`, as `ckptstore.dcp`'s coordinator): its
/// commit costs the same few requests at any world size, where reading
/// each rank's manifest (`commit_global`, printed beside) costs one per
/// rank.
#[test]
fn a_coordinators_commit_of_a_thousand_ranks_costs_a_handful_of_requests() -> Result {
    const WORLD: u32 = 1_000;
    let sim = SimS3::new("sim", limits());
    let costs = at_once(WORLD, |rank, gate| {
        let (remote, count) = rank_remote(&sim)?;
        let state = shard(9, rank);
        gate.wait()?;
        if rank == 0 {
            return Ok((count.load(Ordering::SeqCst), None));
        }
        let info = remote.upload_shard(9, rank, WORLD, &state)?;
        Ok((count.load(Ordering::SeqCst), Some(info.shard)))
    })?;
    let mut names: Vec<Option<ShardHash>> = costs.iter().map(|c| c.1).collect();
    let uploads: Vec<usize> = costs[1..].iter().map(|c| c.0).collect();
    let (coordinator, count) = rank_remote(&sim)?;
    let own = shard(9, 0);
    let started = Instant::now();
    let then = ShardUpload::CommitReported(names.clone());
    let write = ShardWrite::new((9, 0, WORLD), ShardSource::Owned(&own), then);
    names[0] = Some(coordinator.write_shard(write)?.shard);
    let (commit, listed) = (count.load(Ordering::SeqCst), started.elapsed());
    // The checked commit of the same names, for comparison.
    let all: Vec<ShardHash> = names.iter().flatten().copied().collect();
    count.store(0, Ordering::SeqCst);
    let checked_at = Instant::now();
    coordinator.commit_global(9, &all)?;
    let checked = (count.load(Ordering::SeqCst), checked_at.elapsed());
    eprintln!(
        "{WORLD} ranks with a coordinator: uploads median {} max {}; the coordinator's shard and \
         commit of reported names {commit} ({listed:?}); commit_global {} requests ({:?})",
        spread(&uploads).0,
        uploads.iter().max().unwrap_or(&0),
        checked.0,
        checked.1
    );
    assert!(uploads.iter().all(|&n| n <= 7), "{uploads:?}");
    // Its upload, then the step's commits listed, its manifest, the hint
    // and the commit.
    let most = uploads.iter().max().copied().unwrap_or(0);
    assert!(
        commit <= most + 4,
        "{commit} requests, {most} for a rank's upload"
    );
    assert!(
        checked.0 >= WORLD as usize,
        "the checked commit reads each manifest"
    );
    let (reader, _) = rank_remote(&sim)?;
    assert_eq!(reader.steps()?, vec![9]);
    let global = reader.open_global(9)?.ok_or("no step 9")?;
    let piece: Piece<'_> = (WORLD - 1, "w", 0, 4096);
    let got = reader.read_pieces(&global, &[piece])?;
    assert!(got[0].as_slice() == shard(9, WORLD - 1).entries["w"].bytes());
    Ok(())
}
