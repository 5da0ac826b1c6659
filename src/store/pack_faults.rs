//! A pack file write, its fsync or its directory's fsync that fails: the
//! commit fails, no step and no file is left, and the store goes on. The
//! step becoming visible after a failed fsync would mean the commit point
//! came before the bytes (or the file's name) were durable: what a power
//! cut at that moment would lose.

use crate::engine::packs::faults::{arm, Fault};
use crate::{
    CheckpointStore, ComputationGraphStore, GradientCheckpoint, PackError, PackOp, StoreOptions,
};

fn big(step: u64) -> GradientCheckpoint {
    let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    ckpt.timestamp = 1_750_000_000 + step;
    let bytes: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24).to_le_bytes()[0] ^ step.to_le_bytes()[0])
        .collect();
    ckpt.set_optimizer_state("w", bytes);
    ckpt
}

fn files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir.join("run.ckpt.packs")).map_or(0, Iterator::count)
}

#[test]
fn a_failed_pack_write_or_fsync_leaves_no_step_and_no_file() {
    for fault in [Fault::Write, Fault::Sync, Fault::SyncDir] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("run.ckpt");
        let store: CheckpointStore = StoreOptions::new()
            .pack_files(true)
            .pack_threshold(1 << 20)
            .open(&path)
            .expect("open");
        store.commit(&big(1)).expect("commit");
        arm(fault);
        let err = store.commit(&big(2)).expect_err("the fault strikes");
        assert!(err.is_io(), "{fault:?}: {err}");
        // The pack files' own error, saying what was being done (by type).
        let op = match err.pack() {
            Some(PackError::Io { op, .. }) => *op,
            other => panic!("{fault:?}: not a pack file's I/O error: {other:?} ({err:?})"),
        };
        let expected = match fault {
            Fault::Write => PackOp::Write,
            Fault::Sync => PackOp::Sync,
            Fault::SyncDir => PackOp::SyncDirectory,
        };
        assert_eq!(op, expected, "{err}");
        let names = if fault == Fault::SyncDir {
            "run.ckpt.packs"
        } else {
            "00000001.pack"
        };
        assert!(err.to_string().contains(names), "{fault:?}: {err}");
        assert_eq!(store.steps().expect("steps"), vec![1], "{fault:?}");
        assert_eq!(
            files(dir.path()),
            1,
            "{fault:?}: the failed commit's file is left"
        );
        // The store goes on: the same step commits, and all verifies.
        store.commit(&big(2)).expect("commit after the fault");
        assert_eq!(store.get(2).expect("get"), Some(big(2)));
        let report = store.verify().expect("verify");
        assert!(report.is_ok(), "{fault:?}: {report:?}");
        assert_eq!(report.pack_files, 2);
        drop(store);
        let store = CheckpointStore::open(&path).expect("reopen");
        assert_eq!(store.get(1).expect("get"), Some(big(1)));
    }
}
