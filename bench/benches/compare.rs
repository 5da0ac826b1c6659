//! Write-throughput comparison, in one run: the seed's JSON files (with and
//! without fsync), raw write + fsync, SQLite, and ckptstore. Prints a
//! markdown table with medians and ratios.
//!
//! ```text
//! cargo bench -p ckptstore-bench --bench compare   # every section
//! CKPT_BENCH=small,recovery cargo bench -p ckptstore-bench --bench compare
//! ```

mod common;
#[path = "common/exchange.rs"]
mod exchange;
#[path = "common/recovery.rs"]
mod recovery;
#[path = "common/sqlite.rs"]
mod sqlite;

use std::time::{Duration, Instant};

use common::*;
use sqlite::Sqlite;

fn main() -> Result {
    if let Ok(spec) = std::env::var(CHILD_VAR) {
        return peak_child(&spec);
    }
    if let Ok(spec) = std::env::var(exchange::CHILD_VAR) {
        return exchange::child(&spec);
    }
    if let Ok(spec) = std::env::var(recovery::CHILD_VAR) {
        return recovery::child(&spec);
    }
    let which = std::env::var("CKPT_BENCH").unwrap_or_else(|_| {
        "small,medium,large,paired,incremental,async,scale,tensors,recovery".into()
    });
    let which: Vec<&str> = which.split(',').map(str::trim).collect();
    println!("# ckptstore write-throughput comparison\n");
    println!("machine: {} cores, {}", cores(), cpu_model());
    println!("every commit durable except \"seed JSON (no fsync)\"; medians of N commits; reads warm (page cache)\n");
    for (w, iters) in [(SMALL, 30), (MEDIUM, 10), (LARGE, 7)] {
        if which.contains(&w.name) {
            run_workload(&w, iters)?;
        }
    }
    if which.contains(&"paired") {
        run_paired()?;
    }
    if which.contains(&"incremental") {
        run_incremental()?;
    }
    if which.contains(&"async") {
        run_async()?;
    }
    if which.contains(&"scale") {
        run_scale()?;
    }
    if which.contains(&"tensors") {
        let dir = tempfile::tempdir_in(bench_dir())?;
        exchange::run(dir.path())?;
    }
    if which.contains(&"recovery") {
        let dir = tempfile::tempdir_in(bench_dir())?;
        recovery::run_commit_cost(dir.path())?;
        recovery::run(dir.path())?;
    }
    Ok(())
}

struct Row {
    name: &'static str,
    commit: Duration,
    read: Duration,
    disk_per_step: f64,
    extra_peak: Option<u64>,
    /// ckptstore's file length (redb extends it ahead of use; sparse).
    file_len: Option<u64>,
    /// Bytes read and written by the process per commit (Linux).
    io: Option<(u64, u64)>,
    n: usize,
}

fn contender(kind: usize, dir: &std::path::Path) -> Result<Box<dyn Contender>> {
    Ok(match kind {
        0 => Box::new(SeedJson::new(dir.to_owned(), false)),
        1 => Box::new(SeedJson::new(dir.to_owned(), true)),
        2 => Box::new(RawFsync::new(dir.to_owned())),
        3 => Box::new(Sqlite::new(dir.join("bench.sqlite"))?),
        _ => Box::new(Store::new(dir.join("bench.ckpt"))?),
    })
}

const CHILD_VAR: &str = "CKPT_BENCH_PEAK_CHILD";

/// Run two commits of `kind` in a child process; its peak RSS above the
/// RSS it had with the checkpoint built.
fn peak_in_child(w: &Workload, kind: usize) -> Result<u64> {
    let out = std::process::Command::new(std::env::current_exe()?)
        .env(CHILD_VAR, format!("{}:{kind}", w.name))
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("PEAK ").and_then(|v| v.trim().parse().ok()))
        .ok_or_else(|| {
            format!(
                "peak child failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )
            .into()
        })
}

/// The child side of [`peak_in_child`].
fn peak_child(spec: &str) -> Result {
    let (name, kind) = spec.split_once(':').ok_or("bad child spec")?;
    let w = [SMALL, MEDIUM, LARGE]
        .into_iter()
        .find(|w| w.name == name)
        .ok_or("unknown workload")?;
    let dir = tempfile::tempdir_in(bench_dir())?;
    let mut c = contender(kind.parse()?, dir.path())?;
    let mut ckpt = checkpoint(&w);
    touch(&mut ckpt, 0);
    reset_peak_rss();
    let base = rss();
    time_commits(c.as_mut(), &mut ckpt, 2, || {})?;
    println!("PEAK {}", peak_rss().saturating_sub(base));
    Ok(())
}

