//! The tier's rules on simulated jobs (up to 10,000 ranks, random node
//! losses) and its files as untrusted input.

// Ranks of simulated jobs fit in u32 by construction.
#![allow(clippy::cast_possible_truncation)]

use std::collections::BTreeMap;
use std::path::Path;

use super::*;
use crate::ContentDigest;

fn digest(step: u64, src: u32, save: u64) -> ContentDigest {
    let mut h = blake3::Hasher::new();
    h.update(&step.to_le_bytes());
    h.update(&src.to_le_bytes());
    h.update(&save.to_le_bytes());
    ContentDigest(*h.finalize().as_bytes())
}

/// A save of `step` by a job of `world` ranks, `k` per node, one copy of
/// each shard on the next node.
fn save(step: u64, seq: u64, world: u32, k: u32) -> Record {
    let nodes = world.div_ceil(k);
    Record {
        step,
        saved_at: 1_000 + seq,
        seq,
        ranks_per_node: k,
        digests: (0..world).map(|src| digest(step, src, seq)).collect(),
        copies: (0..world)
            .map(|src| vec![copy_holder(src, k, nodes, world)])
            .collect(),
        upload: false,
        cost: None,
        legacy: None,
    }
}

fn copy_holder(src: u32, k: u32, nodes: u32, world: u32) -> u32 {
    let node = (src / k + 1) % nodes;
    let ranks = node * k..world.min(node * k + k);
    ranks.start + (src % k) % ranks.len() as u32
}

/// What the surviving nodes hold of `records`: each rank its own shard,
/// the copy holder its copy.
fn holdings(records: &[Record], k: u32, alive: &dyn Fn(u32) -> bool) -> Vec<Holding> {
    let mut out = Vec::new();
    for r in records {
        for src in 0..r.world_size() {
            let mut push = |holder: u32, kind| {
                if alive(holder / k) {
                    out.push(Holding {
                        holder,
                        store: StoreName { kind, rank: src },
                        step: r.step,
                        digest: r.digests[src as usize],
                    });
                }
            };
            push(src, StoreKind::Own);
            push(r.copies[src as usize][0], StoreKind::Copies);
        }
    }
    out
}

/// A small deterministic generator (xorshift): the same losses each run.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn the_save_made_last_that_survivors_hold_whole_is_restored_at_10_000_ranks() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for (world, k, rounds) in [(1_000u32, 8u32, 20), (10_000, 8, 5)] {
        let nodes = world / k;
        // Saves of steps 10, 20 and 30 in that order, then a new run that
        // saved step 5 last.
        let records: Vec<Record> = [(10, 1), (20, 2), (30, 3), (5, 4)]
            .into_iter()
            .map(|(step, seq)| save(step, seq, world, k))
            .collect();
        for round in 0..rounds {
            // Lose 0 to 3 random nodes (two adjacent ones lose every copy
            // of the first one's shards).
            let lost: Vec<u32> = (0..rng.below(4))
                .map(|_| rng.below(u64::from(nodes)) as u32)
                .collect();
            let alive = |node: u32| !lost.contains(&node);
            let held = holdings(&records, k, &alive);
            let started = std::time::Instant::now();
            let index = Held::new(&held);
            let evaluations: Vec<Evaluation> = records.iter().map(|r| index.evaluate(r)).collect();
            let (best, newer) = pick(&evaluations, None);
            let took = started.elapsed();
            // Brute force: a shard survives if its node or its copy's does.
            let whole = |r: &Record| {
                (0..world).all(|src| alive(src / k) || alive(r.copies[src as usize][0] / k))
            };
            let expected = records
                .iter()
                .filter(|r| whole(r))
                .max_by_key(|r| r.order());
            assert_eq!(
                best.as_ref().map(|e| e.key),
                expected.map(Record::key),
                "{world} ranks, lost {lost:?}"
            );
            for e in &newer {
                let r = records.iter().find(|r| r.key() == e.key).expect("a record");
                assert!(!whole(r) && e.order > best.as_ref().map_or((0, 0, 0), |b| b.order));
                let missing: Vec<u32> = (0..world)
                    .filter(|&src| !alive(src / k) && !alive(r.copies[src as usize][0] / k))
                    .collect();
                assert_eq!(e.missing, missing);
            }
            if let Some(r) = expected {
                let holders = index.all_holders(r);
                for (src, hs) in holders.iter().enumerate() {
                    let src = src as u32;
                    let own = alive(src / k).then_some(src);
                    let copy =
                        alive(r.copies[src as usize][0] / k).then_some(r.copies[src as usize][0]);
                    assert_eq!(*hs, own.into_iter().chain(copy).collect::<Vec<_>>());
                }
            }
            if round == 0 {
                println!("{world} ranks: indexed, evaluated and picked in {took:?}");
            }
        }
    }
}

