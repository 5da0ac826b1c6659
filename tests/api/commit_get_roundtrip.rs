//! What `get` returns equals what was committed, field for field, also after
//! the store is closed and reopened; blobs from 0 bytes to 256 MiB.

use crate::common;

use ckptstore::CheckpointStore;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn committed_steps_read_back_identical_after_reopen() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let sizes: [&[usize]; 5] = [
        &[],
        &[0],
        &[1, 2, 3],
        &[4095, 4096, 4097, (1 << 20) - 4096, 1 << 20, (1 << 20) + 1],
        &[5 << 20, 17],
    ];
    let mut committed = Vec::new();
    {
        let store = CheckpointStore::open(&path)?;
        for (i, s) in sizes.iter().enumerate() {
            // Metrics must round-trip to the last bit (1/11 does not with
            // serde_json's default float parser).
            let ckpt = common::checkpoint(i as u64, s)?
                .with_metric("one_eleventh", 1.0 / 11.0)
                .with_metric("tiny", 0.1 + 0.2)
                .with_metric("neg", -3.0e-300);
            let info = store.commit(&ckpt)?;
            assert_eq!(info.step, i as u64);
            assert_eq!(info.logical_bytes, s.iter().sum::<usize>() as u64);
            assert_eq!(info.bytes_written + info.bytes_reused, info.logical_bytes);
            // Visible at once, before the store is closed.
            assert_eq!(store.get(i as u64)?.as_ref(), Some(&ckpt));
            committed.push(ckpt);
        }
    }
    let store = CheckpointStore::open(&path)?;
    for ckpt in &committed {
        let got = store.get(ckpt.step)?.ok_or("committed step missing")?;
        assert_eq!(&got, ckpt);
        assert_eq!(got.graph.node_count(), 3);
        assert_eq!(got.graph.edge_count(), 2);
    }
    assert_eq!(store.get(99)?, None);
    Ok(())
}

#[test]
fn a_256_mib_blob_round_trips() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("big.ckpt");
    let ckpt = common::checkpoint(7, &[256 << 20, 3])?;
    {
        let store = CheckpointStore::open(&path)?;
        let info = store.commit(&ckpt)?;
        assert_eq!(info.logical_bytes, (256 << 20) + 3);
    }
    let store = CheckpointStore::open(&path)?;
    let got = store.latest()?.ok_or("step missing")?;
    assert!(got == ckpt, "256 MiB checkpoint differs after reopen");
    Ok(())
}
