//! `cargo bench -p ckptstore-bench --bench sim [-- RANKS...]`
//!
//! One global step of 1,000 and 10,000 simulated ranks (default; or the
//! world sizes given) against a simulated S3 (`tests/remote/sim_s3.rs`:
//! `object_store`'s S3 client through an in-process connector, every
//! request answered 30 ms late, S3's per-prefix rates with `503 SlowDown`
//! past them, retried by the client). Each rank is a thread with its own
//! `Remote`, all released at once:
//!
//! - a rank-local save, completed through a rendezvous (an atomic count
//!   and the names beside it, as the job's store holds them): each rank
//!   uploads its shard and announces it under its lock; the rank whose
//!   announcement completes the save commits;
//! - a save with collectives: every rank uploads its shard, then the
//!   coordinator uploads its own and commits the names reported
//!   (`ShardUpload::CommitReported`); `commit_global` (each name checked)
//!   of the same names beside it;
//! - a restore: every rank opens the step and reads its own shard.
//!
//! Printed: requests per rank (median, max), the time from the last
//! shard's landing to the step's commit, the hottest prefix (requests in
//! any second), 503s retried, and a restore's bytes.

#[path = "../../tests/remote/sim_ranks.rs"]
mod sim_ranks;
#[path = "../../tests/remote/sim_s3.rs"]
#[allow(dead_code)]
mod sim_s3;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ckptstore::{SaveId, ShardHash, ShardSource, ShardUpload, ShardWrite};
use sim_ranks::{at_once, rank_remote, shard, spread, Result};
use sim_s3::{Limits, SimS3};

fn hot(sim: &SimS3) -> String {
    let (n, prefix) = sim.hottest();
    format!("{n} (`{prefix}/`)")
}

/// The rank-local save of step 7.
fn rank_local(sim: &Arc<SimS3>, world: u32) -> Result {
    let landed = AtomicUsize::new(0);
    let names: Mutex<Vec<Option<ShardHash>>> = Mutex::new(vec![None; world as usize]);
    let last = Mutex::new(Instant::now());
    let costs = at_once(world, |rank, gate| {
        let (remote, count) = rank_remote(sim)?;
        let state = shard(7, rank);
        gate.wait()?;
        let then = ShardUpload::RankLocalShard(SaveId::of("s"));
        let write = ShardWrite::new((7, rank, world), ShardSource::Owned(&state), then);
        let mut announce = |name: ShardHash| {
            let mut all = names.lock().ok()?;
            all[rank as usize] = Some(name);
            *last.lock().ok()? = Instant::now();
            let count = landed.fetch_add(1, Ordering::SeqCst) + 1;
            (count == world as usize).then(|| all.iter().copied().collect())?
        };
        let info = remote.write_shard_announced(write, &mut announce)?;
        Ok((count.load(Ordering::SeqCst), info.complete, Instant::now()))
    })?;
    let committed = costs.iter().filter(|c| c.1).map(|c| c.2).max();
    let last = *last.lock().map_err(|_| "lock")?;
    let listed = committed.ok_or("no rank committed")?.duration_since(last);
    let all: Vec<usize> = costs.iter().map(|c| c.0).collect();
    let completing: Vec<usize> = costs.iter().filter(|c| c.1).map(|c| c.0).collect();
    let (median, most) = spread(&all);
    println!(
        "| {world} | rank-local | {median} | {most} | {completing:?} | {:.3} | {} | {} |",
        listed.as_secs_f64(),
        hot(sim),
        sim.slowdowns()
    );
    Ok(())
}

/// The save of step 9 with a coordinator.
fn collective(sim: &Arc<SimS3>, world: u32) -> Result {
    let costs = at_once(world, |rank, gate| {
        let (remote, count) = rank_remote(sim)?;
        let state = shard(9, rank);
        gate.wait()?;
        if rank == 0 {
            return Ok((0, None, Instant::now()));
        }
        let info = remote.upload_shard(9, rank, world, &state)?;
        Ok((
            count.load(Ordering::SeqCst),
            Some(info.shard),
            Instant::now(),
        ))
    })?;
    let last = costs.iter().map(|c| c.2).max().ok_or("no rank")?;
    let uploads: Vec<usize> = costs[1..].iter().map(|c| c.0).collect();
    let mut names: Vec<Option<ShardHash>> = costs.iter().map(|c| c.1).collect();
    let (coordinator, count) = rank_remote(sim)?;
    let own = shard(9, 0);
    let then = ShardUpload::CommitReported(names.clone());
    let write = ShardWrite::new((9, 0, world), ShardSource::Owned(&own), then);
    names[0] = Some(coordinator.write_shard(write)?.shard);
    let listed = last.elapsed();
    let commit = count.load(Ordering::SeqCst);
    let (median, most) = spread(&uploads);
    println!(
        "| {world} | collective, names reported | {median} | {most} | [{commit}] | {:.3} | {} | {} |",
        listed.as_secs_f64(),
        hot(sim),
        sim.slowdowns()
    );
    let all: Vec<ShardHash> = names.iter().flatten().copied().collect();
    sim.reset();
    count.store(0, Ordering::SeqCst);
    let started = Instant::now();
    coordinator.commit_global(9, &all)?;
    println!(
        "| {world} | `commit_global` of the same names (each checked) | | | [{}] | {:.3} | {} | {} |",
        count.load(Ordering::SeqCst),
        started.elapsed().as_secs_f64(),
        hot(sim),
        sim.slowdowns()
    );
    Ok(())
}

/// Every rank's restore of its own shard of step 7.
fn restore(sim: &Arc<SimS3>, world: u32) -> Result {
    sim.reset();
    let started = Instant::now();
    let read = at_once(world, |rank, gate| {
        let (remote, count) = rank_remote(sim)?;
        gate.wait()?;
        let global = remote.open_global(7)?.ok_or("no step 7")?;
        let got = remote.read_pieces(&global, &[(rank, "w", 0, 4096)])?;
        if got[0].as_slice() != shard(7, rank).entries["w"].bytes() {
            return Err(format!("rank {rank} read other bytes").into());
        }
        Ok(count.load(Ordering::SeqCst))
    })?;
    let (median, most) = spread(&read);
    let manifests = sim.bytes_read("run/manifests") + sim.bytes_read("run/shards");
    println!(
        "| {world} | restore (each rank its shard) | {median} | {most} | | {:.3} | {} | {} |",
        started.elapsed().as_secs_f64(),
        hot(sim),
        sim.slowdowns()
    );
    println!(
        "restore of {world} ranks: {} bytes of packs read of {} stored; {manifests} bytes of manifests ({} per rank)",
        sim.bytes_read("run/packs"),
        sim.bytes_under("run/packs/"),
        manifests / world as usize
    );
    Ok(())
}

fn main() -> Result {
    let given: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let worlds = if given.is_empty() {
        vec![1_000, 10_000]
    } else {
        given
    };
    let limits = Limits {
        latency: Duration::from_millis(30),
        ..Limits::default()
    };
    println!(
        "a simulated S3: every request {} ms late, {} writes and {} reads a second per prefix",
        limits.latency.as_millis(),
        limits.writes_per_s,
        limits.reads_per_s
    );
    println!("| ranks | save | requests per rank, median | max | the committing rank's | step listed after the last shard landed (s; restore: whole) | hottest prefix, requests in a second | 503s retried |");
    println!("|---|---|---|---|---|---|---|---|");
    for world in worlds {
        let sim = SimS3::new("sim", limits);
        rank_local(&sim, world)?;
        sim.reset();
        collective(&sim, world)?;
        restore(&sim, world)?;
    }
    Ok(())
}
