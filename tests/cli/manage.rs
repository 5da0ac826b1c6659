//! `ckpt rm`, `gc` (with --dry-run) and `compact`.

use crate::common;

use ckptstore::CheckpointStore;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn rm_gc_and_compact_change_the_store() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let p = path.to_str().ok_or("path")?;
    {
        let store = CheckpointStore::open(&path)?;
        for step in 0..12 {
            store.commit(&common::deterministic(step))?;
        }
    }
    let (code, out, err) = common::ckpt(&["rm", p, "3", "4"])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("removed step 3") && out.contains("removed step 4"));
    let (code, _, err) = common::ckpt(&["rm", p, "3"])?;
    assert_eq!(code, 1);
    assert!(err.contains("step 3 is not in the store"), "{err}");

    let (code, out, _) = common::ckpt(&[
        "gc",
        p,
        "--keep-last",
        "2",
        "--keep-every",
        "5",
        "--dry-run",
    ])?;
    assert_eq!(code, 0);
    assert!(
        out.contains("would remove 6 steps: [1, 2, 6, 7, 8, 9]"),
        "{out}"
    );
    assert_eq!(CheckpointStore::open_read_only(&path)?.steps()?.len(), 10);
    let (code, out, _) = common::ckpt(&[
        "gc",
        p,
        "--keep-last",
        "2",
        "--keep-every",
        "5",
        "--keep-best",
        "loss:1:max",
    ])?;
    assert_eq!(code, 0);
    // Loss 1/(1+step) is highest at step 0, which keep-every keeps anyway.
    assert!(out.contains("removed 6 steps"), "{out}");
    assert_eq!(
        CheckpointStore::open_read_only(&path)?.steps()?,
        vec![0, 5, 10, 11]
    );

    let (code, _, err) = common::ckpt(&["gc", p])?;
    assert_eq!(code, 1);
    assert!(err.contains("at least one --keep"), "{err}");
    let (code, _, err) = common::ckpt(&["gc", p, "--keep-best", "loss:x:min"])?;
    assert_eq!(code, 1);
    assert!(err.contains("METRIC:K:min"), "{err}");

    let before = std::fs::metadata(&path)?.len();
    let (code, out, err) = common::ckpt(&["compact", p])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("compacted"), "{out}");
    assert!(std::fs::metadata(&path)?.len() <= before);
    let store = CheckpointStore::open_read_only(&path)?;
    assert!(store.verify()?.is_ok());
    assert!(store.get(11)? == Some(common::deterministic(11)));
    Ok(())
}

#[test]
fn cp_copies_the_store_with_its_pack_files() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let to = dir.path().join("copy.ckpt");
    let (p, t) = (path.to_str().ok_or("path")?, to.to_str().ok_or("path")?);
    {
        let store = CheckpointStore::open(&path)?;
        store.commit(&common::checkpoint(1, &[6 << 20])?)?; // packed
        store.commit(&common::deterministic(2))?;
    }
    let (code, out, err) = common::ckpt(&["cp", p, t])?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("copied 2 steps"), "{out}");
    let (original, copy) = (
        CheckpointStore::open_read_only(&path)?,
        CheckpointStore::open_read_only(&to)?,
    );
    assert_eq!(copy.get(1)?, original.get(1)?);
    assert_eq!(copy.get(2)?, original.get(2)?);
    assert_eq!(common::pack_files(&to).len(), 1);
    let (code, _, err) = common::ckpt(&["cp", p, t])?;
    assert_eq!(code, 1);
    assert!(err.contains("copy.ckpt"), "{err}");
    Ok(())
}
