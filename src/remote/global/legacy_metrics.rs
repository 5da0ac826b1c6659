//! A shard 0.4.0 wrote kept its save record among its metrics (a staged
//! save's `ckptstore.staging_s` and `ckptstore.blocked_s`, Lightning's
//! `lightning:<name>` = 1.0): it reads as if it had been recorded so. An
//! upload now refuses those metric names, so the shard is written here as
//! 0.4.0's upload wrote it: without the check.

use crate::engine::plan::Plan;
use crate::remote::global::shards::ShardUpload;
use crate::{ComputationGraphStore, GradientCheckpoint, Remote, SaveRecord, Staging};

#[test]
fn a_shard_0_4_0_wrote_reads_its_metrics_as_its_record() -> crate::Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let remote = Remote::open(&format!("file://{}/bucket", dir.path().display()))?;
    let mut old = GradientCheckpoint::new(ComputationGraphStore::new(), 3)
        .with_metric("loss", 0.25)
        .with_metric("ckptstore.staging_s", 0.75)
        .with_metric("ckptstore.blocked_s", 0.125)
        .with_metric("lightning:checkpoints/last.ckpt", 1.0);
    old.set_optimizer_state("w", vec![7; 64]);
    old.set_optimizer_state("lightning:checkpoints/last.ckpt", b"{}".to_vec());
    let plan = Plan::new(&old);
    let coordinator = remote.coordinator();
    coordinator.with_push_lock(|lock| {
        coordinator.put_shard(3, 0, 1, &plan, lock, ShardUpload::Complete)
    })?;
    let record = SaveRecord::default()
        .with_staging(Staging::new(0.75, 0.125).expect("finite"))
        .with_name("lightning:checkpoints/last.ckpt");
    let back = remote.get_shard(3, 0)?.expect("step 3");
    assert_eq!(back.save_record, record);
    assert_eq!(back.metrics.keys().collect::<Vec<_>>(), ["loss"]);
    assert_eq!(remote.summaries()?[0].save_record, record);
    // A new upload of such metrics is refused.
    let err = remote
        .commit_shard(4, 0, 1, &old)
        .expect_err("reserved names");
    assert!(
        matches!(err, crate::Error::InvalidCheckpoint { step: 4, .. }),
        "{err}"
    );
    Ok(())
}