fn run_workload(w: &Workload, iters: usize) -> Result {
    let mb = w.logical_bytes() as f64 / 1e6;
    println!(
        "## {}: {} graph nodes, {} blobs x {} = {:.1} MB per step\n",
        w.name,
        w.nodes,
        w.blobs,
        human(w.blob_len as u64),
        mb
    );
    let mut ckpt = checkpoint(w);
    let mut rows = Vec::new();
    for kind in 0..5 {
        let dir = tempfile::tempdir_in(bench_dir())?;
        let mut c = contender(kind, dir.path())?;
        // The seed's JSON of a large step is ~2 GB of text per commit.
        let slow = kind < 2 && w.logical_bytes() > (64 << 20);
        let n = if slow { 1 } else { iters };
        let io_before = proc_io();
        let mut times = time_commits(c.as_mut(), &mut ckpt, n, || {})?;
        let io = proc_io()
            .zip(io_before)
            .map(|((r1, w1), (r0, w0))| ((r1 - r0) / n as u64, (w1 - w0) / n as u64));
        // Peak memory in a fresh process: in this one, memory freed by
        // earlier contenders would hide new allocations.
        let extra_peak = if slow {
            None
        } else {
            Some(peak_in_child(w, kind)?)
        };
        let disk_per_step = c.disk_bytes()? as f64 / n as f64;
        let file_len = (kind == 4)
            .then(|| std::fs::metadata(dir.path().join("bench.ckpt")).map(|m| m.len()))
            .transpose()?;
        let mut reads = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            let got = c.read_latest()?;
            reads.push(t.elapsed());
            assert!(
                got >= w.logical_bytes(),
                "{} read back {got} bytes",
                c.name()
            );
        }
        rows.push(Row {
            name: c.name(),
            commit: median(&mut times),
            read: median(&mut reads),
            disk_per_step,
            extra_peak,
            file_len,
            io,
            n,
        });
        drop(c);
    }

    println!("| contender | n | median commit | MB/s | commits/s | disk/step, allocated (x logical) | extra peak RSS | read latest MB/s |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.0} | {:.1} | {} ({:.2}x) | {} | {:.0} |",
            r.name,
            r.n,
            fmt_dur(r.commit),
            mb / r.commit.as_secs_f64(),
            1.0 / r.commit.as_secs_f64(),
            human(r.disk_per_step as u64),
            r.disk_per_step / w.logical_bytes() as f64,
            r.extra_peak.map_or("-".to_owned(), human),
            mb / r.read.as_secs_f64(),
        );
    }
    let get = |name: &str| {
        rows.iter()
            .find(|r| r.name == name)
            .map(|r| r.commit.as_secs_f64())
    };
    let store = rows
        .iter()
        .find(|r| r.name == "ckptstore commit")
        .ok_or("no store row")?;
    let raw = rows
        .iter()
        .find(|r| r.name == "raw write + fsync")
        .ok_or("no raw row")?;
    let s = store.commit.as_secs_f64();
    println!();
    println!(
        "- ckptstore commit throughput / raw write+fsync: **{:.2}x** (commit time {:.2}x raw)",
        raw.commit.as_secs_f64() / s,
        s / raw.commit.as_secs_f64()
    );
    if let Some(seed) = get("seed JSON (no fsync)") {
        println!(
            "- ckptstore speed / seed JSON (no fsync): **{:.1}x**",
            seed / s
        );
    }
    if let Some(seed) = get("seed JSON + fsync") {
        println!(
            "- ckptstore speed / seed JSON + fsync: **{:.1}x**",
            seed / s
        );
    }
    if let Some(sql) = get("SQLite (WAL, FULL)") {
        println!("- ckptstore speed / SQLite: **{:.2}x**", sql / s);
    }
    println!(
        "- ckptstore latest() read / raw file read: **{:.2}x**",
        raw.read.as_secs_f64() / store.read.as_secs_f64()
    );
    println!(
        "- ckptstore bytes on disk (allocated blocks) / logical: **{:.2}x**; file length {:.2}x (redb extends the file ahead of use; the unwritten part is sparse)",
        store.disk_per_step / w.logical_bytes() as f64,
        store.file_len.unwrap_or(0) as f64 / store.n as f64 / w.logical_bytes() as f64,
    );
    if let Some((read, written)) = store.io {
        println!(
            "- ckptstore I/O per commit (`/proc/self/io`): wrote {} ({:.2}x logical), read {}",
            human(written),
            written as f64 / w.logical_bytes() as f64,
            human(read)
        );
    }
    println!(
        "- ckptstore extra peak memory {} for a {} checkpoint\n",
        store.extra_peak.map_or("-".to_owned(), human),
        human(w.logical_bytes())
    );
    Ok(())
}

