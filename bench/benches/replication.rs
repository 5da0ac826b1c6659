//! What a replicated step costs as the bucket grows: a store with
//! `replicate_to` a directory bucket that already holds N other chunk
//! objects (N = 0, 100,000, 1,000,000; `CKPT_BENCH_CHUNKS` to choose),
//! five saves of 4 MiB, each flushed (committed and in the bucket); the
//! median seconds per replicated step. Against it, in the same run, the
//! same push made by listing the bucket (`Remote::repair`), as every push
//! did before the store remembered what the bucket holds.
//!
//! `cargo bench -p ckptstore-bench --bench replication`
//! (`CKPT_BENCH_DIR` for where the buckets go; the 1,000,000-chunk bucket
//! takes about 4 GiB of inodes and blocks and a few minutes to make).

use std::time::{Duration, Instant};

use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Remote, StoreOptions};

mod common;

use common::{noise, Result};

const SAVES: u64 = 5;

fn step(n: u64) -> GradientCheckpoint {
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), n);
    c.set_optimizer_state("state", noise(n + 1, 4 << 20));
    c
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// A directory bucket with `n` chunk objects no step names.
fn bucket_with(dir: &std::path::Path, n: usize) -> Result<String> {
    let chunks = dir.join("bucket/chunks");
    std::fs::create_dir_all(&chunks)?;
    for i in 0..n {
        let name = format!("{:064x}", u128::try_from(i)? * 0x9E37_79B9_7F4A_7C15);
        std::fs::write(chunks.join(name), b"x")?;
    }
    Ok(format!("file://{}", dir.join("bucket").display()))
}

/// Median seconds per step of `SAVES` replicated saves, then of
/// `SAVES` pushes by listing (each after one more commit).
fn run(n: usize) -> Result<(Duration, Duration)> {
    let base = std::env::var_os("CKPT_BENCH_DIR").map_or_else(std::env::temp_dir, Into::into);
    let dir = tempfile::tempdir_in(base)?;
    let made = Instant::now();
    let url = bucket_with(dir.path(), n)?;
    eprintln!(
        "{n} chunks: bucket made in {:.1} s",
        made.elapsed().as_secs_f64()
    );
    let path = dir.path().join("run.ckpt");
    let store = StoreOptions::new()
        .replicate_to(Remote::open(&url)?)
        .open(&path)?;
    // The first commit's push lists the bucket once: the store then
    // remembers it.
    store.commit(&step(0))?;
    store.flush()?;
    let mut remembered = Vec::new();
    for n in 1..=SAVES {
        let t = Instant::now();
        store.commit(&step(n))?;
        store.flush()?;
        remembered.push(t.elapsed());
    }
    drop(store);
    let store = CheckpointStore::open(&path)?;
    let remote = Remote::open(&url)?;
    let mut listed = Vec::new();
    for n in SAVES + 1..=2 * SAVES {
        let t = Instant::now();
        store.commit(&step(n))?;
        remote.repair(&store)?;
        listed.push(t.elapsed());
    }
    Ok((median(remembered), median(listed)))
}

fn main() -> Result {
    let sizes: Vec<usize> = std::env::var("CKPT_BENCH_CHUNKS")
        .unwrap_or_else(|_| "0,100000,1000000".into())
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<std::result::Result<_, _>>()?;
    println!("| other chunks in the bucket | seconds per replicated step (remembered) | listing the bucket instead | ratio |");
    println!("|---:|---:|---:|---:|");
    for n in sizes {
        let (remembered, listed) = run(n)?;
        println!(
            "| {n} | {:.3} | {:.3} | {:.1}x |",
            remembered.as_secs_f64(),
            listed.as_secs_f64(),
            listed.as_secs_f64() / remembered.as_secs_f64()
        );
    }
    Ok(())
}
