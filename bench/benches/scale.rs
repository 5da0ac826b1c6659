//! `source target/garage/env && cargo bench -p ckptstore-bench --bench scale`
//!
//! One global step of 8, 256 and 1,000 simulated ranks against the S3
//! server of `AWS_ENDPOINT_URL` (Garage from `scripts/garage.sh`), bucket
//! `$CKPT_TEST_BUCKET`: each rank a `Remote` of its own (as a process
//! would be), 32 at a time. For each world size it prints, per rank, the
//! median seconds and the requests (counted from Garage's log, which names
//! every request it serves) of: the upload of a 256 KiB shard, opening the
//! step, and one read of 4 KiB of the rank's own shard; and the seconds and
//! requests of the coordinator's commit.

use std::io::{Read, Seek, SeekFrom};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ckptstore::{Dtype, Entry, Remote, Step, Tensor};

type Result<T = (), E = Box<dyn std::error::Error + Send + Sync>> = std::result::Result<T, E>;

const SHARD_BYTES: usize = 256 << 10;
const THREADS: u32 = 32;

fn shard(rank: u32) -> Result<Step> {
    let mut c = Step::new(1);
    c.timestamp = 1_800_000_000;
    let data: Vec<u8> = (0..SHARD_BYTES)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).wrapping_add(rank) as u8)
        .collect();
    let w = Tensor::new(Dtype::U8, vec![SHARD_BYTES as u64], data)?;
    c.insert("w", Entry::Tensor(w));
    Ok(c)
}

/// Run `f` for every rank of `n`, `THREADS` at a time; the results by rank.
fn on_ranks<T: Send>(n: u32, f: impl Fn(u32) -> Result<T> + Sync) -> Result<Vec<T>> {
    let results: Mutex<Vec<(u32, T)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS.min(n))
            .map(|t| {
                let (f, results) = (&f, &results);
                s.spawn(move || -> Result {
                    for rank in (t..n).step_by(THREADS as usize) {
                        let got = f(rank)?;
                        results.lock().map_err(|_| "poisoned")?.push((rank, got));
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "a rank panicked")??;
        }
        Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
    })?;
    let mut results = results.into_inner().map_err(|_| "poisoned")?;
    results.sort_by_key(|(r, _)| *r);
    Ok(results.into_iter().map(|(_, t)| t).collect())
}

/// Requests in the log after byte `since` naming `prefix`.
fn requests(log: &str, since: u64, prefix: &str) -> Result<usize> {
    // Garage writes its log line after it answers.
    std::thread::sleep(Duration::from_millis(500));
    let mut f = std::fs::File::open(log)?;
    f.seek(SeekFrom::Start(since))?;
    let mut text = String::new();
    f.read_to_string(&mut text)?;
    Ok(text
        .lines()
        .filter(|l| l.contains(prefix) && l.contains(") "))
        .count())
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64()
}

fn main() -> Result {
    let bucket = std::env::var("CKPT_TEST_BUCKET").map_err(|_| "source target/garage/env first")?;
    let config = std::env::var("CKPT_GARAGE_CONFIG")?;
    let log = std::path::Path::new(&config)
        .with_file_name("server.log")
        .to_string_lossy()
        .into_owned();
    let size = || std::fs::metadata(&log).map(|m| m.len());
    let run = uuid::Uuid::new_v4().simple().to_string();
    println!(
        "one global step of N simulated ranks ({} KiB shards, {THREADS} at a time) against {}",
        SHARD_BYTES >> 10,
        std::env::var("AWS_ENDPOINT_URL")?
    );
    println!(
        "{:>6} | {:>9} {:>7} | {:>9} {:>7} | {:>9} {:>7} | {:>9} {:>7}",
        "ranks", "upload s", "req", "commit s", "req", "open s", "req", "read s", "req"
    );
    println!(
        "{:>6} | {:>17} | {:>17} | {:>17} | {:>17}",
        "", "per rank", "coordinator", "per rank", "per rank"
    );
    for n in [8u32, 256, 1000] {
        let prefix = format!("scale-{run}-{n}");
        let url = format!("s3://{bucket}/{prefix}");
        let n_us = n as usize;

        let since = size()?;
        let uploads = on_ranks(n, |rank| {
            let remote = Remote::open(&url)?;
            let c = shard(rank)?;
            let t = Instant::now();
            let info = remote.upload_shard(1, rank, n, &c)?;
            Ok((t.elapsed(), info.shard))
        })?;
        let up_req = requests(&log, since, &prefix)?;
        let (up_times, names): (Vec<Duration>, Vec<ckptstore::ShardHash>) =
            uploads.into_iter().unzip();

        let since = size()?;
        let coordinator = Remote::open(&url)?;
        let t = Instant::now();
        coordinator.commit_global(1, &names)?;
        let commit_s = t.elapsed().as_secs_f64();
        let commit_req = requests(&log, since, &prefix)?;

        let since = size()?;
        let opens = on_ranks(n, |_| {
            let remote = Remote::open(&url)?;
            let t = Instant::now();
            remote.open_global(1)?.ok_or("the step is complete")?;
            Ok(t.elapsed())
        })?;
        let open_req = requests(&log, since, &prefix)?;

        let since = size()?;
        let reads = on_ranks(n, |rank| {
            let remote = Remote::open(&url)?;
            let global = remote.open_global(1)?.ok_or("the step is complete")?;
            let t = Instant::now();
            let got = remote.read_pieces(&global, &[(rank, "w", 0, 4096)])?;
            let took = t.elapsed();
            if got[0][..] != shard(rank)?.entries["w"].bytes()[..4096] {
                return Err("a read differs".into());
            }
            Ok(took)
        })?;
        let read_req = requests(&log, since, &prefix)?.saturating_sub(open_req);

        println!(
            "{n:>6} | {:>9.4} {:>7.1} | {commit_s:>9.3} {commit_req:>7} | {:>9.4} {:>7.1} | {:>9.4} {:>7.1}",
            median(up_times),
            up_req as f64 / n_us as f64,
            median(opens),
            open_req as f64 / n_us as f64,
            median(reads),
            read_req as f64 / n_us as f64,
        );
    }
    Ok(())
}
