//! `commit_async_copy` commits the checkpoint exactly as it was when the call
//! returned, however the caller changes its state afterwards, and however
//! the state's shape changes between calls while the store reuses the
//! buffers of earlier copies (blobs added, removed, grown, shrunk).

use crate::common;

use std::collections::BTreeMap;

use ckptstore::{CheckpointStore, Error, GradientCheckpoint};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn copies_are_exact_whatever_the_caller_does_next() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = CheckpointStore::open(&path)?;
    let mut state = common::checkpoint(0, &[300_000, 70_000, 1_000])?;
    let mut expected: BTreeMap<u64, GradientCheckpoint> = BTreeMap::new();
    let mut handles = Vec::new();
    for step in 1..=40u64 {
        state.step = step;
        state.loss_cid = Some(format!("cid_loss_{step}"));
        state.metrics.insert("loss".into(), 1.0 / step as f64);
        // Change the shape now and then: the spare buffers no longer fit.
        match step % 5 {
            0 => {
                state.optimizer_state.remove("param_1");
            }
            1 => {
                state.set_optimizer_state("param_1", common::bytes(step, 90_000));
            }
            2 => state.set_optimizer_state("param_0", common::bytes(step, 10)),
            3 => state.set_optimizer_state("param_0", common::bytes(step, 2 << 20)),
            _ => {}
        }
        for blob in state.optimizer_state.values_mut() {
            if let Some(b) = blob.first_mut() {
                *b = step as u8;
            }
        }
        expected.insert(step, state.clone());
        handles.push(store.commit_async_copy(&state)?);
        // The caller scribbles over its state at once.
        for blob in state.optimizer_state.values_mut() {
            blob.iter_mut().take(4096).for_each(|b| *b = !*b);
        }
        if step % 7 == 0 {
            // Let the writer catch up sometimes, so copies go into spares.
            for h in handles.drain(..) {
                h.wait()?;
            }
        }
    }
    for h in handles {
        h.wait()?;
    }
    store.flush()?;
    drop(store);

    let store = CheckpointStore::open_read_only(&path)?;
    assert_eq!(store.steps()?, expected.keys().copied().collect::<Vec<_>>());
    for (step, want) in &expected {
        assert_eq!(store.get(*step)?.as_ref(), Some(want), "step {step}");
    }
    let err = store
        .commit_async_copy(&expected[&1])
        .expect_err("a read-only store took a commit");
    assert!(matches!(err, Error::ReadOnly { .. }), "{err:?}");
    Ok(())
}
