//! Workloads and contenders shared by the benchmarks.
#![allow(dead_code)]

// Shared with the `ckpt bench` command (src/bin/ckpt), which includes this
// file; SQLite, a dev-dependency, lives in sqlite.rs for the benches only.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use ckptstore::{
    CheckpointStore, ComputationGraphStore, ComputationNode, GradientCheckpoint, StoreOptions,
};

pub type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// A checkpoint shape: graph nodes and blob sizes.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub name: &'static str,
    pub nodes: usize,
    pub blobs: usize,
    pub blob_len: usize,
}

pub const SMALL: Workload = Workload {
    name: "small",
    nodes: 1000,
    blobs: 100,
    blob_len: 1024,
};
pub const MEDIUM: Workload = Workload {
    name: "medium",
    nodes: 100,
    blobs: 20,
    blob_len: (16 << 20) / 20,
};
pub const LARGE: Workload = Workload {
    name: "large",
    nodes: 100,
    blobs: 4,
    blob_len: 64 << 20,
};

impl Workload {
    pub fn logical_bytes(&self) -> u64 {
        (self.blobs * self.blob_len) as u64
    }
}

/// Deterministic noise.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A graph of `n` nodes in a chain of matmuls.
pub fn graph(n: usize) -> ComputationGraphStore {
    let mut g = ComputationGraphStore::new();
    let mut prev = "cid_input".to_owned();
    for i in 0..n {
        let id = g.add_node(
            ComputationNode::new("matmul", vec![prev.clone(), format!("cid_w{i}")])
                .with_meta("dtype", "f32"),
        );
        prev = format!("cid_act{i}");
        // Ignored error: the node was just added.
        let _ = g.record_output(&id, prev.clone());
    }
    g
}

/// The checkpoint of a workload: built once, then `touch`ed per step so that
/// every 4 KiB page (and so every chunk) of every blob differs between
/// steps, and no contender can skip work by deduplicating.
pub fn checkpoint(w: &Workload) -> GradientCheckpoint {
    let mut ckpt = GradientCheckpoint::new(graph(w.nodes), 0).with_loss_cid("cid_loss");
    for i in 0..w.blobs {
        ckpt.set_optimizer_state(format!("param_{i:03}"), noise(i as u64 + 1, w.blob_len));
    }
    ckpt
}

pub fn touch(ckpt: &mut GradientCheckpoint, step: u64) {
    ckpt.step = step;
    ckpt.loss_cid = Some(format!("cid_loss_{step}"));
    for blob in ckpt.optimizer_state.values_mut() {
        for page in blob.chunks_mut(4096) {
            let n = page.len().min(8);
            page[..n].copy_from_slice(&step.to_le_bytes()[..n]);
        }
    }
}

/// Commit `n` steps of `ckpt` (touched per step) with `c`; the time of each.
pub fn time_commits(
    c: &mut dyn Contender,
    ckpt: &mut GradientCheckpoint,
    n: usize,
    mut after_each: impl FnMut(),
) -> Result<Vec<std::time::Duration>> {
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        touch(ckpt, i as u64);
        let t = std::time::Instant::now();
        c.commit(ckpt)?;
        times.push(t.elapsed());
        after_each();
    }
    Ok(times)
}

/// One way of saving checkpoints.
pub trait Contender {
    fn name(&self) -> &'static str;
    /// Save one step durably (or as durably as the contender does).
    fn commit(&mut self, ckpt: &GradientCheckpoint) -> Result;
    /// Read back the newest step's blobs; returns bytes read.
    fn read_latest(&mut self) -> Result<u64>;
    /// Bytes this contender occupies on disk: the filesystem blocks
    /// allocated to its files (what `du` counts).
    fn disk_bytes(&self) -> Result<u64>;
}

/// Bytes of disk allocated to a file (its blocks; a sparse region the
/// program extended the file by but never wrote takes none). Where the
/// platform does not tell, its length.
pub fn allocated(m: &fs::Metadata) -> u64 {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        m.blocks() * 512
    }
    #[cfg(not(unix))]
    {
        m.len()
    }
}

fn dir_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for e in fs::read_dir(dir)? {
        let m = e?.metadata()?;
        if m.is_file() {
            total += allocated(&m);
        }
    }
    Ok(total)
}

/// (a) The seed: pretty JSON to a temp file, renamed, no fsync.
pub struct SeedJson {
    pub dir: PathBuf,
    pub fsync: bool,
    last: Option<PathBuf>,
}

