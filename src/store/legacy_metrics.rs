//! A step 0.4.0 wrote kept its save record among its metrics (a staged
//! save's `ckptstore.staging_s` and `ckptstore.blocked_s`, Lightning's
//! `lightning:<name>` = 1.0): it reads as if it had been recorded so. A
//! commit now refuses those metric names, so the step is written here as
//! 0.4.0's commit wrote it: through the engine, without the check.

use crate::checkpoint::legacy::{record, step_0_4_0};
use crate::db::TxnKind;
use crate::engine::plan::Plan;
use crate::{CheckpointStore, GradientCheckpoint, Retention};

/// Commit `ckpt` as 0.4.0 did: its metrics unchecked.
fn commit_as_0_4_0(store: &CheckpointStore, ckpt: &GradientCheckpoint) -> crate::Result<()> {
    let plan = Plan::new(ckpt);
    let mut hashes = plan.pieces.iter().map(|p| *blake3::hash(p).as_bytes());
    let what = || format!("committing step {}", ckpt.step);
    store.db.write("commit", &what, TxnKind::Whole, |engine| {
        engine
            .put(&plan, &mut hashes, false, &Retention::default())
            .map(drop)
    })
}

#[test]
fn a_step_0_4_0_wrote_reads_its_metrics_as_its_record() -> crate::Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = CheckpointStore::open(dir.path().join("s.ckpt"))?;
    let old = step_0_4_0(3).with_metric("lightning:gone.ckpt", 1.0);
    commit_as_0_4_0(&store, &old)?;

    let back = store.get(3)?.expect("step 3");
    assert_eq!(back.save_record, record());
    let left: Vec<&str> = back.metrics.keys().map(String::as_str).collect();
    // A name that is not one of the step's blobs is a run's own metric.
    assert_eq!(left, ["lightning:gone.ckpt", "loss"]);
    assert_eq!(store.info(3)?.expect("info").save_record, record());
    let summary = &store.summaries(..)?[0];
    assert_eq!(summary.save_record.staging, record().staging);

    // Written back, the step is in the current form and reads the same.
    store.replace(&back)?;
    assert!(store.get(3)?.expect("step 3") == back);
    assert_eq!(store.summaries(..)?[0].save_record, record());
    Ok(())
}
