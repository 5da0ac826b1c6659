//! A shard 0.4.0 wrote kept its save record among its metrics (a staged
//! save's `ckptstore.staging_s` and `ckptstore.blocked_s`, Lightning's
//! `lightning:<name>` = 1.0): it reads as if it had been recorded so. An
//! upload now refuses those metric names, so the shard is written here as
//! 0.4.0's upload wrote it: without the check.

use crate::checkpoint::legacy::{record, step_0_4_0};
use crate::engine::plan::Plan;
use crate::remote::global::shards::ShardUpload;
use crate::Remote;

#[test]
fn a_shard_0_4_0_wrote_reads_its_metrics_as_its_record() -> crate::Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let remote = Remote::open(&format!("file://{}/bucket", dir.path().display()))?;
    let old = step_0_4_0(3);
    let plan = Plan::new(&old);
    let coordinator = remote.coordinator();
    coordinator.with_push_lock(|lock| {
        coordinator.put_shard(3, 0, 1, &plan, lock, &ShardUpload::Complete)
    })?;
    let back = remote.get_shard(3, 0)?.expect("step 3");
    assert_eq!(back.save_record, record());
    assert_eq!(back.metrics.keys().collect::<Vec<_>>(), ["loss"]);
    assert_eq!(remote.summaries()?[0].save_record, record());
    // A new upload of such metrics is refused.
    let err = remote
        .commit_shard(4, 0, 1, &step_0_4_0(4).into_step())
        .expect_err("reserved names");
    assert!(
        matches!(&err, crate::Error::InvalidCheckpoint { step: 4, reason } if reason.contains("ckptstore.")),
        "{err}"
    );
    Ok(())
}
