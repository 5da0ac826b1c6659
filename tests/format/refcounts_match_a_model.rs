//! Random sequences of commits, replaces, removals, rollbacks and retention
//! runs, checked after every operation against a plain in-memory model:
//! same steps, same contents, and reference counts that `verify` finds
//! consistent with the manifests.

use crate::common;

use std::collections::BTreeMap;

use ckptstore::{GradientCheckpoint, Retention, StoreOptions};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Commit { step: u64, blobs: Vec<u8> },
    Replace { step: u64, blobs: Vec<u8> },
    Remove { step: u64 },
    Rollback { step: u64 },
    KeepLast { n: usize },
}

fn op() -> impl Strategy<Value = Op> {
    let blobs = proptest::collection::vec(0u8..6, 0..4);
    prop_oneof![
        4 => (0u64..12, blobs.clone()).prop_map(|(step, blobs)| Op::Commit { step, blobs }),
        1 => (0u64..12, blobs).prop_map(|(step, blobs)| Op::Replace { step, blobs }),
        2 => (0u64..12).prop_map(|step| Op::Remove { step }),
        1 => (0u64..12).prop_map(|step| Op::Rollback { step }),
        1 => (0usize..4).prop_map(|n| Op::KeepLast { n }),
    ]
}

/// Blob contents from a pool of six, so steps share chunks often.
fn checkpoint(step: u64, blobs: &[u8]) -> GradientCheckpoint {
    let mut c = common::deterministic(step);
    c.optimizer_state.clear();
    for (i, &b) in blobs.iter().enumerate() {
        let len = [0, 1, 5000, 70_000, 1_100_000, 300_000][b as usize];
        c.set_optimizer_state(format!("p{i}"), common::bytes(u64::from(b), len));
    }
    c
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        if std::env::var_os("CKPT_LONG").is_some() { 500 } else { 24 }
    ))]

    #[test]
    fn store_matches_model(ops in proptest::collection::vec(op(), 1..30)) {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = StoreOptions::new()
            .shared(false)
            .durability(ckptstore::Durability::Eventual)
            .open(dir.path().join("model.ckpt"))
            .expect("open");
        let mut model: BTreeMap<u64, GradientCheckpoint> = BTreeMap::new();
        for op in &ops {
            match op {
                Op::Commit { step, blobs } => {
                    let c = checkpoint(*step, blobs);
                    let r = store.commit(&c);
                    prop_assert_eq!(r.is_ok(), !model.contains_key(step));
                    model.entry(*step).or_insert(c);
                }
                Op::Replace { step, blobs } => {
                    let c = checkpoint(*step, blobs);
                    store.replace(&c).expect("replace");
                    model.insert(*step, c);
                }
                Op::Remove { step } => {
                    prop_assert_eq!(store.remove(*step).expect("remove"), model.remove(step).is_some());
                }
                Op::Rollback { step } => {
                    let removed = store.rollback_to(*step).expect("rollback");
                    let want: Vec<u64> = model.range(step + 1..).map(|(s, _)| *s).collect();
                    prop_assert_eq!(&removed, &want);
                    model.retain(|s, _| s <= step);
                }
                Op::KeepLast { n } => {
                    store.apply_retention(&Retention::new().keep_last(*n).allow_deleting_all()).expect("retention");
                    let keep: Vec<u64> = model.keys().rev().take(*n).copied().collect();
                    model.retain(|s, _| keep.contains(s));
                }
            }
            prop_assert_eq!(store.steps().expect("steps"), model.keys().copied().collect::<Vec<_>>());
            let report = store.verify().expect("verify");
            prop_assert!(report.is_ok(), "after {:?}: {:?} {:?}", op, report.damaged, report.accounting);
        }
        for (step, c) in &model {
            prop_assert!(store.get(*step).expect("get").as_ref() == Some(c), "step {}", step);
        }
        let stats = store.stats().expect("stats");
        let logical: u64 = model.values().map(ckptstore::GradientCheckpoint::logical_bytes).sum();
        prop_assert_eq!(stats.logical_bytes, logical);
    }
}
