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

/// Commits record redb's allocator state and commit in two phases (quick
/// repair), with a sync between them: a cut just before, at and after each
/// sync of a commit leaves the step whole or absent, and a store that opens
/// quickly and takes new commits.
#[test]
fn power_cut_between_the_syncs_of_a_two_phase_commit() -> Result {
    let steps: Vec<GradientCheckpoint> = (0..4).map(common::deterministic).collect();
    for config in [(true, 64 << 20), (false, 64 << 20), (true, 1 << 20)] {
        let base = Disk::from_bytes(Vec::new());
        {
            let store = open(&base, config)?;
            store.commit(&steps[0])?;
        }
        let base_image = base.image();
        let probe = Disk::from_bytes(base_image.clone());
        let (first, syncs) = {
            let store = open(&probe, config)?;
            let first = probe.calls();
            store.commit(&steps[1])?;
            let syncs: Vec<u64> = probe
                .sync_calls()
                .into_iter()
                .filter(|&c| c >= first)
                .collect();
            (first, syncs)
        };
        // A durable commit of one transaction syncs twice (two-phase);
        // staged commits sync once per part more.
        assert!(
            syncs.len() >= 2,
            "{config:?}: {} syncs in a commit",
            syncs.len()
        );
        for &sync in &syncs {
            for at in [sync, sync + 1] {
                for seed in [0u64, 0x5EED] {
                    let ctx = format!(
                        "{config:?}: cut at call {} (sync at {}), seed {seed:#x}",
                        at - first,
                        sync - first
                    );
                    let disk = Disk::from_bytes(base_image.clone());
                    let store = open(&disk, config)?;
                    disk.plan_cut(disk.calls() + (at - first), seed);
                    store.commit(&steps[1])?;
                    drop(store);
                    let image = disk.cut_image().ok_or_else(|| format!("{ctx}: no cut"))?;
                    let store = open(&Disk::from_bytes(image), config)
                        .map_err(|e| format!("{ctx}: reopen failed: {e}"))?;
                    let found = store.steps()?;
                    assert!(found == [0] || found == [0, 1], "{ctx}: found {found:?}");
                    for &s in &found {
                        assert!(
                            store.get(s)?.as_ref() == Some(&steps[s as usize]),
                            "{ctx}: step {s} differs"
                        );
                    }
                    assert!(store.verify()?.is_ok(), "{ctx}");
                    store.commit(&steps[2])?;
                }
            }
        }
    }
    Ok(())
}
