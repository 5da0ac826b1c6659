//! Helpers shared by the integration tests.

#![allow(dead_code)]

pub mod faults;

use ckptstore::{ComputationGraphStore, ComputationNode, GradientCheckpoint, Result};

/// Deterministic pseudo-random bytes (xorshift64*), so failures reproduce.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A small graph: load -> matmul -> relu, with outputs and a gradient.
pub fn graph(step: u64) -> Result<ComputationGraphStore> {
    let mut g = ComputationGraphStore::new();
    let load = g.add_node(ComputationNode::new("load", vec![]).with_meta("shard", "0"));
    g.record_output(&load, format!("cid_x_{step}"))?;
    let mm = g.add_node(
        ComputationNode::new("matmul", vec![format!("cid_x_{step}"), "cid_w".into()])
            .with_meta("dtype", "f32"),
    );
    g.record_output(&mm, format!("cid_y_{step}"))?;
    let relu = g.add_node(ComputationNode::new("relu", vec![format!("cid_y_{step}")]));
    g.record_output(&relu, format!("cid_z_{step}"))?;
    g.record_gradient(&mm, format!("cid_grad_{step}"))?;
    Ok(g)
}

/// A checkpoint at `step` with one blob per entry of `sizes`, contents
/// derived from the step.
pub fn checkpoint(step: u64, sizes: &[usize]) -> Result<GradientCheckpoint> {
    let mut ckpt = GradientCheckpoint::new(graph(step)?, step)
        .with_loss_cid(format!("cid_loss_{step}"))
        .with_metric("loss", 1.0 / (step as f64 + 1.0));
    for (i, &len) in sizes.iter().enumerate() {
        ckpt.set_optimizer_state(
            format!("param_{i}"),
            bytes(step.wrapping_mul(1000).wrapping_add(i as u64), len),
        );
    }
    Ok(ckpt)
}

/// A save record with a staging cost and a Lightning name.
pub fn save_record() -> ckptstore::SaveRecord {
    ckptstore::SaveRecord::default()
        .with_staging(ckptstore::Staging::new(0.75, 0.125).expect("finite"))
        .with_name("lightning:checkpoints/last.ckpt")
}

/// `checkpoint(step, &[100, 300_000])` with [`save_record`] and a loss.
pub fn recorded(step: u64) -> Result<GradientCheckpoint> {
    let mut c = checkpoint(step, &[100, 300_000])?.with_metric("loss", 0.5);
    c.save_record = save_record();
    Ok(c)
}

/// A checkpoint that is a pure function of `step` (fixed timestamp, fixed
/// node ids), so a process that did not write it can check it byte for byte.
pub fn deterministic(step: u64) -> GradientCheckpoint {
    let mut g = ComputationGraphStore::new();
    let mut node = ComputationNode::new("matmul", vec![format!("cid_in_{step}")]);
    node.id = format!("node-{step}");
    let id = g.add_node(node);
    g.record_output(&id, format!("cid_out_{step}"))
        .expect("node was just added");
    let mut ckpt = GradientCheckpoint::new(g, step)
        .with_loss_cid(format!("cid_loss_{step}"))
        .with_metric("loss", 1.0 / (1.0 + step as f64));
    ckpt.timestamp = 1_750_000_000 + step;
    // Sizes vary with the step, up to ~1.5 MiB, so kills land in commits of
    // many shapes; one blob is shared by every step.
    let len = ((step.wrapping_mul(7919) % 1_500) * 1024) as usize + (step % 7) as usize;
    ckpt.set_optimizer_state("moving", bytes(step, len));
    ckpt.set_optimizer_state("frozen", bytes(u64::MAX, 300_000));
    ckpt
}

/// A small seeded random number generator for test schedules.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// How many times to repeat a randomized trial: `ci` normally, `long` when
/// the environment variable `CKPT_LONG` is set.
pub fn trials(ci: usize, long: usize) -> usize {
    if std::env::var_os("CKPT_LONG").is_some() {
        long
    } else {
        ci
    }
}

/// Run the `ckpt` binary; returns (exit code, stdout, stderr).
pub fn ckpt(args: &[&str]) -> std::io::Result<(i32, String, String)> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(args)
        .output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// The names in a directory, sorted.
pub fn dir_names(dir: &std::path::Path) -> std::io::Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    names.sort();
    Ok(names)
}

/// The pack directory of the store at `store` (`run.ckpt.packs`).
pub fn pack_dir(store: &std::path::Path) -> std::path::PathBuf {
    let mut dir = store.as_os_str().to_owned();
    dir.push(".packs");
    dir.into()
}

/// The pack files of the store at `store`, by name.
pub fn pack_files(store: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(pack_dir(store))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.retain(|p| p.extension().is_some_and(|e| e == "pack"));
    files.sort();
    files
}

/// Flip one bit of the byte `offset` into the first place `needle` is
/// found among the files of the store at `store` (its redb file, then its
/// pack files), wherever the bytes live; the file changed.
pub fn flip_stored_byte(
    store: &std::path::Path,
    needle: &[u8],
    offset: usize,
) -> std::io::Result<std::path::PathBuf> {
    for path in std::iter::once(store.to_owned()).chain(pack_files(store)) {
        let mut file = std::fs::read(&path)?;
        if let Some(pos) = file.windows(needle.len()).position(|w| w == needle) {
            file[pos + offset] ^= 0x40;
            std::fs::write(&path, &file)?;
            return Ok(path);
        }
    }
    Err(std::io::Error::other(format!(
        "bytes not found in {} or its pack files",
        store.display()
    )))
}

/// This test binary run again as a child process that runs only the
/// (ignored) test `name`, its output not captured, told what to do by
/// `mode` and on which store (read back with [`child_task`]): the way
/// tests get a process of their own (to kill it, to `chdir`, to measure
/// it).
pub fn this_test_as_child(
    name: &str,
    mode: &str,
    store: &std::path::Path,
) -> std::io::Result<std::process::Command> {
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args([
        "--ignored",
        "--exact",
        name,
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_MODE, mode)
    .env(CHILD_STORE, store);
    Ok(cmd)
}

const CHILD_MODE: &str = "CKPT_CHILD_MODE";
const CHILD_STORE: &str = "CKPT_CHILD_STORE";

/// In a child of [`this_test_as_child`]: its mode and store.
pub fn child_task() -> std::result::Result<(String, std::path::PathBuf), String> {
    let mode = std::env::var(CHILD_MODE).map_err(|_| "run only as a child of a test")?;
    let store = std::env::var_os(CHILD_STORE).ok_or("no store given")?;
    Ok((mode, store.into()))
}