/// ckptstore (chunks in redb, and with pack files) and raw write+fsync,
/// commit by commit in rotating order, so drift in the shared disk's
/// speed hits all alike: medians and the median of the per-round ratios.
fn run_paired() -> Result {
    use ckptstore::StoreOptions;
    println!("## paired: ckptstore with chunks in redb, with pack files (the default) and raw write+fsync, commit by commit in rotating order\n");
    println!("| workload | rounds | chunks in redb median | with pack files | raw median | ratio raw/chunks in redb | ratio raw/pack files |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (w, rounds) in [(SMALL, 41), (MEDIUM, 21), (LARGE, 11)] {
        let dir = tempfile::tempdir_in(bench_dir())?;
        let in_redb = StoreOptions::new().pack_files(false);
        let mut store = Store::with_options(dir.path().join("paired.ckpt"), in_redb)?;
        let options = StoreOptions::new().pack_files(true);
        let mut packed = Store::with_options(dir.path().join("packed.ckpt"), options)?;
        let raw_dir = dir.path().join("raw");
        std::fs::create_dir(&raw_dir)?;
        let mut raw = RawFsync::new(raw_dir);
        let mut ckpt = checkpoint(&w);
        let mut times: [Vec<Duration>; 3] = Default::default();
        let mut ratios: [Vec<f64>; 2] = Default::default();
        for i in 0..rounds {
            touch(&mut ckpt, i as u64);
            let mut round = [Duration::ZERO; 3];
            for k in 0..3 {
                let which = (i + k) % 3;
                let c: &mut dyn Contender = match which {
                    0 => &mut store,
                    1 => &mut packed,
                    _ => &mut raw,
                };
                let t = Instant::now();
                c.commit(&ckpt)?;
                round[which] = t.elapsed();
            }
            for (k, d) in round.iter().enumerate() {
                times[k].push(*d);
            }
            for k in 0..2 {
                ratios[k].push(round[2].as_secs_f64() / round[k].as_secs_f64());
            }
        }
        for r in &mut ratios {
            r.sort_by(f64::total_cmp);
        }
        let [st, pt, rt] = &mut times;
        println!(
            "| {} | {rounds} | {} | {} | {} | **{:.2}x** | **{:.2}x** |",
            w.name,
            fmt_dur(median(st)),
            fmt_dur(median(pt)),
            fmt_dur(median(rt)),
            ratios[0][ratios[0].len() / 2],
            ratios[1][ratios[1].len() / 2]
        );
    }
    println!();
    Ok(())
}

/// Incremental commits: 16 MiB in 20 blobs, 2 of which change per step.
fn run_incremental() -> Result {
    println!("## incremental: 16 MiB in 20 blobs, 10% of the bytes change per step\n");
    let dir = tempfile::tempdir_in(bench_dir())?;
    let mut store = Store::new(dir.path().join("inc.ckpt"))?;
    let mut raw = RawFsync::new(dir.path().to_owned());
    let mut ckpt = checkpoint(&MEDIUM);
    store.commit(&ckpt)?;
    let names: Vec<String> = ckpt.optimizer_state.keys().cloned().collect();
    let (mut inc, mut raws, mut written) = (Vec::new(), Vec::new(), Vec::new());
    for step in 1..=20u64 {
        ckpt.step = step;
        for k in 0..2 {
            let name = &names[(2 * step as usize + k) % names.len()];
            if let Some(blob) = ckpt.optimizer_state.get_mut(name) {
                for page in blob.chunks_mut(4096) {
                    page[..8].copy_from_slice(&step.to_le_bytes());
                }
            }
        }
        let t = Instant::now();
        let info = store.store.commit(&ckpt)?;
        inc.push(t.elapsed());
        written.push(info.bytes_written);
        let t = Instant::now();
        raw.commit(&ckpt)?;
        raws.push(t.elapsed());
    }
    let full = MEDIUM.logical_bytes() as f64;
    written.sort_unstable();
    let w = written[written.len() / 2] as f64;
    let (i, r) = (median(&mut inc), median(&mut raws));
    println!("| commit | median time | bytes written per step |");
    println!("|---|---:|---:|");
    println!(
        "| ckptstore, incremental | {} | {} ({:.0}% of full) |",
        fmt_dur(i),
        human(w as u64),
        100.0 * w / full
    );
    println!(
        "| raw write + fsync, whole checkpoint | {} | {} |",
        fmt_dur(r),
        human(full as u64)
    );
    println!(
        "\n- incremental commit time / raw full write: **{:.2}x**\n",
        i.as_secs_f64() / r.as_secs_f64()
    );
    Ok(())
}

