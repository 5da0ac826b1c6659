//! An I/O error at any write, resize or sync of a commit is an `Err` from
//! `commit`, never a panic; the same store handle recovers by itself (it
//! reopens its database, as redb requires after an I/O error); every earlier
//! step is intact and the failed step is wholly present or wholly absent.
//! Run twice: with the default cache, and with a 1 MiB cache, where commits
//! stage their chunks in transactions of their own first (nothing staged by
//! a failed commit may outlive it).

use crate::common;

use std::path::Path;

use ckptstore::{CheckpointStore, GradientCheckpoint, StoreOptions};
use common::faults::{copy, Faulty, Op, Plan};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

fn open_faulty(
    path: &Path,
    plan: &std::sync::Arc<Plan>,
    options: &StoreOptions,
) -> Result<CheckpointStore> {
    let (path, plan) = (path.to_owned(), plan.clone());
    let p = path.clone();
    Ok(options
        .clone()
        .open_with_backend(p, move || Faulty::open(&path, plan.clone()))?)
}

fn check_store(
    store: &CheckpointStore,
    base: &[GradientCheckpoint],
    failed: &GradientCheckpoint,
    ctx: &str,
) -> Result<bool> {
    for ckpt in base {
        assert!(
            store.get(ckpt.step)?.as_ref() == Some(ckpt),
            "{ctx}: earlier step {} damaged",
            ckpt.step
        );
    }
    let got = store.get(failed.step)?;
    let present = got.is_some();
    assert!(
        got.is_none() || got.as_ref() == Some(failed),
        "{ctx}: failed step is partial"
    );
    let mut expected: Vec<u64> = base.iter().map(|c| c.step).collect();
    if present {
        expected.push(failed.step);
    }
    assert_eq!(store.steps()?, expected, "{ctx}");
    Ok(present)
}

#[test]
fn every_io_fault_in_a_commit_is_an_error_and_the_store_recovers() -> Result {
    every_fault(&StoreOptions::new())
}

#[test]
fn every_io_fault_in_a_staged_commit_is_an_error_and_the_store_recovers() -> Result {
    every_fault(&StoreOptions::new().cache_size(1 << 20))
}

fn every_fault(options: &StoreOptions) -> Result {
    let dir = tempfile::tempdir()?;
    let base_path = dir.path().join("base.ckpt");
    let base: Vec<GradientCheckpoint> = (0..3).map(common::deterministic).collect();
    {
        let store = CheckpointStore::open(&base_path)?;
        for c in &base {
            store.commit(c)?;
        }
    }
    let next = common::deterministic(3);

    // Count the backend calls one commit makes.
    let plan = Plan::new();
    let dry = dir.path().join("dry.ckpt");
    copy(&base_path, &dry)?;
    let calls = {
        let store = open_faulty(&dry, &plan, options)?;
        let before = plan.calls();
        store.commit(&next)?;
        plan.calls() - before
    };
    assert!(calls >= 3, "a commit made only {calls} backend calls");

    let mut errors = 0;
    let mut present_after_error = 0;
    for kinds in [
        &[Op::Write, Op::SetLen, Op::Sync][..],
        &[Op::Sync][..],
        &[Op::SetLen][..],
    ] {
        for k in 0..calls + 2 {
            let ctx = format!("fault at {kinds:?} call {k}");
            let path = dir.path().join("trial.ckpt");
            copy(&base_path, &path)?;
            let plan = Plan::new();
            let store = open_faulty(&path, &plan, options)?;
            plan.arm(k, kinds);
            let result = store.commit(&next);
            plan.disarm();
            if let Err(e) = &result {
                errors += 1;
                assert!(e.is_io(), "{ctx}: not reported as an I/O error: {e}");
                assert!(
                    e.to_string().contains("step 3"),
                    "{ctx}: error lacks the step: {e}"
                );
            }
            // The same handle works again, without the caller reopening.
            let present = check_store(&store, &base, &next, &ctx)?;
            if result.is_ok() {
                assert!(present, "{ctx}: commit said Ok but the step is missing");
            } else if present {
                present_after_error += 1;
            } else {
                store.commit(&next)?; // a retry succeeds
            }
            let report = store.verify()?;
            assert!(report.is_ok(), "{ctx}: {report:?}");
            assert_eq!(
                report.staged_chunks, 0,
                "{ctx}: a failed commit left chunks staged"
            );
            drop(store);
            // And a fresh open of the plain file agrees.
            let reopened = CheckpointStore::open(&path)?;
            assert!(
                check_store(&reopened, &base, &next, &ctx)?,
                "{ctx}: step lost after reopen"
            );
        }
    }
    assert!(errors > 0, "no fault surfaced as an error");
    println!(
        "{calls} backend calls per commit; {errors} injected faults returned Err; \
              {present_after_error} of those had committed (fault after the commit point)"
    );
    Ok(())
}
