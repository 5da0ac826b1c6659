//! Recovery after kill -9: a writer fills a store with distinct 64 MiB
//! steps until it holds `CKPT_BENCH_RECOVERY_GIB` GiB (default 10), is
//! killed in the middle of a commit, and a fresh process reopens the store.
//! Contenders: ckptstore (its commits record redb's allocator state), and
//! the same redb writes without that record, as ckptstore 0.2 committed
//! (64 values of 1 MiB - 128 B per commit, durable): its reopen repairs by
//! walking the whole file. The page cache is dropped before each reopen
//! when the machine allows it; bytes read count either way.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
use redb::{ReadableDatabase, TableDefinition};

use crate::common::{checkpoint, touch, Contender, Result, Store, LARGE, SMALL};
use crate::{fmt_dur, median};
use ckptstore::StoreOptions;

pub const CHILD_VAR: &str = "CKPT_BENCH_RECOVERY_CHILD";
const STEP_BYTES: usize = 64 << 20;
const VALUE_BYTES: usize = (1 << 20) - 128;
const TABLE: TableDefinition<u64, &[u8]> = TableDefinition::new("chunks");

/// The child side: `write:KIND:PATH` commits until killed; `reopen:KIND:PATH`
/// opens once and reports.
pub fn child(spec: &str) -> Result {
    let mut parts = spec.splitn(3, ':');
    let (role, kind, path) = (
        parts.next().ok_or("role")?,
        parts.next().ok_or("kind")?,
        Path::new(parts.next().ok_or("path")?),
    );
    match (role, kind) {
        ("write", "ckptstore") => write_ckptstore(path),
        ("write", _) => write_redb(path),
        (_, kind) => {
            let before = proc_io()?;
            let start = Instant::now();
            if kind == "ckptstore" {
                let store = CheckpointStore::open(path)?;
                store.latest_step()?.ok_or("empty")?;
            } else {
                let db = redb::Database::create(path)?;
                db.begin_read()?.open_table(TABLE)?;
            }
            let took = start.elapsed();
            let after = proc_io()?;
            println!(
                "REOPEN {} {} {}",
                took.as_micros(),
                after.0 - before.0,
                after.1 - before.1
            );
            Ok(())
        }
    }
}

fn payload(step: u64, buf: &mut Vec<u8>) {
    if buf.len() != STEP_BYTES {
        *buf = (0..STEP_BYTES as u64)
            .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
            .collect();
    }
    for chunk in buf.chunks_mut(1 << 20) {
        chunk[..8].copy_from_slice(&step.to_le_bytes());
    }
}

fn write_ckptstore(path: &Path) -> Result {
    let store = CheckpointStore::open(path)?;
    let mut buf = Vec::new();
    let mut out = std::io::stdout().lock();
    for step in 0.. {
        payload(step, &mut buf);
        let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), step);
        ckpt.set_optimizer_state("params", buf.clone());
        store.commit(&ckpt)?;
        writeln!(out, "COMMITTED {step}")?;
        out.flush()?;
    }
    Ok(())
}

fn write_redb(path: &Path) -> Result {
    let db = redb::Database::create(path)?;
    let mut buf = Vec::new();
    let mut out = std::io::stdout().lock();
    let mut key = 0u64;
    for step in 0.. {
        payload(step, &mut buf);
        let txn = db.begin_write()?;
        {
            let mut table = txn.open_table(TABLE)?;
            for value in buf.chunks(VALUE_BYTES) {
                table.insert(key, value)?;
                key += 1;
            }
        }
        txn.commit()?;
        writeln!(out, "COMMITTED {step}")?;
        out.flush()?;
    }
    Ok(())
}

/// (bytes asked of the kernel, bytes read from the device) so far.
fn proc_io() -> Result<(u64, u64)> {
    let io = std::fs::read_to_string("/proc/self/io")?;
    let field = |name: &str| -> Result<u64> {
        let line = io.lines().find(|l| l.starts_with(name)).ok_or("field")?;
        Ok(line[name.len()..].trim().parse()?)
    };
    Ok((field("rchar:")?, field("read_bytes:")?))
}

