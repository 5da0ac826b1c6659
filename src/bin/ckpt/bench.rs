//! `ckpt bench`: the write-throughput comparison, shared with
//! `benches/compare.rs` (`SQLite` is in the benches only).

use std::path::Path;
use std::time::Duration;

#[allow(unreachable_pub)]
#[path = "../../../bench/benches/common/mod.rs"]
mod common;

use common::{checkpoint, time_commits, Contender, RawFsync, SeedJson, Store, Workload};
use indicatif::ProgressBar;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

pub fn run(sizes: &[String], dir: Option<&Path>) -> Result {
    let base = match dir {
        Some(d) => d.to_owned(),
        None => std::env::temp_dir(),
    };
    println!("| workload | contender | median commit | MB/s | vs raw | ckptstore speed-up |");
    println!("|---|---|---:|---:|---:|---:|");
    for size in sizes {
        let (w, iters) = match size.as_str() {
            "small" => (common::SMALL, 20),
            "medium" => (common::MEDIUM, 8),
            "large" => (common::LARGE, 3),
            other => return Err(format!("unknown size {other:?}: small, medium or large").into()),
        };
        run_one(&w, iters, &base)?;
    }
    Ok(())
}

fn run_one(w: &Workload, iters: usize, base: &Path) -> Result {
    let dir = base.join(format!("ckpt-bench-{}-{}", w.name, std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = measure(w, iters, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    let rows = result?;
    let raw = rows
        .iter()
        .find(|(n, _)| *n == "raw write + fsync")
        .map(|(_, d)| d.as_secs_f64())
        .ok_or("no raw row")?;
    let store = rows
        .iter()
        .find(|(n, _)| *n == "ckptstore commit")
        .map(|(_, d)| d.as_secs_f64())
        .ok_or("no store row")?;
    let mb = w.logical_bytes() as f64 / 1e6;
    for (name, d) in &rows {
        let s = d.as_secs_f64();
        println!(
            "| {} | {name} | {:.2} ms | {:.0} | {:.2}x | {:.1}x |",
            w.name,
            s * 1e3,
            mb / s,
            raw / s,
            s / store
        );
    }
    Ok(())
}

fn measure(w: &Workload, iters: usize, dir: &Path) -> Result<Vec<(&'static str, Duration)>> {
    let mut ckpt = checkpoint(w);
    let mut rows = Vec::new();
    let seed_iters = if w.logical_bytes() > (64 << 20) {
        1
    } else {
        iters
    };
    let contenders: Vec<(Box<dyn Contender>, usize)> = vec![
        (Box::new(Store::new(dir.join("bench.ckpt"))?), iters),
        (Box::new(RawFsync::new(mkdir(dir, "raw")?)), iters),
        (
            Box::new(SeedJson::new(mkdir(dir, "seed_fsync")?, true)),
            seed_iters,
        ),
        (
            Box::new(SeedJson::new(mkdir(dir, "seed")?, false)),
            seed_iters,
        ),
    ];
    let bar = ProgressBar::new(contenders.iter().map(|(_, n)| *n as u64).sum());
    bar.set_message(w.name);
    for (mut c, n) in contenders {
        let mut times = time_commits(c.as_mut(), &mut ckpt, n, || bar.inc(1))?;
        times.sort_unstable();
        rows.push((c.name(), times[times.len() / 2]));
    }
    bar.finish_and_clear();
    Ok(rows)
}

fn mkdir(dir: &Path, name: &str) -> Result<std::path::PathBuf> {
    let d = dir.join(name);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
