//! Typed tensors and safetensors: commit of typed tensors against the same
//! bytes as blobs, and export / import of a step against a raw copy of the
//! same bytes (read a file, write another, fsync).

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use ckptstore::{CheckpointStore, ComputationGraphStore, Dtype, GradientCheckpoint, Tensor};

use crate::common::{noise, Result};
use crate::{fmt_dur, median};

const TENSORS: usize = 4;
const TENSOR_BYTES: usize = 64 << 20;
const ROUNDS: u64 = 5;

fn step(step: u64, typed: bool) -> Result<GradientCheckpoint> {
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    for i in 0..TENSORS {
        let mut data = noise(i as u64 + 1, TENSOR_BYTES);
        // Every 4 KiB page changes from step to step: no deduplication.
        for page in data.chunks_mut(4096) {
            page[..8].copy_from_slice(&step.to_le_bytes());
        }
        if typed {
            let shape = vec![(TENSOR_BYTES / 4 / 1024) as u64, 1024];
            c.set_tensor(format!("t{i}"), Tensor::new(Dtype::F32, shape, data)?);
        } else {
            c.set_optimizer_state(format!("t{i}"), data);
        }
    }
    Ok(c)
}

fn time(f: impl FnOnce() -> Result) -> Result<Duration> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed())
}

/// Read `from` whole and write it to `to`, fsynced: the baseline.
fn raw_copy(from: &Path, to: &Path) -> Result {
    let bytes = std::fs::read(from)?;
    let mut f = std::fs::File::create(to)?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    Ok(())
}

/// `std::fs::copy` (in the kernel: `copy_file_range`, no user-space
/// buffer), fsynced: the fastest copy the machine makes.
fn kernel_copy(from: &Path, to: &Path) -> Result {
    std::fs::copy(from, to)?;
    std::fs::File::open(to)?.sync_all()?;
    Ok(())
}

pub fn run(dir: &Path) -> Result {
    run_rounds(dir)?;
    run_memory(dir)
}

fn run_rounds(dir: &Path) -> Result {
    println!("\n## tensors and safetensors: {TENSORS} tensors x 64 MiB = 256 MiB per step\n");
    let store = CheckpointStore::open(dir.join("x.ckpt"))?;
    let (mut typed, mut blobs, mut export, mut import, mut raw, mut kernel) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for round in 0..ROUNDS {
        let (t, b) = (step(2 * round, true)?, step(2 * round + 1, false)?);
        // Alternate which goes first.
        if round % 2 == 0 {
            typed.push(time(|| store.commit(&t).map(drop).map_err(Into::into))?);
            blobs.push(time(|| store.commit(&b).map(drop).map_err(Into::into))?);
        } else {
            blobs.push(time(|| store.commit(&b).map(drop).map_err(Into::into))?);
            typed.push(time(|| store.commit(&t).map(drop).map_err(Into::into))?);
        }
        drop((t, b));
        let file = dir.join("step.safetensors");
        if round == 0 {
            store.export_safetensors(2 * round, &file)?;
        }
        // Alternate which goes first: the second writer may wait for the
        // first one's data on the shared device.
        if round % 2 == 0 {
            raw.push(time(|| raw_copy(&file, &dir.join("copy.bin")))?);
            kernel.push(time(|| kernel_copy(&file, &dir.join("copy.bin")))?);
            export.push(time(|| Ok(store.export_safetensors(2 * round, &file)?))?);
        } else {
            export.push(time(|| Ok(store.export_safetensors(2 * round, &file)?))?);
            kernel.push(time(|| kernel_copy(&file, &dir.join("copy.bin")))?);
            raw.push(time(|| raw_copy(&file, &dir.join("copy.bin")))?);
        }
        store.remove(2 * round)?;
        import.push(time(|| {
            store
                .import_safetensors(&file, 2 * round)
                .map(drop)
                .map_err(Into::into)
        })?);
        store.remove(2 * round)?;
        store.remove(2 * round + 1)?;
    }
    let (typed, blobs) = (median(&mut typed), median(&mut blobs));
    let (export, import, raw) = (median(&mut export), median(&mut import), median(&mut raw));
    let kernel = median(&mut kernel);
    println!("| operation ({ROUNDS} rounds, medians) | time | ratio |");
    println!("|---|---:|---:|");
    println!(
        "| commit, same bytes as blobs | {} | 1.00x |",
        fmt_dur(blobs)
    );
    println!(
        "| commit, typed tensors | {} | {:.2}x the blobs' time |",
        fmt_dur(typed),
        typed.as_secs_f64() / blobs.as_secs_f64()
    );
    println!(
        "| raw copy of the file (read, write, fsync) | {} | 1.00x |",
        fmt_dur(raw)
    );
    println!(
        "| kernel copy of the file (`std::fs::copy`, fsync) | {} | {:.2}x raw copy time |",
        fmt_dur(kernel),
        kernel.as_secs_f64() / raw.as_secs_f64()
    );
    println!(
        "| `export_safetensors` (read from the store, write, fsync, rename) | {} | {:.2}x raw copy time, {:.2}x kernel copy time |",
        fmt_dur(export),
        export.as_secs_f64() / raw.as_secs_f64(),
        export.as_secs_f64() / kernel.as_secs_f64()
    );
    println!(
        "| `import_safetensors` (read the file, commit) | {} | {:.2}x raw copy time |",
        fmt_dur(import),
        import.as_secs_f64() / raw.as_secs_f64()
    );
    Ok(())
}

