//! A training loop that checkpoints into an embedded store, crashes, and
//! resumes from the latest committed step.
//!
//! ```text
//! cargo run --release --no-default-features --example train [-- STORE_PATH]
//! ```
//!
//! The first run happens in a child process that aborts (no clean shutdown,
//! as a preempted or crashed job would) part-way through; this process then
//! reopens the store, resumes from `latest()` and finishes the run.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use ckptstore::{CheckpointStore, ComputationGraphStore, ComputationNode, GradientCheckpoint};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

const TOTAL_STEPS: u64 = 200;
const CHECKPOINT_EVERY: u64 = 20;
const CRASH_AT: u64 = 130;
/// Parameter sizes in bytes: two layers train, the embedding is frozen.
const PARAMS: [(&str, usize, bool); 3] = [
    ("embedding", 8 << 20, false),
    ("layer1", 2 << 20, true),
    ("layer2", 2 << 20, true),
];

fn main() -> Result {
    let mut args = std::env::args().skip(1);
    let first = args.next();
    if first.as_deref() == Some("--crash-run") {
        let path = PathBuf::from(args.next().ok_or("--crash-run needs a path")?);
        return train(&path, true);
    }
    let path = first.map_or_else(
        || std::env::temp_dir().join("ckptstore-demo.ckpt"),
        PathBuf::from,
    );
    // A store is its file and its pack directory (`PATH.packs`).
    if path.exists() {
        std::fs::remove_file(&path)?;
    }
    let mut packs = path.clone().into_os_string();
    packs.push(".packs");
    if std::path::Path::new(&packs).exists() {
        std::fs::remove_dir_all(&packs)?;
    }

    println!(
        "== run 1: training into {} (will crash at step {CRASH_AT})",
        path.display()
    );
    let status = Command::new(std::env::current_exe()?)
        .arg("--crash-run")
        .arg(&path)
        .status()?;
    println!("   run 1 ended abnormally: {status}");

    println!("== run 2: reopen and resume");
    train(&path, false)?;

    let store = CheckpointStore::open_read_only(&path)?;
    let report = store.verify()?;
    println!(
        "== verify: {} steps intact, {:.1} MiB checked, {} damaged",
        report.steps_ok,
        report.bytes_checked as f64 / 1_048_576.0,
        report.damaged.len()
    );
    println!("   steps stored: {:?}", store.steps()?);
    let file = std::fs::metadata(&path)?.len();
    let usage = store.stats()?;
    println!(
        "   on disk: {:.1} MiB in the store file, {:.1} MiB in {} pack files",
        file as f64 / 1_048_576.0,
        usage.pack_bytes as f64 / 1_048_576.0,
        usage.pack_files
    );
    if !report.is_ok() {
        return Err("store failed verification".into());
    }
    Ok(())
}

/// The training state that evolves from step to step.
struct Model {
    params: HashMap<String, Vec<u8>>,
}

impl Model {
    fn new() -> Self {
        let params = PARAMS
            .iter()
            .enumerate()
            .map(|(seed, &(name, len, _))| (name.to_owned(), noise(seed as u64 + 1, len)))
            .collect();
        Model { params }
    }

    fn from_checkpoint(ckpt: GradientCheckpoint) -> Self {
        Model {
            params: ckpt.optimizer_state,
        }
    }

    /// One optimizer step: the trainable parameters change, the frozen one
    /// does not.
    fn step(&mut self, step: u64) {
        for &(name, _, trainable) in &PARAMS {
            if !trainable {
                continue;
            }
            if let Some(p) = self.params.get_mut(name) {
                for (i, b) in p.iter_mut().enumerate().step_by(4096) {
                    *b = b.wrapping_add(
                        step.to_le_bytes()[0].wrapping_add(1) ^ (i >> 12).to_le_bytes()[0],
                    );
                }
            }
        }
    }

    fn checkpoint(&self, step: u64) -> Result<GradientCheckpoint> {
        let mut graph = ComputationGraphStore::new();
        let input = graph.add_node(ComputationNode::new("load_batch", vec![]));
        graph.record_output(&input, format!("cid_batch_{step}"))?;
        let fwd = graph.add_node(
            ComputationNode::new("forward", vec![format!("cid_batch_{step}")])
                .with_meta("dtype", "bf16"),
        );
        graph.record_output(&fwd, format!("cid_loss_{step}"))?;
        graph.record_gradient(&fwd, format!("cid_grad_{step}"))?;

        let loss = 2.0 / (1.0 + step as f64 / 50.0);
        let mut ckpt = GradientCheckpoint::new(graph, step)
            .with_loss_cid(format!("cid_loss_{step}"))
            .with_metric("loss", loss);
        for (name, bytes) in &self.params {
            ckpt.set_optimizer_state(name.clone(), bytes.clone());
        }
        Ok(ckpt)
    }
}

/// Deterministic pseudo-random initial weights.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24).to_le_bytes()[0]
        })
        .collect()
}

fn train(path: &Path, crash: bool) -> Result {
    let opened = std::time::Instant::now();
    let store = CheckpointStore::open(path)?;
    let (mut model, start) = if let Some(ckpt) = store.latest()? {
        let step = ckpt.step;
        println!(
            "   resumed from step {step} in {:.1} ms (loss {:.3}, {} params)",
            opened.elapsed().as_secs_f64() * 1000.0,
            ckpt.metrics.get("loss").copied().unwrap_or(f64::NAN),
            ckpt.optimizer_state.len()
        );
        (Model::from_checkpoint(ckpt), step + 1)
    } else {
        println!("   no checkpoint yet: starting at step 0");
        (Model::new(), 0)
    };

    for step in start..=TOTAL_STEPS {
        if crash && step == CRASH_AT {
            println!("   !! crash at step {step}: the process aborts without closing the store");
            std::process::abort();
        }
        model.step(step);
        if step % CHECKPOINT_EVERY == 0 {
            let info = store.commit(&model.checkpoint(step)?)?;
            println!(
                "   step {step:>4}: committed {:>5.1} MiB in {:>6.1} ms (wrote {:>4.1} MiB, reused {:>4.1} MiB)",
                info.logical_bytes as f64 / 1_048_576.0,
                info.duration.as_secs_f64() * 1000.0,
                info.bytes_written as f64 / 1_048_576.0,
                info.bytes_reused as f64 / 1_048_576.0,
            );
        }
    }
    println!("   training finished at step {TOTAL_STEPS}");
    Ok(())
}
