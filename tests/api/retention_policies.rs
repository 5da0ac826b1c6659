//! Retention: each policy through the store, applied with commits and on
//! demand, pins respected, chunks freed in the same transaction.

use crate::common;

use std::time::Duration;

use ckptstore::{CheckpointStore, Error, Goal, GradientCheckpoint, Retention, StoreOptions};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

fn ckpt(step: u64, loss: f64) -> GradientCheckpoint {
    let mut c = common::deterministic(step).with_metric("loss", loss);
    c.timestamp = 1_000_000 + step * 600; // one step every ten minutes
    c
}

#[test]
fn keep_last_runs_with_every_commit_and_frees_chunks() -> Result {
    let dir = tempfile::tempdir()?;
    let store = StoreOptions::new()
        .retention(Retention::new().keep_last(3))
        .open(dir.path().join("run.ckpt"))?;
    for step in 0..10 {
        let info = store.commit(&ckpt(step, 1.0))?;
        let expect_removed: Vec<u64> = if step >= 3 { vec![step - 3] } else { vec![] };
        assert_eq!(info.removed, expect_removed, "step {step}");
        assert_eq!(
            store.steps()?,
            (step.saturating_sub(2)..=step).collect::<Vec<_>>()
        );
    }
    // The frozen blob is shared by every step: stored once.
    let stats = store.stats()?;
    assert_eq!(stats.steps, 3);
    let moving: u64 = (7..10)
        .map(|s| common::deterministic(s).optimizer_state["moving"].len() as u64)
        .sum();
    assert_eq!(stats.stored_bytes, moving + 300_000);
    let report = store.verify()?;
    assert!(
        report.is_ok(),
        "{:?} {:?}",
        report.damaged,
        report.accounting
    );
    Ok(())
}

#[test]
fn every_policy_and_pins_on_demand() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    // Loss is lowest at step 13.
    for step in 0..30u64 {
        store.commit(&ckpt(step, ((step as f64) - 13.0).abs()))?;
    }
    assert!(store.pin(1)?);
    assert!(!store.pin(1)?);
    assert!(matches!(
        store.pin(999),
        Err(Error::StepNotFound { step: 999 })
    ));
    assert_eq!(store.pinned()?, vec![1]);

    // Pinned steps refuse removal and rollback past them.
    assert!(matches!(
        store.remove(1),
        Err(Error::StepPinned { step: 1, .. })
    ));
    assert!(matches!(
        store.rollback_to(0),
        Err(Error::StepPinned { step: 1, .. })
    ));
    assert_eq!(store.steps()?.len(), 30);

    assert!(
        store.apply_retention(&Retention::new())?.is_empty(),
        "an empty policy deleted"
    );

    // One per hour: 6 steps an hour; the last of each hour bucket survives.
    let removed = store.apply_retention(
        &Retention::new()
            .keep_one_per(Duration::from_secs(3600))
            .keep_every(10)
            .keep_best("loss", 2, Goal::Minimize)
            .keep_last(2),
    )?;
    let kept = store.steps()?;
    assert!(kept.iter().all(|s| !removed.contains(s)));
    // Hour buckets of the timestamps: {0,1} {2..=7} {8..=13} {14..=19}
    // {20..=25} {26..=29}, last of each: 1 7 13 19 25 29. Every 10th: 0 10
    // 20. Best two losses: 13 (0), then 12 and 14 tie at 1 and the newer
    // wins: 14. Last two: 28 29. Pinned: 1.
    let want = vec![0, 1, 7, 10, 13, 14, 19, 20, 25, 28, 29];
    assert_eq!(kept, want, "removed {removed:?}");
    assert_eq!(store.best_step("loss", Goal::Minimize)?, Some(13));

    assert!(store.unpin(1)?);
    assert!(store.remove(1)?);
    let report = store.verify()?;
    assert!(
        report.is_ok(),
        "{:?} {:?}",
        report.damaged,
        report.accounting
    );
    Ok(())
}
