//! Power cuts under a store with pack files: its redb file and its pack
//! files on one simulated disk ([`super::sim_disk`]) that loses what was
//! not synced (all of it, or a seeded subset of writes and names), cut at
//! every call of a run of large commits, a removal, retention and a
//! compaction, in both durability modes. No acknowledged step is lost,
//! nothing partial is left, a removal is undone only whole, and the store
//! takes commits after the cut. CI cuts at about 40 calls of each run;
//! `CKPT_LONG=1` at every call.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use super::sim_disk::{Image, SimBackend, SimDisk, ROOT};
use crate::db::backend::{BackendFactory, DynBackend, Source};
use crate::{
    CheckpointStore, ComputationGraphStore, Durability, GradientCheckpoint, Retention, StoreOptions,
};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Step `step`: 300 KiB of its own and 200 KiB every step shares (so
/// removals leave pack files half dead), each commit a pack file.
fn step(step: u64) -> GradientCheckpoint {
    let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    ckpt.timestamp = 1_750_000_000 + step;
    ckpt.set_optimizer_state("moving", bytes(step, 300 << 10));
    ckpt.set_optimizer_state("frozen", bytes(u64::MAX, 200 << 10));
    ckpt
}

/// Bytes that differ with `seed`: BLAKE3's output stream.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    blake3::Hasher::new()
        .update(&seed.to_le_bytes())
        .finalize_xof()
        .fill(&mut out);
    out
}

fn open(disk: &Arc<SimDisk>, eventual: bool) -> crate::Result<CheckpointStore> {
    let d = disk.clone();
    let factory: BackendFactory = Arc::new(move || Ok(DynBackend(Box::new(SimBackend(d.clone())))));
    let mut options = StoreOptions::new()
        .pack_files(true)
        .pack_threshold(128 << 10);
    if eventual {
        options = options.shared(false).durability(Durability::Eventual);
    }
    let name = Path::new(ROOT).join("run.ckpt");
    options.open_source(Source::Backend(name, factory, Some(disk.pack_dir())))
}

/// What the run does after the base steps 1 and 2.
#[derive(Clone, Copy, Debug)]
enum Op {
    Commit(u64),
    Remove(u64),
    KeepLast(usize),
    Compact,
}

const RUN: [Op; 7] = [
    Op::Commit(3),
    Op::Remove(1),
    Op::Commit(4),
    Op::KeepLast(2),
    Op::Commit(5),
    Op::Compact,
    Op::Commit(6),
];

/// Run `op`; the steps stored after it.
fn apply(store: &CheckpointStore, op: Op, steps: &mut BTreeSet<u64>) -> Result {
    match op {
        Op::Commit(s) => {
            store.commit(&step(s))?;
            steps.insert(s);
        }
        Op::Remove(s) => {
            store.remove(s)?;
            steps.remove(&s);
        }
        Op::KeepLast(n) => {
            for s in store.apply_retention(&Retention::new().keep_last(n))? {
                steps.remove(&s);
            }
        }
        Op::Compact => {
            store.compact()?;
        }
    }
    Ok(())
}

#[test]
fn power_cuts_under_pack_files_lose_no_acknowledged_step() -> Result {
    let mut cuts = 0;
    for eventual in [false, true] {
        let base = SimDisk::empty();
        {
            let store = open(&base, false)?;
            store.commit(&step(1))?;
            store.commit(&step(2))?;
        }
        let base = base.image();
        // A probe run: where each operation starts, what it leaves.
        let probe = SimDisk::new(&base);
        let (mut starts, mut states) = (Vec::new(), vec![BTreeSet::from([1, 2])]);
        let total = {
            let store = open(&probe, eventual)?;
            let first = probe.calls();
            let mut steps = states[0].clone();
            for op in RUN {
                starts.push(probe.calls() - first);
                apply(&store, op, &mut steps)?;
                states.push(steps.clone());
            }
            drop(store);
            probe.calls() - first
        };
        let stride = if std::env::var_os("CKPT_LONG").is_some() {
            1
        } else {
            (total / 40).max(1)
        };
        for seed in [0u64, 0x9E37_79B9] {
            let mut at = 0;
            while at <= total {
                let ctx = format!("eventual={eventual} seed={seed:#x} cut at call {at} of {total}");
                let image = run_and_cut(&base, eventual, at, seed)?;
                // The operation under way at the cut (or the close after
                // the last one, whose state is the last).
                let under_way = starts.iter().rposition(|&s| s <= at).unwrap_or(0);
                let allowed: &[BTreeSet<u64>] = if eventual {
                    // Nothing is durable before the close: any state up to
                    // the one the operation under way makes.
                    &states[..=under_way + 1]
                } else {
                    &states[under_way..=under_way + 1]
                };
                check(&image, eventual, allowed, seed == 0).map_err(|e| format!("{ctx}: {e}"))?;
                cuts += 1;
                at += stride;
            }
        }
    }
    println!("{cuts} power cuts under pack files, no acknowledged step lost");
    Ok(())
}

/// The run from `base` with the power cut at call `at` (after the open):
/// what the disk held then.
fn run_and_cut(base: &Image, eventual: bool, at: u64, seed: u64) -> Result<Image> {
    let disk = SimDisk::new(base);
    let store = open(&disk, eventual)?;
    disk.plan_cut(disk.calls() + at, seed);
    let mut steps = BTreeSet::new();
    for op in RUN {
        apply(&store, op, &mut steps)?;
    }
    drop(store);
    Ok(disk.cut_image().unwrap_or_else(|| disk.image()))
}

/// The store on `image` opens, holds one of the `allowed` sets of steps,
/// each whole, verifies, leaves no file of its own unrecorded (`exact`: no
/// unsynced name survived, so every file a writer left has its header),
/// and takes a commit.
fn check(image: &Image, eventual: bool, allowed: &[BTreeSet<u64>], exact: bool) -> Result {
    let disk = SimDisk::new(image);
    let store = open(&disk, eventual).map_err(|e| format!("reopen failed: {e}"))?;
    let found: BTreeSet<u64> = store.steps()?.into_iter().collect();
    if !allowed.contains(&found) {
        return Err(format!("found {found:?}, allowed {allowed:?}").into());
    }
    for &s in &found {
        if store.get(s)? != Some(step(s)) {
            return Err(format!("step {s} differs").into());
        }
    }
    let report = store.verify()?;
    if !report.is_ok() || report.staged_chunks > 0 {
        return Err(format!("verify: {:?}", report.problems()).into());
    }
    if exact && report.stray_pack_files + report.in_flight_pack_files > 0 {
        return Err(format!("files left after the writable open: {report:?}").into());
    }
    store.commit(&step(9))?;
    if store.get(9)? != Some(step(9)) {
        return Err("the commit after the cut reads back wrong".into());
    }
    Ok(())
}
