//! A power cut at any backend call during a run of commits leaves a store
//! that opens, holds every step whose commit had returned, and nothing but
//! whole steps. Unsynced writes are all lost, or (seeded) any subset of them
//! survives, as a disk may reorder writes. Shared and exclusive stores, each
//! with the default cache and with a 1 MiB one, where commits stage their
//! chunks in transactions of their own (durable ones when shared,
//! non-durable when exclusive) before the transaction that makes the step.

use crate::common;

use std::sync::Arc;

use ckptstore::{CheckpointStore, GradientCheckpoint, StoreOptions};
use common::faults::{Disk, DiskBackend};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

fn open(disk: &Arc<Disk>, (shared, cache): (bool, usize)) -> ckptstore::Result<CheckpointStore> {
    let disk = disk.clone();
    StoreOptions::new()
        .shared(shared)
        .cache_size(cache)
        .open_with_backend("disk", move || Ok(DiskBackend(disk.clone())))
}

#[test]
fn power_cut_at_every_call_keeps_acknowledged_steps() -> Result {
    let steps: Vec<GradientCheckpoint> = (0..6).map(common::deterministic).collect();
    let mut cuts = 0;
    let configs = [
        (true, 64 << 20),
        (false, 64 << 20),
        (true, 1 << 20),
        (false, 1 << 20),
    ];
    for shared in configs {
        // A store with two steps, then four more commits: how many calls?
        let base = Disk::from_bytes(Vec::new());
        {
            let store = open(&base, shared)?;
            store.commit(&steps[0])?;
            store.commit(&steps[1])?;
        }
        let base_image = base.image();
        let probe = Disk::from_bytes(base_image.clone());
        let start;
        {
            let store = open(&probe, shared)?;
            start = probe.calls();
            for c in &steps[2..] {
                store.commit(c)?;
            }
        }
        let total = probe.calls() - start;

        let stride = if std::env::var_os("CKPT_LONG").is_some() {
            1
        } else {
            (total / 30).max(1)
        };
        for seed in [0u64, 0x9E37_79B9, 0xDEAD_BEEF] {
            let mut at = 0;
            while at <= total {
                let ctx = format!(
                    "(shared, cache)={shared:?} seed={seed:#x} cut at call {at} of {total}"
                );
                let disk = Disk::from_bytes(base_image.clone());
                let store = open(&disk, shared)?;
                disk.plan_cut(disk.calls() + at, seed);
                let mut acked = vec![0, 1];
                for c in &steps[2..] {
                    store.commit(c)?;
                    if disk.cut_image().is_none() {
                        acked.push(c.step);
                    }
                }
                drop(store);
                let image = disk.cut_image().unwrap_or_else(|| disk.image());
                cuts += 1;

                let after = Disk::from_bytes(image);
                let store =
                    open(&after, shared).map_err(|e| format!("{ctx}: reopen failed: {e}"))?;
                let found = store.steps()?;
                let next = acked.last().map_or(0, |s| s + 1);
                assert!(
                    found == acked
                        || (found.len() == acked.len() + 1 && found.last() == Some(&next)),
                    "{ctx}: acknowledged {acked:?}, found {found:?}"
                );
                for &s in &found {
                    assert!(
                        store.get(s)?.as_ref() == Some(&steps[s as usize]),
                        "{ctx}: step {s} differs"
                    );
                }
                let report = store.verify()?;
                assert!(report.is_ok(), "{ctx}: {report:?}");
                assert_eq!(
                    report.staged_chunks, 0,
                    "{ctx}: staged chunks outlived the cut"
                );
                // The store takes new commits after the cut.
                let resume = found.last().map_or(0, |s| s + 1) as usize;
                if resume < steps.len() {
                    store.commit(&steps[resume])?;
                }
                at += stride;
            }
        }
    }
    println!("{cuts} power cuts, no acknowledged step lost");
    Ok(())
}
