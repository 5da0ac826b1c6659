//! `ckpt verify` exits 0 on a sound store and 3 on damage, naming each
//! damaged step.

use crate::common;

use ckptstore::CheckpointStore;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn verify_names_damaged_steps_and_exits_3() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let p = path.to_str().ok_or("path")?;
    {
        let store = CheckpointStore::open(&path)?;
        for step in 0..4 {
            store.commit(&common::deterministic(step))?;
        }
    }
    let (code, out, err) = common::ckpt(&["verify", p])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("4 steps ok"), "{out}");
    let (code, _, _) = common::ckpt(&["verify", p, "--pages"])?;
    assert_eq!(code, 0);

    // Flip one byte inside step 2's own blob ("moving" is unique to it).
    let blob = common::deterministic(2).optimizer_state["moving"].clone();
    let probe = &blob[1000..1064];
    let mut file = std::fs::read(&path)?;
    let at = file
        .windows(probe.len())
        .position(|w| w == probe)
        .ok_or("blob bytes not found in the file")?;
    file[at + 10] ^= 0xFF;
    std::fs::write(&path, &file)?;

    let (code, out, _) = common::ckpt(&["verify", p])?;
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("DAMAGED step 2"), "{out}");
    assert!(
        !out.contains("DAMAGED step 1") && !out.contains("DAMAGED step 3"),
        "{out}"
    );
    // With redb's page checksums the damaged file is refused outright.
    let (code, _, err) = common::ckpt(&["verify", p, "--pages"])?;
    assert_ne!(code, 0, "{err}");
    Ok(())
}

#[test]
fn verify_and_stats_report_pack_files_and_their_damage() -> Result {
    use ckptstore::{ComputationGraphStore, GradientCheckpoint, StoreOptions};
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let p = path.to_str().ok_or("path")?;
    {
        let store = StoreOptions::new()
            .pack_files(true)
            .pack_threshold(1 << 20)
            .open(&path)?;
        for step in 0..2 {
            let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step);
            c.set_optimizer_state("w", common::bytes(step, 2 << 20));
            store.commit(&c)?;
        }
    }
    let (code, out, err) = common::ckpt(&["verify", p])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("2 pack files, 4.0 MiB (4.0 MiB live)"),
        "{out}"
    );
    let (code, out, _) = common::ckpt(&["stats", p])?;
    assert_eq!(code, 0);
    assert!(out.contains("pack files:     4.0 MiB in 2 files"), "{out}");
    // A file no record names is reported, not counted as damage (past the
    // next id: a commit's in flight); a flipped byte in step 1's pack file
    // is.
    let packs = dir.path().join("run.ckpt.packs");
    std::fs::write(packs.join("00000007.pack"), b"stray")?;
    let (code, out, _) = common::ckpt(&["verify", p])?;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("1 pack file(s) of commits under way"), "{out}");
    let victim = packs.join("00000001.pack");
    let mut bytes = std::fs::read(&victim)?;
    bytes[4242] ^= 1;
    std::fs::write(&victim, bytes)?;
    let (code, out, _) = common::ckpt(&["verify", p])?;
    assert_eq!(code, 3, "{out}");
    assert!(
        out.contains("DAMAGED step 1") && out.contains("00000001.pack"),
        "{out}"
    );
    assert!(!out.contains("DAMAGED step 0"), "{out}");
    Ok(())
}

/// A node's directory of the local tier (the fixture 0.4.0 wrote).
fn tier_copy(dir: &std::path::Path) -> Result<std::path::PathBuf> {
    node_copy(dir, "node0")
}

/// Node `node` of the fixture 0.4.0 wrote (2 nodes of 1 rank, each
/// keeping a copy of the other's shard), copied into `dir`.
fn node_copy(dir: &std::path::Path, node: &str) -> Result<std::path::PathBuf> {
    let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tier-0.4.0")
        .join(node);
    let to = dir.join(node);
    std::fs::create_dir_all(to.join("records"))?;
    for entry in std::fs::read_dir(&from)?.chain(std::fs::read_dir(from.join("records"))?) {
        let path = entry?.path();
        if path.is_file() {
            let rel = path.strip_prefix(&from)?;
            std::fs::copy(&path, to.join(rel))?;
        }
    }
    Ok(to)
}

