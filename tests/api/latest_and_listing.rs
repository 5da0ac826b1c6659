//! Steps may arrive in any order: `latest` is the highest, listings are
//! ascending numerically, ranges select by step.

use crate::common;

use ckptstore::CheckpointStore;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn latest_is_the_highest_step_and_listing_is_numeric() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    assert_eq!(store.latest()?, None);
    assert_eq!(store.latest_step()?, None);
    assert!(store.steps()?.is_empty());

    let mut committed = std::collections::HashMap::new();
    for step in [10_000u64, 9_000, 2, 100_000, 50, 0] {
        let ckpt = common::checkpoint(step, &[64])?;
        store.commit(&ckpt)?;
        committed.insert(step, ckpt);
    }
    assert_eq!(store.steps()?, vec![0, 2, 50, 9_000, 10_000, 100_000]);
    assert_eq!(store.latest_step()?, Some(100_000));
    assert_eq!(store.latest()?.as_ref(), committed.get(&100_000));

    assert_eq!(store.steps_in(50..10_000)?, vec![50, 9_000]);
    assert_eq!(store.steps_in(9_001..)?, vec![10_000, 100_000]);
    assert_eq!(store.steps_in(..=2)?, vec![0, 2]);
    assert!(store.steps_in(3..50)?.is_empty());

    store.commit(&common::checkpoint(u64::MAX, &[1])?)?;
    assert_eq!(store.latest_step()?, Some(u64::MAX));
    Ok(())
}
