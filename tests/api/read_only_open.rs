//! A read-only store reads every step and refuses every write.

use crate::common;

use ckptstore::{CheckpointStore, Error};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn read_only_store_reads_and_refuses_writes() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let missing = dir.path().join("missing.ckpt");
    assert!(CheckpointStore::open_read_only(&missing).is_err());
    assert!(!missing.exists(), "read-only open created a file");

    let ckpt = common::checkpoint(5, &[100_000])?;
    CheckpointStore::open(&path)?.commit(&ckpt)?;

    let reader = CheckpointStore::open_read_only(&path)?;
    assert!(reader.is_read_only());
    assert_eq!(reader.latest()?.as_ref(), Some(&ckpt));
    for e in [
        reader.commit(&common::checkpoint(6, &[1])?).err(),
        reader.remove(5).err(),
        reader.rollback_to(0).err(),
    ] {
        assert!(matches!(e, Some(Error::ReadOnly { .. })), "{e:?}");
    }
    assert_eq!(reader.steps()?, vec![5]);
    Ok(())
}
