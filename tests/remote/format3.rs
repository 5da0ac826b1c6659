//! The fixture `tests/fixtures/bucket-0.4.0` (bucket format 3: packs),
//! written by this release's code before the bucket's model moves to
//! types: every later build reads it as it was written.
//!
//! Written by `write_the_format3_fixture` (ignored; run it with
//! `CKPT_WRITE_FIXTURE=$PWD/tests/fixtures/bucket-0.4.0 cargo test --test
//! remote format3::write -- --ignored`): steps 1-3 pushed from a store,
//! step 3 committed and pushed again with other metrics (two commits of
//! one step: the newer is the step), step 1 deleted by retention (its
//! `deleted/` markers), and a global step 5 of 2 ranks (shards uploaded,
//! the coordinator's commit).

use std::path::Path;

use ckptstore::{
    CheckpointStore, ComputationGraphStore, ComputationNode, Dtype, GradientCheckpoint, Remote,
    Retention, Tensor,
};

use super::promise::{copy_dir, fixture_step};
use super::Result;

const FIXTURE: &str = "tests/fixtures/bucket-0.4.0";

/// Step `step` of the fixture: 0.3.0's fixture's, its node id fixed (so
/// that a store made again holds the very steps pushed).
fn step(step: u64) -> Result<GradientCheckpoint> {
    let mut c = fixture_step(step)?;
    let mut g = ComputationGraphStore::new();
    let mut node = ComputationNode::new("matmul", vec!["cid_x".into()]);
    node.id = format!("node-{step}");
    let id = g.add_node(node);
    g.record_output(&id, format!("cid_y_{step}"))?;
    c.graph = g;
    Ok(c)
}

/// Step 3 as committed the second time.
fn redone_three() -> Result<GradientCheckpoint> {
    let mut three = step(3)?;
    three.metrics.insert("loss".into(), 0.25);
    Ok(three)
}

/// Rank `rank`'s shard of global step 5.
fn shard(rank: u32) -> Result<GradientCheckpoint> {
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 5);
    c.timestamp = 1_700_000_005;
    c.set_optimizer_state(
        "params",
        (0..66_000u32)
            .map(|i| (i % 241) as u8 ^ rank as u8)
            .collect(),
    );
    c.set_tensor(
        "bias",
        Tensor::new(Dtype::F32, vec![2], vec![rank as u8; 8])?,
    );
    Ok(c)
}

#[test]
#[ignore = "writes the fixture: run by hand (see the module's comment)"]
fn write_the_format3_fixture() -> Result {
    let out = std::env::var("CKPT_WRITE_FIXTURE")?;
    let work = tempfile::tempdir()?;
    let store = CheckpointStore::open(work.path().join("run.ckpt"))?;
    let remote = Remote::open(&format!("file://{out}"))?;
    for n in 1..=3 {
        store.commit(&step(n)?)?;
    }
    remote.push(&store)?;
    store.replace(&redone_three()?)?;
    assert_eq!(remote.push(&store)?.steps_pushed, vec![3]);
    assert_eq!(
        remote.apply_retention(&Retention::new().keep_last(2))?,
        vec![1]
    );
    let names = (0..2)
        .map(|rank| {
            Ok(remote
                .upload_shard(5, rank, 2, &shard(rank)?.into_step())?
                .shard)
        })
        .collect::<Result<Vec<_>>>()?;
    remote.commit_global(5, &names)?;
    // The store's id is the bucket's owner: kept beside the fixture.
    std::fs::write(Path::new(&out).join("owner.txt"), store.store_id()?)?;
    Ok(())
}

#[test]
fn a_format3_bucket_of_0_4_0_still_reads() -> Result {
    let dir = tempfile::tempdir()?;
    let bucket = dir.path().join("bucket");
    copy_dir(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE),
        &bucket,
    )?;
    let remote = Remote::open(&format!("file://{}", bucket.display()))?;
    assert_eq!(remote.steps()?, vec![2, 3, 5]);
    let owner = std::fs::read_to_string(bucket.join("owner.txt"))?;
    assert_eq!(remote.owner()?, Some(owner));
    assert!(remote.get(2)? == Some(step(2)?));
    assert!(remote.get(3)? == Some(redone_three()?));
    assert_eq!(remote.world_size(5)?, Some(2));
    for rank in 0..2 {
        assert!(
            remote.get_shard(5, rank)? == Some(shard(rank)?.into_step()),
            "rank {rank}"
        );
    }
    let verified = remote.verify()?;
    assert!(verified.is_ok() && verified.steps_ok == 3, "{verified:?}");
    // A store holding steps 1-3 as they were pushed uploads nothing: step
    // 1 stays deleted, 2 and 3 are there.
    let store = CheckpointStore::open(dir.path().join("again.ckpt"))?;
    for c in [step(1)?, step(2)?, redone_three()?] {
        store.commit(&c)?;
    }
    remote.adopt(&store)?;
    let report = remote.push(&store)?;
    assert!(report.steps_pushed.is_empty(), "{report:?}");
    assert_eq!(remote.steps()?, vec![2, 3, 5]);
    Ok(())
}
