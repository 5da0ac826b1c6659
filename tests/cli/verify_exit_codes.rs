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
