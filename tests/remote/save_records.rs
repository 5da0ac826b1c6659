//! A step's save record travels to the bucket and back: push and pull,
//! a sharded step's shards, the bucket's listing and its step info; a
//! bucket step 0.4.0 wrote, which kept the record among its metrics, reads
//! as a record.

use ckptstore::{CheckpointStore, Remote};

use crate::common;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

use common::{recorded, save_record as record};

#[test]
fn push_and_pull_keep_a_steps_save_record() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("a.ckpt"))?;
    store.commit(&recorded(1)?)?;
    let remote = Remote::open(&format!("file://{}/bucket", dir.path().display()))?;
    remote.push(&store)?;

    assert_eq!(remote.info(1)?.ok_or("info")?.save_record, record());
    let listed = remote.summaries()?;
    assert_eq!(listed[0].save_record, record());
    assert_eq!(listed[0].metrics.keys().collect::<Vec<_>>(), ["loss"]);
    let other = CheckpointStore::open(dir.path().join("b.ckpt"))?;
    remote.pull(1, &other)?;
    assert_eq!(other.get(1)?.ok_or("pulled")?.save_record, record());
    Ok(())
}

#[test]
fn a_sharded_step_keeps_its_first_ranks_record() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = Remote::open(&format!("file://{}/bucket", dir.path().display()))?;
    let mut names = Vec::new();
    for rank in 0..2 {
        let mut shard = common::checkpoint(2, &[1000])?;
        if rank == 0 {
            shard.save_record = record();
        }
        names.push(remote.upload_shard(2, rank, 2, &shard.into_step())?.shard);
    }
    remote.commit_global(2, &names)?;
    let listed = remote.summaries()?;
    assert_eq!(listed[0].save_record, record());
    assert_eq!(
        remote.get_shard(2, 0)?.ok_or("rank 0")?.save_record,
        record()
    );
    assert!(remote
        .get_shard(2, 1)?
        .ok_or("rank 1")?
        .save_record
        .is_empty());

    // A shard as 0.4.0 wrote it (its record among its metrics) reads as
    // recorded: src/remote/global/legacy_metrics.rs.
    Ok(())
}