#[test]
fn verify_checks_a_tier_directory_against_its_records() -> Result {
    let dir = tempfile::tempdir()?;
    let node = tier_copy(dir.path())?;
    let p = node.to_str().ok_or("path")?;
    let (code, out, err) = common::ckpt(&["verify", p])?;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("2 saves recorded, 4 shards and copies of them checked against their records, 4 store steps read, 0 damaged"), "{out}");

    // The record of step 3 names another shard of rank 1 than the copy
    // this node keeps: the copy is reported, exit 3.
    let record = node.join("records/step-00000000000000000003.rank-00000.json");
    let text = std::fs::read_to_string(&record)?;
    let js: serde_json::Value = serde_json::from_str(&text)?;
    let digest = js["digests"][1].as_str().ok_or("digest")?;
    std::fs::write(&record, text.replace(digest, &"ab".repeat(32)))?;
    let (code, out, _) = common::ckpt(&["verify", p])?;
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("DIFFERS copies-of-00001.ckpt step 3"), "{out}");

    // A damaged record is named and counted.
    std::fs::write(&record, &text[..text.len() / 2])?;
    let (code, out, err) = common::ckpt(&["verify", p])?;
    assert_eq!(code, 3, "{out}");
    assert!(
        err.contains("step-00000000000000000003.rank-00000.json: damaged tier record"),
        "{err}"
    );
    assert!(out.contains("1 saves recorded"), "{out}");
    let (code, out, _) = common::ckpt(&["verify", p, "--pages"])?;
    assert_eq!(code, 1, "{out}");
    Ok(())
}

/// Issue 65, item 3: a recorded save whose shard, and the only copy of
/// it, are lost from the nodes' directories cannot be restored, and
/// `verify` of each directory says so (it passed both before).
#[test]
fn verify_reports_a_shard_and_its_copy_missing_from_the_directories() -> Result {
    let dir = tempfile::tempdir()?;
    let (node0, node1) = (
        node_copy(dir.path(), "node0")?,
        node_copy(dir.path(), "node1")?,
    );
    std::fs::remove_file(node0.join("rank-00000.ckpt"))?;
    std::fs::remove_file(node1.join("copies-of-00000.ckpt"))?;
    for (node, lost) in [
        (&node0, "rank-00000.ckpt"),
        (&node1, "copies-of-00000.ckpt"),
    ] {
        let (code, out, err) = common::ckpt(&["verify", node.to_str().ok_or("path")?])?;
        assert_eq!(code, 3, "{out}{err}");
        for step in [2, 3] {
            assert!(
                out.contains(&format!("MISSING {lost} step {step}: rank ")),
                "{out}"
            );
        }
        assert!(out.contains(", 2 damaged"), "{out}");
    }
    // What the other node holds is whole: rank 1's shard and its copy.
    let (code, out, _) = common::ckpt(&["verify", node0.to_str().ok_or("path")?])?;
    assert!(
        code == 3 && !out.contains("copies-of-00001.ckpt step"),
        "{out}"
    );
    Ok(())
}

/// Issue 65, item 3: a store file of the directory that cannot be read is
/// damage (exit 3, named), and the rest is still listed and checked (both
/// stopped with exit 1 at the first such file before).
#[test]
fn ls_and_verify_of_a_directory_read_past_a_store_that_cannot_be_read() -> Result {
    let dir = tempfile::tempdir()?;
    let node = node_copy(dir.path(), "node0")?;
    let p = node.to_str().ok_or("path")?;
    std::fs::write(node.join("copies-of-00001.ckpt"), vec![0x5a; 8192])?;
    let (code, out, err) = common::ckpt(&["ls", p])?;
    assert_eq!(code, 3, "{out}{err}");
    assert!(err.contains("DAMAGED copies-of-00001.ckpt"), "{err}");
    assert!(out.contains("2 complete steps"), "{out}");
    let (code, out, err) = common::ckpt(&["ls", p, "--json"])?;
    assert_eq!(code, 3, "{out}{err}");
    let listed: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(listed[0]["ranks"], serde_json::json!([0]), "{out}");
    let (code, out, err) = common::ckpt(&["verify", p])?;
    assert_eq!(code, 3, "{out}{err}");
    assert!(out.contains("DAMAGED copies-of-00001.ckpt"), "{out}");
    // Rank 0's store was still read, and the lost copy is named too.
    assert!(out.contains("2 store steps read"), "{out}");
    assert!(out.contains("MISSING copies-of-00001.ckpt step 3"), "{out}");
    Ok(())
}
