//! The CLI reads a store while a training process holds it open for
//! writing, and says clearly when it cannot write to it.

use crate::common;

use ckptstore::{CheckpointStore, StoreOptions};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn cli_reads_a_store_another_process_is_writing() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("live.ckpt");
    let p = path.to_str().ok_or("path")?;
    // This test process is the "training run" and keeps the store open.
    let store = CheckpointStore::open(&path)?;
    for step in 0..3 {
        store.commit(&common::deterministic(step))?;
        let (code, out, err) = common::ckpt(&["ls", p])?;
        assert_eq!(code, 0, "{err}");
        assert!(out.contains(&format!("{} steps", step + 1)), "{out}");
    }
    let (code, out, _) = common::ckpt(&["verify", p])?;
    assert_eq!(code, 0, "{out}");
    // Writing needs the writer's lock: a clear refusal, nothing changed.
    let (code, _, err) = common::ckpt(&["rm", p, "0"])?;
    assert_eq!(code, 1);
    assert!(err.contains("open by another process"), "{err}");
    assert_eq!(store.steps()?, vec![0, 1, 2]);
    drop(store);

    // An exclusive writer shuts readers out: said clearly.
    let exclusive = StoreOptions::new().shared(false).open(&path)?;
    let (code, _, err) = common::ckpt(&["ls", p])?;
    assert_eq!(code, 1);
    assert!(err.contains("open by another process"), "{err}");
    drop(exclusive);
    assert_eq!(common::ckpt(&["ls", p])?.0, 0);
    Ok(())
}
