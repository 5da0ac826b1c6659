//! `commit_async`: order, visibility, backpressure, error reporting, and
//! shutdown that finishes queued commits.

use crate::common;

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use ckptstore::{CheckpointStore, Error, StoreOptions};
use common::faults::{Faulty, Op, Plan};
use redb::backends::InMemoryBackend;
use redb::StorageBackend;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn commits_land_in_order_and_readers_see_only_whole_steps() -> Result {
    let dir = tempfile::tempdir()?;
    let store = Arc::new(CheckpointStore::open(dir.path().join("run.ckpt"))?);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || -> std::result::Result<(), String> {
            while !stop.load(Ordering::SeqCst) {
                // Commits land in queue order: the listing is always 0..n.
                let steps = store.steps().map_err(|e| e.to_string())?;
                if steps != (0..steps.len() as u64).collect::<Vec<_>>() {
                    return Err(format!("out of order: {steps:?}"));
                }
                if let Some(step) = store.latest_step().map_err(|e| e.to_string())? {
                    let got = store.get(step).map_err(|e| e.to_string())?;
                    if got != Some(common::deterministic(step)) {
                        return Err(format!("step {step} visible before it was whole"));
                    }
                }
            }
            Ok(())
        })
    };
    let handles: Vec<_> = (0..20)
        .map(|s| store.commit_async(common::deterministic(s)))
        .collect::<ckptstore::Result<_>>()?;
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.step(), i as u64);
        let info = h.wait()?;
        assert_eq!(info.step, i as u64);
        // Once the handle reports, the step is there.
        assert!(store.get(i as u64)?.is_some());
    }
    store.flush()?;
    stop.store(true, Ordering::SeqCst);
    reader.join().map_err(|_| "reader panicked")??;
    assert_eq!(store.steps()?, (0..20).collect::<Vec<_>>());
    Ok(())
}

/// An in-memory backend whose syncs wait at a gate until it opens.
#[derive(Debug)]
struct Gated {
    inner: InMemoryBackend,
    gate: Arc<(Mutex<bool>, Condvar)>,
    syncs: Arc<AtomicUsize>,
}

impl StorageBackend for Gated {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> io::Result<()> {
        let (lock, cvar) = &*self.gate;
        let mut open = lock.lock().expect("gate");
        while !*open {
            open = cvar.wait(open).expect("gate");
        }
        self.syncs.fetch_add(1, Ordering::SeqCst);
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.inner.write(offset, data)
    }
}

fn set_gate(gate: &Arc<(Mutex<bool>, Condvar)>, open: bool) {
    *gate.0.lock().expect("gate") = open;
    gate.1.notify_all();
}

#[test]
fn a_full_queue_blocks_the_caller() -> Result {
    let gate = Arc::new((Mutex::new(true), Condvar::new()));
    let syncs = Arc::new(AtomicUsize::new(0));
    let backend = {
        let (gate, syncs) = (gate.clone(), syncs.clone());
        let inner = Arc::new(Mutex::new(Some(InMemoryBackend::new())));
        move || {
            let inner = inner
                .lock()
                .expect("once")
                .take()
                .ok_or_else(|| io::Error::other("reopened"))?;
            Ok(Gated {
                inner,
                gate: gate.clone(),
                syncs: syncs.clone(),
            })
        }
    };
    let store = Arc::new(
        StoreOptions::new()
            .shared(false)
            .async_queue_depth(2)
            .open_with_backend("gated", backend)?,
    );
    set_gate(&gate, false); // the disk stalls from now on
                            // One commit runs (stuck at its sync) and two wait in the queue...
    let mut handles = Vec::new();
    for s in 0..3 {
        handles.push(store.commit_async(common::deterministic(s))?);
    }
    std::thread::sleep(Duration::from_millis(100));
    // ...so the fourth blocks until the disk moves.
    let submitted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let fourth = {
        let (store, submitted) = (store.clone(), submitted.clone());
        std::thread::spawn(move || {
            let h = store.commit_async(common::deterministic(3));
            submitted.store(true, Ordering::SeqCst);
            h
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !submitted.load(Ordering::SeqCst),
        "a full queue did not block the caller"
    );
    // (No read here: redb holds its state lock through a commit's sync,
    // so a reader would wait at the gate too.)
    set_gate(&gate, true);
    handles.push(fourth.join().map_err(|_| "submitter panicked")??);
    assert!(submitted.load(Ordering::SeqCst));
    for h in handles {
        h.wait()?;
    }
    store.flush()?;
    assert_eq!(store.steps()?, vec![0, 1, 2, 3]);
    assert!(syncs.load(Ordering::SeqCst) >= 4);
    Ok(())
}

#[test]
fn failures_reach_the_handle_and_flush_and_the_store_goes_on() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let plan = Plan::new();
    let store = {
        let (path, plan) = (path.clone(), plan.clone());
        StoreOptions::new()
            .open_with_backend(path.clone(), move || Faulty::open(&path, plan.clone()))?
    };
    store.commit_async(common::deterministic(0))?.wait()?;

    plan.arm(0, &[Op::Sync]);
    let err = store
        .commit_async(common::deterministic(1))?
        .wait()
        .expect_err("fault not reported");
    assert!(err.is_io(), "{err}");
    // Delivered by its handle: flush does not raise it again.
    assert!(store.flush().is_ok(), "a failure is reported once");

    // A failure whose handle was dropped (never observed) reaches flush.
    plan.arm(0, &[Op::Sync]);
    drop(store.commit_async(common::deterministic(2))?);
    let flushed = store.flush().expect_err("flush hid the failure");
    assert!(
        matches!(&flushed, Error::AsyncCommitFailed { steps, .. } if steps == &vec![2]),
        "{flushed}"
    );
    assert!(store.flush().is_ok(), "a failure is reported once");

    // Reported by flush first: the handle asked later says so.
    plan.arm(0, &[Op::Sync]);
    let late = store.commit_async(common::deterministic(4))?;
    assert!(store.flush().is_err());
    let e = late.wait().expect_err("the commit failed");
    assert!(e.to_string().contains("flush() reported"), "{e}");
    assert!(store.flush().is_ok());
    if store.steps()?.contains(&4) {
        store.remove(4)?; // the data landed before the failed sync
    }

    // The store keeps working.
    let retry: Vec<u64> = [1, 2]
        .into_iter()
        .filter(|s| !store.steps().unwrap_or_default().contains(s))
        .collect();
    for s in retry.into_iter().chain([3]) {
        store.commit_async(common::deterministic(s))?.wait()?;
    }
    store.flush()?;
    assert_eq!(store.steps()?, vec![0, 1, 2, 3]);
    // Invalid input is refused at once.
    let bad = common::deterministic(9).with_metric("loss", f64::INFINITY);
    assert!(matches!(
        store.commit_async(bad),
        Err(Error::InvalidCheckpoint { .. })
    ));
    Ok(())
}

#[test]
fn dropping_the_store_finishes_queued_commits() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    {
        let store = StoreOptions::new().async_queue_depth(8).open(&path)?;
        for s in 0..8 {
            // Handles dropped at once: nobody waits.
            drop(store.commit_async(common::deterministic(s))?);
        }
    }
    let store = CheckpointStore::open(&path)?;
    assert_eq!(store.steps()?, (0..8).collect::<Vec<_>>());
    for s in 0..8 {
        assert!(store.get(s)? == Some(common::deterministic(s)), "step {s}");
    }
    Ok(())
}
