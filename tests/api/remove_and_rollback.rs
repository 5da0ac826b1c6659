//! `remove` drops one step, `rollback_to` every step after N, each in one
//! transaction, freeing chunks no other step uses.

use crate::common;

use ckptstore::CheckpointStore;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn remove_and_rollback_drop_steps_and_keep_the_rest_intact() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = CheckpointStore::open(&path)?;
    let mut kept = Vec::new();
    for step in 1..=8u64 {
        let mut ckpt = common::checkpoint(step, &[3000, 70_000])?;
        // Every step shares one frozen blob.
        ckpt.set_optimizer_state("frozen", common::bytes(42, 2 << 20));
        store.commit(&ckpt)?;
        kept.push(ckpt);
    }
    assert!(store.remove(4)?);
    assert!(
        !store.remove(4)?,
        "removing twice reports the step as stored"
    );
    assert!(!store.remove(1234)?);
    assert_eq!(store.rollback_to(6)?, vec![7, 8]);
    assert!(store.rollback_to(6)?.is_empty());
    assert_eq!(store.rollback_to(u64::MAX)?, Vec::<u64>::new());
    assert_eq!(store.steps()?, vec![1, 2, 3, 5, 6]);
    assert_eq!(store.latest_step()?, Some(6));
    drop(store);

    let store = CheckpointStore::open(&path)?;
    for ckpt in kept.iter().filter(|c| [1, 2, 3, 5, 6].contains(&c.step)) {
        assert_eq!(store.get(ckpt.step)?.as_ref(), Some(ckpt));
    }
    assert_eq!(store.get(7)?, None);
    let report = store.verify()?;
    assert!(report.is_ok(), "{:?}", report.damaged);

    // Removing everything, then committing the shared blob again, writes it
    // anew: its chunks were freed with the last step that used it.
    assert_eq!(store.rollback_to(0)?, vec![1, 2, 3, 5, 6]);
    let info = store.commit(&kept[0])?;
    assert_eq!(info.bytes_reused, 0, "chunks survived their last step");
    Ok(())
}