#[test]
fn a_step_asked_for_is_the_only_one_considered() {
    let records = [save(10, 1, 4, 2), save(20, 2, 4, 2)];
    let held = holdings(&records, 2, &|_| true);
    let index = Held::new(&held);
    let evaluations: Vec<Evaluation> = records.iter().map(|r| index.evaluate(r)).collect();
    assert_eq!(pick(&evaluations, Some(10)).0.map(|e| e.key.0), Some(10));
    assert_eq!(pick(&evaluations, Some(15)).0, None);
    // A holding of another save of the step (another digest) is no copy.
    let mut other = records[1].clone();
    other.saved_at += 1;
    other.digests[3] = digest(20, 3, 99);
    let e = index.evaluate(&other);
    assert_eq!(e.missing, vec![3]);
}

#[test]
fn retention_keeps_the_saves_made_last_whatever_their_steps() {
    let mut records: Vec<Record> = [(100, 0), (200, 0), (300, 0)]
        .into_iter()
        .enumerate()
        .map(|(i, (step, seq))| Record {
            saved_at: 10 + i as u64,
            ..save(step, seq, 2, 1)
        })
        .collect();
    // A new run, started again at step 10 in the same directory.
    records.push(save(10, 1, 2, 1));
    assert_eq!(retain(&records, 2, |_| false), [10, 300].into());
    records.push(save(20, 2, 2, 1));
    assert_eq!(retain(&records, 2, |_| false), [10, 20].into());
    // A save due for the bucket and not there yet is kept.
    records[0].upload = true;
    assert_eq!(retain(&records, 1, |r| r.step != 100), [20, 100].into());
    assert_eq!(retain(&records, 0, |_| true), [].into());
}

fn name(step: u64, rank: u32) -> RecordName {
    RecordName { step, rank }
}

#[test]
fn a_record_is_read_back_and_a_wrong_one_refused() {
    let path = Path::new("records/x");
    let mut r = save(7, 3, 4, 2);
    r.cost = Some(Cost {
        blocked_seconds: 0.5,
        staging_seconds: 0.0,
        durable_seconds: 0.5,
        bytes_new: 10,
        bytes_deduplicated: 2,
    });
    let bytes = r.encode(&name(7, 3), path).expect("encodes");
    assert_eq!(
        Record::decode(&bytes, &name(7, 3), path).expect("decodes"),
        r
    );
    let refused = |bytes: &[u8], n: RecordName| -> String {
        Record::decode(bytes, &n, path)
            .expect_err("refused")
            .to_string()
    };
    assert!(refused(&bytes, name(8, 3)).contains("it records step 7, its name step 8"));
    assert!(refused(&bytes, name(7, 4)).contains("written by rank 4 of a world of 4"));
    assert!(refused(b"{", name(7, 0)).contains("not a record"));
    let text = String::from_utf8(bytes).expect("UTF-8");
    let edited = |from: &str, to: &str| text.replacen(from, to, 1).into_bytes();
    assert!(
        refused(&edited("\"format\":2", "\"format\":9"), name(7, 0)).contains("record format 9")
    );
    assert!(refused(&edited("\"format\":2", "\"format\":1"), name(7, 0))
        .contains("format 1 without sizes"));
    // Format 1 (0.4.0's) carries sizes and DCP's metadata.
    let old = Record {
        legacy: Some(Legacy {
            sizes: vec![BTreeMap::from([("t/w@0".to_owned(), 8)]); 4],
            metadata: "{}".into(),
        }),
        ..r.clone()
    };
    let bytes = old.encode(&name(7, 0), path).expect("encodes");
    assert!(bytes.starts_with(b"{\"format\":1,"));
    assert_eq!(
        Record::decode(&bytes, &name(7, 0), path).expect("decodes"),
        old
    );
    let hex = r.digests[1].to_string();
    assert!(refused(&edited(&hex, &hex.to_uppercase()), name(7, 0)).contains("rank 1's digest"));
    assert!(
        refused(&edited("\"copies\":[[", "\"copies\":[[9],["), name(7, 0))
            .contains("lists of copies")
    );
    assert!(refused(
        &edited("\"ranks_per_node\":2", "\"ranks_per_node\":0"),
        name(7, 0)
    )
    .contains("0 ranks per node"));
    assert!(refused(
        &edited("\"digests\":[", "\"digests\":[],\"x\":["),
        name(7, 0)
    )
    .contains("a world of 0"));
    // Nothing that a reader would refuse is written.
    let mut bad = r.clone();
    bad.copies[0] = vec![4];
    assert!(bad.encode(&name(7, 0), path).is_err());
}

