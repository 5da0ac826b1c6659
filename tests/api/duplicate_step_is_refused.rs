//! Committing a stored step (or an unstorable one) fails clearly and
//! changes nothing; `replace` overwrites a step.

use crate::common;

use ckptstore::{CheckpointStore, Error};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn second_commit_of_a_step_fails_and_replace_overwrites() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let first = common::checkpoint(3, &[100_000, 200_000])?;
    store.commit(&first)?;

    let mut second = common::checkpoint(3, &[500_000])?;
    second.loss_cid = Some("cid_other".into());
    let err = store.commit(&second).expect_err("duplicate step accepted");
    assert!(matches!(err, Error::StepExists { step: 3 }), "{err:?}");
    assert!(err.to_string().contains("step 3"), "{err}");
    assert_eq!(
        store.get(3)?.as_ref(),
        Some(&first),
        "failed commit changed the step"
    );

    let info = store.replace(&second)?;
    assert_eq!(info.bytes_freed, 300_000, "old blobs not freed");
    assert_eq!(store.get(3)?.as_ref(), Some(&second));
    assert_eq!(store.steps()?, vec![3]);

    // Replacing with itself keeps every chunk (added before released).
    let again = store.replace(&second)?;
    assert_eq!(again.bytes_written, 0);
    assert_eq!(again.bytes_reused, 500_000);
    assert_eq!(store.get(3)?.as_ref(), Some(&second));
    assert!(store.verify()?.is_ok());

    // Small blobs are packed per step, not chunked: replacing rewrites them
    // and frees the old ones.
    let small = common::checkpoint(3, &[10, 20])?;
    let info = store.replace(&small)?;
    assert_eq!((info.bytes_written, info.bytes_freed), (30, 500_000));
    let info = store.replace(&small)?;
    assert_eq!((info.bytes_written, info.bytes_freed), (30, 30));
    assert_eq!(store.get(3)?.as_ref(), Some(&small));
    assert_eq!(store.stats()?.stored_bytes, 30);
    assert!(store.verify()?.is_ok());

    // A checkpoint JSON cannot represent (a NaN metric) is refused whole.
    let bad = common::checkpoint(4, &[10])?.with_metric("loss", f64::NAN);
    let err = store.commit(&bad).expect_err("NaN metric accepted");
    assert!(
        matches!(err, Error::InvalidCheckpoint { step: 4, .. }),
        "{err:?}"
    );
    assert_eq!(store.steps()?, vec![3]);
    Ok(())
}
