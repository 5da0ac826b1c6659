//! `StoreOptions`: contradictory options are refused; each option works.

use crate::common;

use ckptstore::{CheckpointStore, Durability, Error, StoreOptions};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn options_are_checked_and_honoured() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");

    // Readers in other processes see only durable commits.
    let err = StoreOptions::new()
        .durability(Durability::Eventual)
        .open(&path)
        .expect_err("eventual + shared accepted");
    assert!(matches!(err, Error::InvalidOptions(_)), "{err:?}");
    assert!(!path.exists(), "a refused open created the file");

    {
        let store = StoreOptions::new()
            .shared(false)
            .durability(Durability::Eventual)
            .cache_size(1 << 20)
            .async_queue_depth(0) // clamps to 1
            .open(&path)?;
        for step in 0..5 {
            store.commit(&common::deterministic(step))?;
        }
        store.commit_async(common::deterministic(5))?.wait()?;
        // An exclusive store shuts out readers in other processes; in this
        // process the lock is already held, so a second open is refused too.
        assert!(CheckpointStore::open_read_only(&path).is_err());
    }
    // After a clean close, non-durable commits are on disk too.
    let store = StoreOptions::new().check_integrity(true).open(&path)?;
    assert_eq!(store.steps()?, (0..6).collect::<Vec<_>>());
    assert!(store.verify()?.is_ok());
    Ok(())
}
