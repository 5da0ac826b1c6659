//! A store written by ckptstore 0.1 (format 1: JSON manifests) still opens,
//! reads back every step exactly and verifies; a read-only open leaves it
//! untouched; a writable open marks it format 2, and old and new steps then
//! live side by side: new commits, removal of old and new steps, verify.
//!
//! `tests/fixtures/format1.ckpt` was written by commit 345e2e2 (format 1):
//! steps 10, 20, 30 of `fixture_checkpoint` below, step 10 pinned, then
//! compacted.

use ckptstore::{CheckpointStore, ComputationGraphStore, ComputationNode, GradientCheckpoint};
use redb::ReadableDatabase;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");

/// The checkpoint the fixture holds at `step` (a copy of the program that
/// wrote it).
fn fixture_checkpoint(step: u64) -> Result<GradientCheckpoint> {
    let mut g = ComputationGraphStore::new();
    let mut prev = "cid_input".to_owned();
    for i in 0..3 {
        let mut node = ComputationNode::new("matmul", vec![prev.clone(), format!("cid_w{i}")])
            .with_meta("dtype", "f32");
        node.id = format!("node-{i}");
        let id = g.add_node(node);
        prev = format!("cid_act{i}_{step}");
        g.record_output(&id, prev.clone())?;
        g.record_gradient(&id, format!("cid_grad{i}_{step}"))?;
    }
    let mut c = GradientCheckpoint::new(g, step).with_loss_cid(format!("cid_loss_{step}"));
    c.timestamp = 1_700_000_000 + step;
    c.metrics.insert("loss".into(), 1.0 / (step as f64 + 1.0));
    c.set_optimizer_state("embed", (0..70_000u32).map(|i| (i % 251) as u8).collect());
    let adam: Vec<u8> = (0..80_000u32)
        .map(|i| ((i * 7 + step as u32) % 253) as u8)
        .collect();
    c.set_optimizer_state("adam_m", adam);
    c.set_optimizer_state("bias", vec![step as u8; 10]);
    Ok(c)
}

fn format_version(path: &std::path::Path) -> Result<u32> {
    let db = redb::Database::open(path)?;
    let txn = db.begin_read()?;
    let meta = txn.open_table(META)?;
    let v = meta.get("format_version")?.ok_or("no format version")?;
    Ok(u32::from_le_bytes(v.value().try_into()?))
}

#[test]
fn format1_store_reads_verifies_and_upgrades() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("old.ckpt");
    std::fs::copy("tests/fixtures/format1.ckpt", &path)?;
    let original = std::fs::read(&path)?;

    {
        let store = CheckpointStore::open_read_only(&path)?;
        assert_eq!(store.steps()?, vec![10, 20, 30]);
        for step in [10, 20, 30] {
            assert_eq!(
                store.get(step)?,
                Some(fixture_checkpoint(step)?),
                "step {step}"
            );
        }
        assert_eq!(store.pinned()?, vec![10]);
        let report = store.verify()?;
        assert!(report.is_ok(), "{report:?}");
    }
    assert_eq!(
        std::fs::read(&path)?,
        original,
        "a read-only open changed the file"
    );
    assert_eq!(format_version(&path)?, 1);

    {
        let store = CheckpointStore::open(&path)?;
        // New steps keep their chunks in the format 2 tables: `embed`, the
        // same in every step, is written once more there, then shared.
        let info = store.commit(&fixture_checkpoint(40)?)?;
        assert_eq!(info.bytes_reused, 0);
        let info = store.commit(&fixture_checkpoint(50)?)?;
        assert_eq!(info.bytes_reused, 70_000);
        assert!(store.remove(20)?);
        assert!(store.remove(50)?);
        let report = store.verify()?;
        assert!(report.is_ok(), "{report:?}");
    }
    assert_eq!(format_version(&path)?, 2);

    let store = CheckpointStore::open(&path)?;
    assert_eq!(store.steps()?, vec![10, 30, 40]);
    for step in [10, 30, 40] {
        assert_eq!(
            store.get(step)?,
            Some(fixture_checkpoint(step)?),
            "step {step}"
        );
    }
    Ok(())
}
