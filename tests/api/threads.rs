//! `StoreOptions::threads` and `background_threads`: any thread count
//! writes and reads the same bytes, and damage is reported the same way
//! whatever the count.

use crate::common;

use ckptstore::{CheckpointStore, Error, StoreOptions};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Blobs of 9 MiB (several chunks each, hashed in parallel), 5 MiB and
/// a small one.
const SIZES: [usize; 3] = [9 << 20, 5 << 20, 3000];

fn open(path: &std::path::Path, threads: usize) -> ckptstore::Result<CheckpointStore> {
    StoreOptions::new()
        .threads(threads)
        .background_threads(threads)
        .open(path)
}

#[test]
fn thread_counts_out_of_range_are_refused() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    for (options, name) in [
        (StoreOptions::new().threads(0), "threads is 0"),
        (StoreOptions::new().threads(257), "threads is 257"),
        (
            StoreOptions::new().background_threads(0),
            "background_threads is 0",
        ),
    ] {
        let err = options.open(&path).expect_err("accepted");
        assert!(matches!(err, Error::InvalidOptions(_)), "{err:?}");
        assert!(err.to_string().contains(name), "{err}");
        assert!(!path.exists(), "a refused open created the file");
    }
    Ok(())
}

#[test]
fn every_thread_count_writes_and_reads_the_same_bytes() -> Result {
    let dir = tempfile::tempdir()?;
    let mut stores = Vec::new();
    let mut blobs = None;
    for threads in [1usize, 2, 3, 8] {
        let path = dir.path().join(format!("run-{threads}.ckpt"));
        let store = open(&path, threads)?;
        let mut ckpt = common::checkpoint(10, &SIZES)?;
        ckpt.timestamp = 1_700_000_000;
        store.commit(&ckpt)?;
        // A background commit on the same threads.
        let mut next = common::checkpoint(11, &SIZES)?;
        next.timestamp = 1_700_000_001;
        store.commit_async(next.clone())?.wait()?;
        // The graphs' node ids differ between stores; the bytes do not.
        let state = (ckpt.optimizer_state.clone(), next.optimizer_state.clone());
        assert!(*blobs.get_or_insert_with(|| state.clone()) == state);
        stores.push((path, store, [ckpt, next]));
    }
    // Each store read back on every thread count: the same checkpoints.
    for (path, store, wanted) in stores {
        drop(store);
        for threads in [1, 2, 5] {
            let store = StoreOptions::new().threads(threads).open_read_only(&path)?;
            for want in &wanted {
                let got = store.get(want.step)?.ok_or("step missing")?;
                assert!(
                    got == *want,
                    "{}: step {} on {threads} threads",
                    path.display(),
                    want.step
                );
            }
            assert!(store.verify()?.is_ok());
        }
    }
    Ok(())
}

#[test]
fn damage_is_reported_the_same_on_any_thread_count() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let mut ckpt = common::checkpoint(4, &SIZES)?;
    ckpt.timestamp = 1_700_000_000;
    open(&path, 2)?.commit(&ckpt)?;

    // Flip a byte in the middle of two chunks of the 9 MiB blob (in a
    // pack file: the step is above the pack threshold).
    let blob = ckpt.optimizer_state["param_0"].clone();
    for at in [(7 << 20) + 512, (3 << 20) + 512] {
        common::flip_stored_byte(&path, &blob[at..at + 64], 32)?;
    }

    let mut messages = Vec::new();
    for threads in [1, 2, 4, 8] {
        let store = StoreOptions::new().threads(threads).open_read_only(&path)?;
        let err = store.get(4).expect_err("damaged step read");
        assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("param_0") && text.contains("fails its hash check"),
            "{text}"
        );
        messages.push(text);
        assert!(!store.verify()?.is_ok());
    }
    // The first damaged chunk is named, whatever the threads' timing.
    assert!(messages.iter().all(|m| *m == messages[0]), "{messages:#?}");
    Ok(())
}

#[test]
fn get_into_fills_buffers_in_place_and_never_with_damaged_bytes() -> Result {
    use ckptstore::{Dtype, Tensor, TensorMut};
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let w = common::bytes(1, 9 << 20);
    let mut ckpt = common::checkpoint(5, &[100])?;
    ckpt.set_tensor("w", Tensor::new(Dtype::F32, vec![9 << 18], w.clone())?);
    ckpt.set_tensor("b", Tensor::new(Dtype::BF16, vec![8], vec![7; 16])?);
    open(&path, 2)?.commit(&ckpt)?;

    let store = StoreOptions::new().threads(3).open_read_only(&path)?;
    let (mut wbuf, mut bbuf, mut none) = (vec![0u8; w.len()], vec![0u8; 16], [0u8]);
    let mut targets = [
        TensorMut::new("w", Dtype::F32, vec![9 << 18], &mut wbuf)?,
        TensorMut::new("b", Dtype::F16, vec![8], &mut bbuf)?, // another dtype
        TensorMut::new("nope", Dtype::U8, vec![1], &mut none)?,
    ];
    let rest = store.get_into(None, &mut targets)?.ok_or("no latest")?;
    let filled: Vec<bool> = targets.iter().map(TensorMut::filled).collect();
    assert_eq!(filled, [true, false, false]);
    assert!(wbuf == w);
    assert_eq!(bbuf, [0; 16]);
    // What was not filled comes back as usual; what was, does not.
    assert_eq!(rest.tensors.keys().collect::<Vec<_>>(), ["b"]);
    assert_eq!(
        rest.optimizer_state["param_0"],
        ckpt.optimizer_state["param_0"]
    );
    assert!(store.get_into(Some(99), &mut [])?.is_none());
    drop(store);

    // A flipped byte in a chunk of "w": the read fails and that chunk's
    // bytes never reach the buffer.
    let at = (5 << 20) + 100;
    common::flip_stored_byte(&path, &w[at..at + 64], 32)?;
    for threads in [1, 4] {
        let store = StoreOptions::new().threads(threads).open_read_only(&path)?;
        let mut wbuf = vec![0u8; w.len()];
        let mut targets = [TensorMut::new("w", Dtype::F32, vec![9 << 18], &mut wbuf)?];
        let err = store
            .get_into(Some(5), &mut targets)
            .expect_err("damage read");
        assert!(err.to_string().contains("fails its hash check"), "{err}");
        assert!(!targets[0].filled());
        assert_eq!(
            wbuf[at + 32],
            0,
            "{threads} threads: damaged bytes reached the buffer"
        );
    }
    Ok(())
}
