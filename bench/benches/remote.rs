//! Object storage: `push` and `pull` of a 256 MiB step against `aws s3 cp`
//! of the same bytes to and from the same server, and the bytes a push of
//! a step with 90% of its bytes unchanged uploads.
//!
//! Needs an S3 server and the AWS CLI: `scripts/garage.sh start`, then
//! `source target/garage/env && cargo bench -p ckptstore-bench --bench remote`.
//! `CKPT_BENCH_MIB` (default 256) and `CKPT_BENCH_REPS` (default 5) change
//! the size and the rounds; each round runs every contender once, and the
//! table gives medians.

use std::process::Command;
use std::time::{Duration, Instant};

use ckptstore::{
    CheckpointStore, ComputationGraphStore, Dtype, GradientCheckpoint, Remote, Tensor,
};

mod common;

use common::{noise, Result};

/// Tensors the step is made of.
const TENSORS: usize = 10;

fn step(n: u64, tensors: &[Vec<u8>]) -> Result<GradientCheckpoint> {
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), n);
    for (i, t) in tensors.iter().enumerate() {
        let elems = (t.len() / 4) as u64;
        c.set_tensor(
            format!("layer{i}"),
            Tensor::new(Dtype::F32, vec![elems], t.clone())?,
        );
    }
    Ok(c)
}