/// Async commits: the caller's stall, and a simulated training loop.
fn run_async() -> Result {
    use ckptstore::StoreOptions;
    println!("## async: caller stall for a 256 MiB checkpoint, and a training loop\n");
    let dir = tempfile::tempdir_in(bench_dir())?;
    let store = StoreOptions::new().open(dir.path().join("async.ckpt"))?;
    let mut ckpt = checkpoint(&LARGE);
    let (mut sync, mut stall) = (Vec::new(), Vec::new());
    for i in 0..3u64 {
        touch(&mut ckpt, 2 * i);
        let t = Instant::now();
        store.commit(&ckpt)?;
        sync.push(t.elapsed());
        touch(&mut ckpt, 2 * i + 1);
        let owned = ckpt.clone(); // the caller gives the writer its own copy
        let t = Instant::now();
        let handle = store.commit_async(owned)?;
        stall.push(t.elapsed());
        handle.wait()?;
    }
    let (s, a) = (median(&mut sync), median(&mut stall));
    println!("| 256 MiB checkpoint | median |");
    println!("|---|---:|");
    println!("| `commit` (caller waits for the disk) | {} |", fmt_dur(s));
    println!(
        "| `commit_async` (caller's stall, queue not full) | {} |",
        fmt_dur(a)
    );
    println!(
        "\n- stall / synchronous commit: **{:.3}%**\n",
        100.0 * a.as_secs_f64() / s.as_secs_f64()
    );

    drop((ckpt, store));

    // The caller's cost of handing over state it keeps changing: a fresh
    // clone against a copy into the store's recycled buffers.
    let w = Workload {
        name: "loop",
        nodes: 100,
        blobs: 4,
        blob_len: 16 << 20,
    };
    let mut state = checkpoint(&w);
    {
        let store = StoreOptions::new().open(dir.path().join("copy.ckpt"))?;
        let (mut clone, mut copy) = (Vec::new(), Vec::new());
        for i in 0..5u64 {
            touch(&mut state, 2 * i);
            let t = Instant::now();
            let owned = state.clone();
            clone.push(t.elapsed());
            store.commit_async(owned)?.wait()?;
            touch(&mut state, 2 * i + 1);
            let t = Instant::now();
            let handle = store.commit_async_copy(&state)?;
            copy.push(t.elapsed());
            handle.wait()?;
        }
        let (c, p) = (median(&mut clone), median(&mut copy));
        println!("| handing over 64 MiB of state | median |");
        println!("|---|---:|");
        println!("| `state.clone()` for `commit_async` | {} |", fmt_dur(c));
        println!(
            "| `commit_async_copy(&state)` (copy into recycled buffers, queue) | {} |",
            fmt_dur(p)
        );
        println!(
            "\n- copy / clone: **{:.2}x**\n",
            p.as_secs_f64() / c.as_secs_f64()
        );
    }

    // A training loop: STEPS steps of a fixed amount of compute (calibrated
    // to ~100 ms alone; a fixed amount of work, not a fixed time, so that
    // work the writer takes from the compute thread shows), a 64 MiB
    // checkpoint every 5 steps, and the last checkpoint durable at the end.
    const STEPS: u64 = 100;
    let spin = |iters: u64, seed: u64| {
        let mut x = seed;
        for _ in 0..iters {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        x
    };
    let mut rates = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        spin(1 << 22, 1);
        rates.push(t.elapsed());
    }
    let per_iter = median(&mut rates).as_secs_f64() / f64::from(1u32 << 22);
    let iters = (0.1 / per_iter) as u64;
    let mut run = |mode: u8| -> Result<Duration> {
        let store = StoreOptions::new().open(dir.path().join(format!("loop{mode}.ckpt")))?;
        let t = Instant::now();
        for step in 0..STEPS {
            spin(iters, step);
            if step % 5 == 4 {
                touch(&mut state, step);
                match mode {
                    1 => drop(store.commit(&state)?),
                    2 => drop(store.commit_async(state.clone())?),
                    3 => drop(store.commit_async_copy(&state)?),
                    _ => {}
                }
            }
        }
        store.flush()?;
        Ok(t.elapsed())
    };
    let none_before = run(0)?;
    let sync_loop = run(1)?;
    let clone_loop = run(2)?;
    let copy_loop = run(3)?;
    let none_after = run(0)?;
    // The faster baseline: the overheads below are upper bounds.
    let none = none_before.min(none_after);
    let pct = |d: Duration| 100.0 * (d.as_secs_f64() / none.as_secs_f64() - 1.0);
    println!(
        "| training loop ({STEPS} steps of ~100 ms compute, 64 MiB checkpoint every 5 steps) | total | overhead |"
    );
    println!("|---|---:|---:|");
    println!(
        "| no checkpoints (before / after) | {} / {} | - |",
        fmt_dur(none_before),
        fmt_dur(none_after)
    );
    for (name, d) in [
        ("`commit`", sync_loop),
        ("`commit_async(state.clone())`", clone_loop),
        ("`commit_async_copy(&state)`", copy_loop),
    ] {
        println!("| {name} | {} | {:.1}% |", fmt_dur(d), pct(d));
    }
    println!();
    Ok(())
}

