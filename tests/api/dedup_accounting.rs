//! Content-addressed dedup: a commit with 90% of its bytes unchanged writes
//! at most 15% of a full commit, and `CommitInfo` / `stats()` account for it.

use crate::common;

use ckptstore::{CheckpointStore, GradientCheckpoint};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn unchanged_bytes_are_referenced_not_written() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    // 10 parameters of 2 MiB; then one of them changes per step.
    let mut ckpt = GradientCheckpoint::new(common::graph(0)?, 0);
    for i in 0..10u64 {
        ckpt.set_optimizer_state(format!("layer{i}"), common::bytes(i, 2 << 20));
    }
    let full = store.commit(&ckpt)?;
    assert_eq!(full.bytes_written, 20 << 20);
    assert_eq!(full.bytes_reused, 0);

    for step in 1..=5u64 {
        ckpt.step = step;
        let layer = format!("layer{}", step % 10);
        ckpt.set_optimizer_state(layer, common::bytes(100 + step, 2 << 20));
        let info = store.commit(&ckpt)?;
        assert_eq!(info.logical_bytes, 20 << 20);
        assert_eq!(info.bytes_written + info.bytes_reused, info.logical_bytes);
        assert!(
            info.bytes_written * 100 <= full.bytes_written * 15,
            "step {step}: wrote {} of {}",
            info.bytes_written,
            full.bytes_written
        );
        assert_eq!(info.bytes_written, 2 << 20, "step {step}");
        assert_eq!(store.get(step)?.as_ref(), Some(&ckpt));
    }

    // A blob repeated within one checkpoint is stored once too.
    ckpt.step = 6;
    ckpt.set_optimizer_state("copy_of_layer9", ckpt.optimizer_state["layer9"].clone());
    let info = store.commit(&ckpt)?;
    assert_eq!(info.bytes_written, 0);

    let stats = store.stats()?;
    assert_eq!(stats.steps, 7);
    assert_eq!(stats.logical_bytes, 6 * (20 << 20) + (22 << 20));
    assert_eq!(stats.stored_bytes, (20 << 20) + 5 * (2 << 20));
    assert!(
        (stats.dedup_ratio() - stats.logical_bytes as f64 / stats.stored_bytes as f64).abs() < 1e-9
    );
    // Each commit of 20 MiB (above the pack threshold) put its new chunks
    // in a pack file of its own; step 6 had none to write.
    assert_eq!(stats.pack_files, 6);
    assert!(stats.file_bytes + stats.pack_bytes >= stats.stored_bytes);

    // Removing steps frees only what no other step uses.
    for step in 0..6 {
        store.remove(step)?;
    }
    assert_eq!(store.stats()?.stored_bytes, 20 << 20);
    assert_eq!(store.get(6)?.as_ref(), Some(&ckpt));
    let report = store.verify()?;
    assert!(report.is_ok(), "{:?}", report.accounting);
    Ok(())
}