impl SeedJson {
    pub fn new(dir: PathBuf, fsync: bool) -> Self {
        SeedJson {
            dir,
            fsync,
            last: None,
        }
    }
}

impl Contender for SeedJson {
    fn name(&self) -> &'static str {
        if self.fsync {
            "seed JSON + fsync"
        } else {
            "seed JSON (no fsync)"
        }
    }
    fn commit(&mut self, ckpt: &GradientCheckpoint) -> Result {
        let path = self.dir.join(format!("step_{}.json", ckpt.step));
        if self.fsync {
            ckpt.save(&path)?;
        } else {
            // Exactly the seed's save(): pretty JSON, temp file, rename.
            let bytes = serde_json::to_vec_pretty(ckpt)?;
            let tmp = self
                .dir
                .join(format!(".ckpt_tmp_{}.json", uuid::Uuid::new_v4()));
            fs::write(&tmp, &bytes)?;
            fs::rename(&tmp, &path)?;
        }
        self.last = Some(path);
        Ok(())
    }
    fn read_latest(&mut self) -> Result<u64> {
        let path = self.last.as_ref().ok_or("nothing saved")?;
        Ok(GradientCheckpoint::load(path)?.logical_bytes())
    }
    fn disk_bytes(&self) -> Result<u64> {
        dir_bytes(&self.dir)
    }
}

/// (c) Raw bytes: graph JSON + blobs written to one file per step, fsync of
/// the file and the directory (what a durable safetensors-style save costs).
pub struct RawFsync {
    pub dir: PathBuf,
    last: Option<PathBuf>,
}

impl RawFsync {
    pub fn new(dir: PathBuf) -> Self {
        RawFsync { dir, last: None }
    }
}

impl Contender for RawFsync {
    fn name(&self) -> &'static str {
        "raw write + fsync"
    }
    fn commit(&mut self, ckpt: &GradientCheckpoint) -> Result {
        let path = self.dir.join(format!("step_{}.bin", ckpt.step));
        let mut f = File::create(&path)?;
        f.write_all(&serde_json::to_vec(&ckpt.graph)?)?;
        let mut names: Vec<&String> = ckpt.optimizer_state.keys().collect();
        names.sort();
        for name in names {
            f.write_all(&ckpt.optimizer_state[name])?;
        }
        f.sync_all()?;
        File::open(&self.dir)?.sync_all()?;
        self.last = Some(path);
        Ok(())
    }
    /// Read the file and decode its graph (a checkpoint is not back until
    /// its graph is); the blobs are the bytes after it.
    fn read_latest(&mut self) -> Result<u64> {
        let path = self.last.as_ref().ok_or("nothing saved")?;
        let bytes = fs::read(path)?;
        let mut stream =
            serde_json::Deserializer::from_slice(&bytes).into_iter::<ComputationGraphStore>();
        let graph = stream.next().ok_or("no graph")??;
        std::hint::black_box(graph);
        Ok((bytes.len() - stream.byte_offset()) as u64)
    }
    fn disk_bytes(&self) -> Result<u64> {
        dir_bytes(&self.dir)
    }
}

/// (e) ckptstore.
pub struct Store {
    pub path: PathBuf,
    pub store: CheckpointStore,
}

impl Store {
    pub fn new(path: PathBuf) -> Result<Self> {
        Self::with_options(path, StoreOptions::new())
    }

    pub fn with_options(path: PathBuf, options: StoreOptions) -> Result<Self> {
        let store = options.open(&path)?;
        Ok(Store { path, store })
    }
}

impl Contender for Store {
    fn name(&self) -> &'static str {
        "ckptstore commit"
    }
    fn commit(&mut self, ckpt: &GradientCheckpoint) -> Result {
        self.store.commit(ckpt)?;
        Ok(())
    }
    fn read_latest(&mut self) -> Result<u64> {
        Ok(self.store.latest()?.ok_or("empty")?.logical_bytes())
    }
    fn disk_bytes(&self) -> Result<u64> {
        Ok(allocated(&fs::metadata(&self.path)?))
    }
}

/// Peak resident memory of this process (`VmHWM`), in bytes.
pub fn peak_rss() -> u64 {
    proc_status_kib("VmHWM:") * 1024
}

/// Current resident memory (`VmRSS`), in bytes.
pub fn rss() -> u64 {
    proc_status_kib("VmRSS:") * 1024
}

/// Reset the peak to the current resident size (Linux >= 4.0).
pub fn reset_peak_rss() {
    let _ = fs::write("/proc/self/clear_refs", "5");
}

fn proc_status_kib(key: &str) -> u64 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}