fn aws(endpoint: &str, args: &[&str]) -> Result<Duration> {
    let started = Instant::now();
    let out = Command::new("aws")
        .args(args)
        .args(["--endpoint-url", endpoint, "--only-show-errors"])
        .output()?;
    if !out.status.success() {
        return Err(format!("aws {args:?}: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(started.elapsed())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn mib_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / d.as_secs_f64()
}

fn main() -> Result {
    let Ok(bucket) = std::env::var("CKPT_TEST_BUCKET") else {
        eprintln!(
            "remote bench: needs an S3 server: scripts/garage.sh start && source target/garage/env"
        );
        return Ok(());
    };
    let endpoint = std::env::var("AWS_ENDPOINT_URL")?;
    let mib: usize = std::env::var("CKPT_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let reps: usize = std::env::var("CKPT_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let dir = tempfile::tempdir()?;
    let run = format!("bench-{}", uuid::Uuid::new_v4().simple());

    let each = (mib << 20) / TENSORS / 4 * 4;
    let tensors: Vec<Vec<u8>> = (0..TENSORS as u64).map(|i| noise(i + 1, each)).collect();
    let total = (each * TENSORS) as u64;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    store.commit(&step(1, &tensors)?)?;
    // The same bytes as one file, for the AWS CLI.
    let file = dir.path().join("step.bin");
    std::fs::write(&file, tensors.concat())?;
    let file_s = file.to_str().ok_or("path")?;

    let (mut push, mut cp_up, mut get, mut pull, mut cp_down) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut cp_down_sync = Vec::new();
    for r in 0..reps {
        let url = format!("s3://{bucket}/{run}/ckpt-{r}");
        let remote = Remote::open(&url)?;
        let started = Instant::now();
        let report = remote.push(&store)?;
        push.push(started.elapsed());
        assert_eq!(report.bytes_uploaded, total);

        let object = format!("s3://{bucket}/{run}/aws-{r}/step.bin");
        cp_up.push(aws(&endpoint, &["s3", "cp", file_s, &object])?);

        let started = Instant::now();
        let got = remote.get(1)?.ok_or("step 1 is in the bucket")?;
        get.push(started.elapsed());
        drop(got);
        let target = CheckpointStore::open(dir.path().join(format!("pulled-{r}.ckpt")))?;
        let started = Instant::now();
        remote.pull(1, &target)?;
        pull.push(started.elapsed());
        drop(target);

        let down = dir.path().join(format!("down-{r}.bin"));
        let fetched = aws(
            &endpoint,
            &["s3", "cp", &object, down.to_str().ok_or("path")?],
        )?;
        cp_down.push(fetched);
        // The same download made durable, as a pull is.
        let started = Instant::now();
        std::fs::File::open(&down)?.sync_all()?;
        cp_down_sync.push(fetched + started.elapsed());
        std::fs::remove_file(down)?;
        eprintln!("round {} of {reps} done", r + 1);
    }

    // 90% unchanged, as training leaves it: one tensor of ten changed (the
    // others frozen). Then a harder case: 1 MiB rewritten in every 10 MiB
    // of every tensor (the rewrites straddle chunk boundaries).
    let mut one_changed = tensors.clone();
    one_changed[0] = noise(99, each);
    let remote = Remote::open(&format!("s3://{bucket}/{run}/ckpt-0"))?;
    store.commit(&step(2, &one_changed)?)?;
    let started = Instant::now();
    let frozen = remote.push(&store)?;
    let frozen_time = started.elapsed();
    let mut scattered = tensors.clone();
    for (i, t) in scattered.iter_mut().enumerate() {
        let mut at = 0;
        while at < t.len() {
            let end = (at + (1 << 20)).min(t.len());
            t[at..end].copy_from_slice(&noise(100 + i as u64 + at as u64, end - at));
            at += 10 << 20;
        }
    }
    let scattered_bytes: usize = scattered
        .iter()
        .zip(&tensors)
        .map(|(a, b)| {
            let pairs = a.chunks(1 << 20).zip(b.chunks(1 << 20));
            pairs
                .filter(|(x, y)| x != y)
                .map(|(x, _)| x.len())
                .sum::<usize>()
        })
        .sum();
    store.commit(&step(3, &scattered)?)?;
    let started = Instant::now();
    let spread = remote.push(&store)?;
    let spread_time = started.elapsed();

    let (push, cp_up, get, pull, cp_down) = (
        median(push),
        median(cp_up),
        median(get),
        median(pull),
        median(cp_down),
    );
    println!("\n### object storage: one {mib} MiB step ({TENSORS} tensors), Garage on 127.0.0.1, medians of {reps}\n");
    println!("| operation | ckptstore | aws s3 cp | ratio (aws time / ckptstore time) |");
    println!("|---|---|---|---|");
    println!(
        "| upload | push {:.2} s ({:.0} MiB/s) | {:.2} s ({:.0} MiB/s) | **{:.2}x** |",
        push.as_secs_f64(),
        mib_s(total, push),
        cp_up.as_secs_f64(),
        mib_s(total, cp_up),
        cp_up.as_secs_f64() / push.as_secs_f64()
    );
    println!(
        "| download into memory | get {:.2} s ({:.0} MiB/s) | | |",
        get.as_secs_f64(),
        mib_s(total, get)
    );
    println!(
        "| download to disk | pull into a store, fsynced: {:.2} s ({:.0} MiB/s) | to a file, not fsynced: {:.2} s ({:.0} MiB/s) | **{:.2}x** |",
        pull.as_secs_f64(), mib_s(total, pull), cp_down.as_secs_f64(), mib_s(total, cp_down),
        cp_down.as_secs_f64() / pull.as_secs_f64()
    );
    let cp_down_sync = median(cp_down_sync);
    println!(
        "| download to disk, durable | pull (as above) | to a file, then fsync: {:.2} s ({:.0} MiB/s) | **{:.2}x** |",
        cp_down_sync.as_secs_f64(),
        mib_s(total, cp_down_sync),
        cp_down_sync.as_secs_f64() / pull.as_secs_f64()
    );
    println!(
        "| push of the next step, one tensor of ten changed | {:.1}% of its bytes uploaded, {:.2} s | | |",
        100.0 * frozen.bytes_uploaded as f64 / total as f64,
        frozen_time.as_secs_f64()
    );
    println!(
        "| push of the next step, 1 MiB changed in every 10 MiB ({:.1}% of its bytes) | {:.1}% uploaded, {:.2} s | | |",
        100.0 * scattered_bytes as f64 / total as f64,
        100.0 * spread.bytes_uploaded as f64 / total as f64,
        spread_time.as_secs_f64()
    );
    ranks(&bucket, &run, &endpoint, dir.path(), reps)?;
    cleanup(&bucket, &run, &endpoint)
}

/// Four ranks pushing 64 MiB shards of one step in parallel, against four
/// `aws s3 cp` of the same bytes in parallel.
fn ranks(bucket: &str, run: &str, endpoint: &str, dir: &std::path::Path, reps: usize) -> Result {
    const WORLD: u32 = 4;
    const SHARD: usize = 64 << 20;
    let shards: Vec<Vec<u8>> = (0..u64::from(WORLD))
        .map(|r| noise(1000 + r, SHARD))
        .collect();
    let files: Vec<String> = shards
        .iter()
        .enumerate()
        .map(|(r, bytes)| {
            let path = dir.join(format!("shard-{r}.bin"));
            std::fs::write(&path, bytes)?;
            Ok(path.to_str().ok_or("path")?.to_owned())
        })
        .collect::<Result<_>>()?;
    let (mut ours, mut theirs, mut visible) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..reps {
        let url = format!("s3://{bucket}/{run}/ranks-{r}");
        let started = Instant::now();
        let infos = std::thread::scope(|s| {
            let handles: Vec<_> = (0..WORLD)
                .map(|rank| {
                    let (url, data) = (&url, &shards[rank as usize]);
                    s.spawn(
                        move || -> std::result::Result<ckptstore::ShardInfo, String> {
                            let remote = Remote::open(url).map_err(|e| e.to_string())?;
                            let mut c = ckptstore::Step::new(1);
                            c.insert("shard", ckptstore::Entry::Blob(data.clone()));
                            remote
                                .commit_shard(1, rank, WORLD, &c)
                                .map_err(|e| e.to_string())
                        },
                    )
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| "rank panicked".to_owned())?)
                .collect::<std::result::Result<Vec<_>, String>>()
        })?;
        ours.push(started.elapsed());
        let last = infos
            .iter()
            .filter(|i| i.complete)
            .map(|i| i.finalize)
            .min();
        visible.push(last.ok_or("no rank completed the step")?);
        assert_eq!(Remote::open(&url)?.latest_step()?, Some(1));

        let started = Instant::now();
        let children: Vec<_> = files
            .iter()
            .enumerate()
            .map(|(i, f)| {
                Command::new("aws")
                    .args([
                        "s3",
                        "cp",
                        f,
                        &format!("s3://{bucket}/{run}/aws-ranks-{r}/{i}.bin"),
                    ])
                    .args(["--endpoint-url", endpoint, "--only-show-errors"])
                    .spawn()
            })
            .collect::<std::io::Result<_>>()?;
        for mut c in children {
            if !c.wait()?.success() {
                return Err("aws s3 cp failed".into());
            }
        }
        theirs.push(started.elapsed());
    }
    let (ours, theirs, visible) = (median(ours), median(theirs), median(visible));
    let total = u64::from(WORLD) * SHARD as u64;
    println!("\n### four ranks, 64 MiB shards each, pushed in parallel, medians of {reps}\n");
    println!("| | ckptstore `commit_shard` x 4 | `aws s3 cp` x 4 | ratio (aws time / ours) |");
    println!("|---|---|---|---|");
    println!(
        "| all four shards in | {:.2} s ({:.0} MiB/s) | {:.2} s ({:.0} MiB/s) | **{:.2}x** |",
        ours.as_secs_f64(),
        mib_s(total, ours),
        theirs.as_secs_f64(),
        mib_s(total, theirs),
        theirs.as_secs_f64() / ours.as_secs_f64()
    );
    println!(
        "| last shard landed -> step visible (the finishing rank's finalize) | {:.0} ms | | |",
        visible.as_secs_f64() * 1000.0
    );
    Ok(())
}

/// Delete what the benchmark put in the bucket.
fn cleanup(bucket: &str, run: &str, endpoint: &str) -> Result {
    aws(
        endpoint,
        &["s3", "rm", "--recursive", &format!("s3://{bucket}/{run}/")],
    )?;
    Ok(())
}
