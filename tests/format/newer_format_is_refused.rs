//! A store or a manifest written by a newer format version is refused with
//! an error that names both versions, and the file is left as it was.

use crate::common;

use ckptstore::{CheckpointStore, Error};
use redb::ReadableDatabase;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");
const STEPS: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("steps");

#[test]
fn store_of_a_newer_format_is_refused() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("future.ckpt");
    CheckpointStore::open(&path)?.commit(&common::checkpoint(1, &[10])?)?;
    {
        let db = redb::Database::open(&path)?;
        let txn = db.begin_write()?;
        txn.open_table(META)?
            .insert("format_version", 99u32.to_le_bytes().as_slice())?;
        txn.commit()?;
    }
    for result in [
        CheckpointStore::open(&path),
        CheckpointStore::open_read_only(&path),
    ] {
        let e = result.expect_err("newer store opened");
        assert!(
            matches!(
                e,
                Error::UnsupportedFormat {
                    found: 99,
                    supported: 6,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("99"), "{e}");
    }
    // The refusal wrote nothing of ours: the version and the step are as they were.
    let db = redb::Database::open(&path)?;
    let txn = db.begin_read()?;
    let version = txn
        .open_table(META)?
        .get("format_version")?
        .map(|v| v.value().to_vec());
    assert_eq!(version, Some(99u32.to_le_bytes().to_vec()));
    assert!(txn.open_table(STEPS)?.get(1)?.is_some());
    Ok(())
}

#[test]
fn manifest_of_a_newer_format_or_garbage_is_an_error() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    {
        let store = CheckpointStore::open(&path)?;
        for step in 1..=3 {
            store.commit(&common::checkpoint(step, &[10])?)?;
        }
    }
    {
        let db = redb::Database::open(&path)?;
        let txn = db.begin_write()?;
        {
            let mut steps = txn.open_table(STEPS)?;
            let json = br#"{"format":7,"step":2}"#;
            let mut v = blake3::hash(json).as_bytes().to_vec();
            v.extend_from_slice(json);
            steps.insert(2, v.as_slice())?;
            let junk = b"not json at all";
            let mut v = blake3::hash(junk).as_bytes().to_vec();
            v.extend_from_slice(junk);
            steps.insert(3, v.as_slice())?;
        }
        txn.commit()?;
    }
    let store = CheckpointStore::open(&path)?;
    assert!(store.get(1)?.is_some());
    let e = store.get(2).expect_err("newer manifest decoded");
    assert!(
        matches!(e, Error::UnsupportedFormat { found: 7, .. }),
        "{e:?}"
    );
    let e = store.latest().expect_err("garbage manifest decoded");
    assert!(matches!(e, Error::Corrupt { step: Some(3), .. }), "{e:?}");
    assert!(e.to_string().contains("step 3"), "{e}");
    assert!(store.info(3).is_err());
    let report = store.verify()?;
    let damaged: Vec<u64> = report.damaged.iter().map(|(s, _)| *s).collect();
    assert_eq!(damaged, vec![2, 3]);
    assert_eq!(report.steps_ok, 1);
    Ok(())
}