pub const CHILD_VAR: &str = "CKPT_BENCH_TENSOR_CHILD";

/// Resident memory: (now, peak) in bytes, from /proc/self/status.
fn rss() -> Result<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let field = |name: &str| -> Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .ok_or("no field")?;
        let kb: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()?;
        Ok(kb * 1024)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// The child side: `export:STORE:FILE` or `import:STORE:FILE`; prints the
/// peak resident memory above what the process had before the operation.
pub fn child(spec: &str) -> Result {
    let mut parts = spec.splitn(3, ':');
    let (op, store, file) = (
        parts.next().ok_or("op")?,
        parts.next().ok_or("store")?,
        parts.next().ok_or("file")?,
    );
    let store = CheckpointStore::open(store)?;
    let (before, _) = rss()?;
    if op == "export" {
        store.export_safetensors(0, file)?;
    } else {
        store.import_safetensors(file, 0)?;
    }
    let (_, peak) = rss()?;
    println!("PEAK {}", peak.saturating_sub(before));
    Ok(())
}

/// Peak memory of export and import of a 1 GiB step of 64 MiB tensors, each
/// in a fresh process.
pub fn run_memory(dir: &Path) -> Result {
    let gib_step = {
        let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 0);
        for i in 0..16u64 {
            let data = noise(100 + i, TENSOR_BYTES);
            let shape = vec![(TENSOR_BYTES / 4) as u64];
            c.set_tensor(format!("t{i:02}"), Tensor::new(Dtype::F32, shape, data)?);
        }
        c
    };
    let source = dir.join("gib.ckpt");
    CheckpointStore::open(&source)?.commit(&gib_step)?;
    drop(gib_step);
    let file = dir.join("gib.safetensors");
    let peak = |spec: String| -> Result<u64> {
        let out = std::process::Command::new(std::env::current_exe()?)
            .env(CHILD_VAR, spec)
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| l.strip_prefix("PEAK ").and_then(|v| v.trim().parse().ok()))
            .ok_or_else(|| format!("child failed: {}", String::from_utf8_lossy(&out.stderr)).into())
    };
    let export = peak(format!("export:{}:{}", source.display(), file.display()))?;
    let target = dir.join("gib-import.ckpt");
    let import = peak(format!("import:{}:{}", target.display(), file.display()))?;
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    println!("\n| 1 GiB step, 16 tensors x 64 MiB | peak memory above the process's before | beyond the largest tensor |");
    println!("|---|---:|---:|");
    println!(
        "| `export_safetensors` | {:.1} MiB | {:+.1} MiB |",
        mib(export),
        mib(export) - 64.0
    );
    println!(
        "| `import_safetensors` | {:.1} MiB | {:+.1} MiB |",
        mib(import),
        mib(import) - 64.0
    );
    Ok(())
}