/// Commit and latest() cost with 10, 1,000 and 100,000 small steps stored.
fn run_scale() -> Result {
    use ckptstore::{Durability, GradientCheckpoint, StoreOptions};
    println!("## scale: cost of commit and latest() as the store grows (1 KiB steps)\n");
    println!("| steps stored | median commit | median latest() | median latest_step() |");
    println!("|---:|---:|---:|---:|");
    for stored in [10u64, 1_000, 100_000] {
        let dir = tempfile::tempdir_in(bench_dir())?;
        let path = dir.path().join("scale.ckpt");
        let mut ckpt = GradientCheckpoint::new(graph(4), 0);
        ckpt.set_optimizer_state("w", noise(7, 1024));
        {
            // Fill fast, without fsync, then reopen as a normal store.
            let fill = StoreOptions::new()
                .shared(false)
                .durability(Durability::Eventual)
                .open(&path)?;
            for step in 0..stored {
                touch(&mut ckpt, step);
                fill.commit(&ckpt)?;
            }
        }
        let store = StoreOptions::new().open(&path)?;
        let mut commits = Vec::new();
        for step in stored..stored + 30 {
            touch(&mut ckpt, step);
            let t = Instant::now();
            store.commit(&ckpt)?;
            commits.push(t.elapsed());
        }
        let mut latest = Vec::new();
        let mut latest_step = Vec::new();
        for _ in 0..200 {
            let t = Instant::now();
            let got = store.latest()?;
            latest.push(t.elapsed());
            assert!(got.is_some());
            let t = Instant::now();
            store.latest_step()?;
            latest_step.push(t.elapsed());
        }
        println!(
            "| {stored} | {} | {} | {} |",
            fmt_dur(median(&mut commits)),
            fmt_dur(median(&mut latest)),
            fmt_dur(median(&mut latest_step))
        );
    }
    println!();
    Ok(())
}

fn bench_dir() -> std::path::PathBuf {
    std::env::var_os("CKPT_BENCH_DIR")
        .map(Into::into)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")))
}

pub fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

pub fn fmt_dur(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}

fn human(b: u64) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1 << 20) as f64 {
        format!("{:.1} MiB", b / (1 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b:.0} B")
    }
}

fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// Bytes this process has read and written through system calls so far
/// (`rchar`, `wchar` of /proc/self/io), where Linux tells.
fn proc_io() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/io").ok()?;
    let field = |key: &str| -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
    };
    Some((field("rchar:")?, field("wchar:")?))
}