#[test]
fn a_directory_written_by_0_4_0_is_read() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tier-0.4.0");
    let node1 = TierDir::new(root.join("node1"));
    let (records, refused) = node1.records(None).expect("read");
    assert!(refused.is_empty(), "{refused:?}");
    let steps: Vec<(u64, u32, u32, u64)> = records
        .iter()
        .map(|(n, r)| (n.step, n.rank, r.world_size(), r.seq))
        .collect();
    assert_eq!(steps, [(2, 1, 2, 0), (3, 1, 2, 0)]);
    assert!(records[0].1.order() < records[1].1.order());
    assert!(!node1.in_bucket(records[0].1.key()).expect("read"));
    assert!(node1.in_bucket(records[1].1.key()).expect("read"));
    assert_eq!(records[1].1.copies, [vec![1], vec![0]]);
    let legacy = records[1].1.legacy.as_ref().expect("format 1");
    assert!(legacy.metadata.contains("state_dict") && legacy.sizes[1].contains_key("t/b@0"));
    let stores: Vec<String> = node1
        .stores()
        .expect("list")
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(stores, ["copies-of-00000.ckpt", "rank-00001.ckpt"]);
    assert_eq!(node1.records(Some(0)).expect("read").0.len(), 0);
}

#[test]
fn records_and_marks_are_written_durably_and_removed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tier = TierDir::new(dir.path().join("node0"));
    assert!(tier.records(None).expect("none yet").0.is_empty());
    let r = save(5, 1, 2, 1);
    tier.write_record(1, &r).expect("write");
    tier.mark_in_bucket(r.key()).expect("mark");
    assert!(tier.in_bucket(r.key()).expect("read"));
    let mut other = r.clone();
    other.saved_at += 1;
    assert!(!tier.in_bucket(other.key()).expect("read"));
    // A damaged record is refused, named, and the others still read.
    std::fs::write(
        dir.path()
            .join("node0/records")
            .join(name(6, 0).to_string()),
        b"{\"format\":1",
    )
    .expect("write");
    let (records, refused) = tier.records(None).expect("read");
    assert_eq!(records.len(), 1);
    assert!(refused[0]
        .to_string()
        .contains("step-00000000000000000006.rank-00000.json: damaged tier record"));
    tier.remove_record(5, 1).expect("remove");
    assert!(!tier.in_bucket(r.key()).expect("read"));
    assert_eq!(tier.records(Some(1)).expect("read").0.len(), 0);
}

/// The (step, rank) of each record in `tier`.
fn left(tier: &TierDir) -> Vec<(u64, u32)> {
    let (records, _) = tier.records(None).expect("read");
    records.iter().map(|(n, _)| (n.step, n.rank)).collect()
}

#[test]
fn retiring_a_step_takes_the_records_of_ranks_the_node_no_longer_holds() {
    // Node 0 of a job saved as 2 nodes of 2 (ranks 0 and 1 recorded steps
    // 2 and 3), now run as 4 nodes of 1 (node 0 holds rank 0 only).
    let dir = tempfile::tempdir().expect("tempdir");
    let tier = TierDir::new(dir.path().join("node0"));
    for step in [2, 3] {
        for rank in [0, 1] {
            tier.write_record(rank, &save(step, step, 4, 2))
                .expect("write");
        }
    }
    tier.retire(&[2], 0, &[0]).expect("retire");
    assert_eq!(left(&tier), vec![(3, 0), (3, 1)]);
    // Under the old layout (node 0 holds ranks 0 and 1), rank 0 retires
    // its own record only: rank 1's is rank 1's to retire.
    tier.retire(&[3], 0, &[0, 1]).expect("retire");
    assert_eq!(left(&tier), vec![(3, 1)]);
}