fn run_child(spec: String, stdout: Stdio) -> Result<std::process::Child> {
    Ok(Command::new(std::env::current_exe()?)
        .env(CHILD_VAR, spec)
        .stdout(stdout)
        .stderr(Stdio::inherit())
        .spawn()?)
}

/// Whether the page cache could be dropped.
fn drop_caches() -> bool {
    let synced = Command::new("sync").status().is_ok_and(|s| s.success());
    synced && std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

pub fn run(dir: &Path) -> Result {
    let gib: u64 = std::env::var("CKPT_BENCH_RECOVERY_GIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    println!("\n### recovery: reopen after kill -9 of a {gib} GiB store (64 MiB steps)\n");
    println!("| store | file | reopen | read (syscalls) | read (device) | cache |");
    println!("|---|---:|---:|---:|---:|---|");
    for kind in ["ckptstore", "redb without quick repair (as 0.2 committed)"] {
        let path = dir.join(if kind == "ckptstore" {
            "rec.ckpt"
        } else {
            "rec.redb"
        });
        let tag = if kind == "ckptstore" {
            "ckptstore"
        } else {
            "redb"
        };
        let mut writer = run_child(format!("write:{tag}:{}", path.display()), Stdio::piped())?;
        let lines = BufReader::new(writer.stdout.take().ok_or("stdout")?).lines();
        let want = gib * (1 << 30) / STEP_BYTES as u64;
        for line in lines {
            let line = line?;
            if line
                .strip_prefix("COMMITTED ")
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|n| n + 1 >= want)
            {
                std::thread::sleep(Duration::from_millis(60));
                break;
            }
        }
        writer.kill()?;
        writer.wait()?;
        let file = std::fs::metadata(&path)?.len();
        let cold = drop_caches();
        let out = run_child(format!("reopen:{tag}:{}", path.display()), Stdio::piped())?
            .wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let report: Vec<u64> = text
            .lines()
            .find_map(|l| l.strip_prefix("REOPEN "))
            .ok_or("reopen failed")?
            .split_whitespace()
            .map(str::parse)
            .collect::<std::result::Result<_, _>>()?;
        println!(
            "| {kind} | {:.1} GiB | {:.1} ms | {:.1} MiB | {:.1} MiB | {} |",
            file as f64 / f64::from(1 << 30),
            report[0] as f64 / 1000.0,
            report[1] as f64 / f64::from(1 << 20),
            report[2] as f64 / f64::from(1 << 20),
            if cold {
                "dropped"
            } else {
                "warm (cannot drop caches here)"
            }
        );
        std::fs::remove_file(&path)?;
    }
    Ok(())
}

/// What quick repair costs each commit: two stores, with and without it,
/// alternating commit by commit (drift of the shared disk hits both alike).
pub fn run_commit_cost(dir: &Path) -> Result {
    println!("\n### what quick repair costs a commit: with and without, alternating\n");
    println!("| workload | pairs | with (default) | without | median of per-pair ratios (without / with) |");
    println!("|---|---:|---:|---:|---:|");
    for (w, pairs) in [(SMALL, 41), (LARGE, 11)] {
        let sub = tempfile::tempdir_in(dir)?;
        let mut with = Store::new(sub.path().join("with.ckpt"))?;
        let mut without = Store::with_options(
            sub.path().join("without.ckpt"),
            StoreOptions::new().quick_repair(false),
        )?;
        let mut ckpt = checkpoint(&w);
        let (mut wt, mut ot, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..pairs {
            touch(&mut ckpt, i as u64);
            let time = |c: &mut Store| -> Result<Duration> {
                let t = Instant::now();
                c.commit(&ckpt)?;
                Ok(t.elapsed())
            };
            let (a, b) = if i % 2 == 0 {
                let a = time(&mut with)?;
                (a, time(&mut without)?)
            } else {
                let b = time(&mut without)?;
                (time(&mut with)?, b)
            };
            wt.push(a);
            ot.push(b);
            ratios.push(b.as_secs_f64() / a.as_secs_f64());
        }
        ratios.sort_by(f64::total_cmp);
        println!(
            "| {} | {pairs} | {} | {} | **{:.2}x** |",
            w.name,
            fmt_dur(median(&mut wt)),
            fmt_dur(median(&mut ot)),
            ratios[ratios.len() / 2]
        );
    }
    Ok(())
}
