//! A commit with more chunk bytes than 3/8 of the cache writes its
//! chunks in transactions of its own first ("staging") and is still one
//! step, whole or absent: round trips, deduplication and its accounting,
//! replace, and a refused duplicate that leaves nothing staged behind.

use crate::common;

use ckptstore::{Error, StoreOptions};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn staged_commits_behave_like_any_commit() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    // A 1 MiB cache: anything over 384 KiB of chunks is staged.
    let store = StoreOptions::new().cache_size(1 << 20).open(&path)?;

    // 4 MiB of new chunks, plus a blob that repeats one of them.
    let mut first = common::checkpoint(1, &[3 << 20, 1 << 20, 100])?;
    let repeated = first.optimizer_state["param_1"].clone();
    first.set_optimizer_state("param_3", repeated);
    let info = store.commit(&first)?;
    assert_eq!(info.bytes_written, (4 << 20) + 100);
    assert_eq!(info.bytes_reused, 1 << 20);
    assert_eq!(store.get(1)?, Some(first.clone()));

    // A refused duplicate writes nothing, stages nothing.
    let before = store.stats()?;
    let err = store
        .commit(&common::checkpoint(1, &[2 << 20])?)
        .expect_err("step 1 committed twice");
    assert!(matches!(err, Error::StepExists { step: 1 }), "{err:?}");
    assert_eq!(store.stats()?.stored_bytes, before.stored_bytes);
    let report = store.verify()?;
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.staged_chunks, 0);

    // Replace: the new version's chunks are staged, the old ones freed.
    // (Contents from seed 7: seed 1's would share chunks with `first`.)
    let mut second = common::checkpoint(7, &[2 << 20, 2 << 20])?;
    second.step = 1;
    let info = store.replace(&second)?;
    assert_eq!(info.bytes_written, 4 << 20);
    assert_eq!(info.bytes_freed, (4 << 20) + 100);
    assert_eq!(store.get(1)?, Some(second.clone()));

    // A later step sharing one blob stages only the other.
    let mut third = common::checkpoint(9, &[1 << 20])?;
    third.step = 2;
    third.set_optimizer_state("shared", second.optimizer_state["param_0"].clone());
    let info = store.commit(&third)?;
    assert_eq!(info.bytes_reused, 2 << 20);
    assert_eq!(info.bytes_written, 1 << 20);

    let report = store.verify()?;
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.staged_chunks, 0);
    assert_eq!(report.steps_ok, 2);
    drop(store);

    // The default cache reads the same store.
    let store = StoreOptions::new().open(&path)?;
    assert_eq!(store.get(1)?, Some(second));
    assert_eq!(store.get(2)?, Some(third));
    Ok(())
}

#[test]
fn staged_commits_work_in_the_background_and_without_fsync() -> Result {
    let dir = tempfile::tempdir()?;
    for (name, options) in [
        ("shared", StoreOptions::new()),
        (
            "eventual",
            StoreOptions::new()
                .shared(false)
                .durability(ckptstore::Durability::Eventual),
        ),
    ] {
        let path = dir.path().join(format!("{name}.ckpt"));
        let store = options.cache_size(1 << 20).open(&path)?;
        let mut state = common::checkpoint(1, &[3 << 20, 700_000])?;
        let mut handles = Vec::new();
        let mut expected = Vec::new();
        for step in 1..=4 {
            state.step = step;
            if let Some(blob) = state.optimizer_state.get_mut("param_0") {
                blob[..8].copy_from_slice(&step.to_le_bytes());
            }
            expected.push(state.clone());
            handles.push(store.commit_async_copy(&state)?);
        }
        for h in handles {
            h.wait()?;
        }
        for want in &expected {
            assert_eq!(store.get(want.step)?.as_ref(), Some(want), "{name}");
        }
        let report = store.verify()?;
        assert!(report.is_ok(), "{name}: {report:?}");
        assert_eq!(report.staged_chunks, 0, "{name}");
    }
    Ok(())
}
