//! A step's save record (a staged save's cost, a framework's names for the
//! step) is a typed attribute of the step, kept apart from its metrics in
//! every form of the step; a step 0.4.0 wrote, which kept that record among
//! its metrics, reads as if it had been recorded so.

use crate::common;

use ckptstore::{CheckpointStore, GradientCheckpoint, SaveRecord};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");

fn format_of(path: &std::path::Path) -> Result<u32> {
    use redb::ReadableDatabase;
    let db = redb::Database::open(path)?;
    let txn = db.begin_read()?;
    let meta = txn.open_table(META)?;
    let v = meta.get("format_version")?.ok_or("no version")?;
    Ok(u32::from_le_bytes(v.value().try_into()?))
}

use common::{recorded, save_record as record};

#[test]
fn a_step_keeps_its_save_record_apart_from_its_metrics() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("s.ckpt");
    CheckpointStore::open(&path)?.commit(&common::checkpoint(1, &[100])?)?;
    assert!(format_of(&path)? < 6, "a plain step needs no new format");
    let written = recorded(2)?;
    CheckpointStore::open(&path)?.commit(&written)?;
    // Older builds refuse the store rather than fail on its step.
    assert_eq!(format_of(&path)?, 6);
    let store = CheckpointStore::open(&path)?;
    let back = store.get(2)?.ok_or("step 2")?;
    assert!(back == written, "step 2 reads back as committed");
    assert_eq!(back.metrics.keys().collect::<Vec<_>>(), ["loss"]);
    let info = store.info(2)?.ok_or("step 2")?;
    assert_eq!(info.save_record, record());
    let summaries = store.summaries(..)?;
    assert_eq!(summaries[1].save_record, record());
    assert!(
        summaries[0].save_record.is_empty() && store.get(1)?.ok_or("1")?.save_record.is_empty()
    );
    assert!(store.verify()?.is_ok());

    // The JSON file format and a safetensors export carry it too.
    let json = dir.path().join("2.json");
    back.save(&json)?;
    assert_eq!(GradientCheckpoint::load(&json)?.save_record, record());
    let file = dir.path().join("2.safetensors");
    store.export_safetensors(2, &file)?;
    let other = CheckpointStore::open(dir.path().join("o.ckpt"))?;
    other.import_safetensors(&file, 2)?;
    assert_eq!(other.get(2)?.ok_or("imported")?.save_record, record());
    Ok(())
}

#[test]
fn a_metric_under_the_librarys_prefix_is_refused() -> Result {
    // A step 0.4.0 wrote kept its save's cost as two such metrics, and a
    // step without a record still reads them so (src/store/legacy_metrics.rs):
    // a new step must not be misread that way.
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("s.ckpt"))?;
    let c = common::checkpoint(3, &[64])?
        .with_metric("ckptstore.staging_s", 0.75)
        .with_metric("ckptstore.blocked_s", 0.125);
    let err = store.commit(&c).expect_err("a reserved metric name");
    assert!(
        matches!(err, ckptstore::Error::InvalidCheckpoint { step: 3, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("\"ckptstore.blocked_s\""), "{err}");
    assert!(store.steps()?.is_empty());
    Ok(())
}

#[test]
fn an_invalid_save_record_is_refused_before_anything_is_written() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("s.ckpt"))?;
    let mut c = common::checkpoint(4, &[10])?;
    c.save_record = SaveRecord::default().with_name("x".repeat(ckptstore::MAX_TEXT_BYTES + 1));
    let err = store.commit(&c).expect_err("a name past the cap");
    assert!(
        matches!(err, ckptstore::Error::InvalidCheckpoint { step: 4, .. }),
        "{err}"
    );
    assert!(store.steps()?.is_empty());
    Ok(())
}
