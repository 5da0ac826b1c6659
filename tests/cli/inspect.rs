//! `ckpt ls`, `show` and `stats`, as text and as JSON.

use crate::common;

use ckptstore::CheckpointStore;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn ls_show_and_stats_describe_the_store() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let p = path.to_str().ok_or("path")?;
    {
        let store = CheckpointStore::open(&path)?;
        for step in [5, 10, 15] {
            store.commit(&common::deterministic(step))?;
        }
        store.pin(10)?;
    }

    let (code, out, err) = common::ckpt(&["ls", p])?;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("cid_loss_15") && out.contains("3 steps"),
        "{out}"
    );
    assert!(out.contains("2025-06-15"), "time not shown: {out}");
    let (code, out, _) = common::ckpt(&["ls", p, "--json"])?;
    assert_eq!(code, 0);
    let rows: serde_json::Value = serde_json::from_str(&out)?;
    let steps: Vec<u64> = rows
        .as_array()
        .ok_or("not an array")?
        .iter()
        .filter_map(|r| r["step"].as_u64())
        .collect();
    assert_eq!(steps, vec![5, 10, 15]);
    assert_eq!(rows[2]["metrics"]["loss"].as_f64(), Some(1.0 / 16.0));

    let (code, out, _) = common::ckpt(&["show", p, "latest"])?;
    assert_eq!(code, 0);
    assert!(
        out.contains("step:      15") && out.contains("frozen") && out.contains("moving"),
        "{out}"
    );
    assert!(out.contains("1 nodes"), "{out}");
    // What the commit wrote: "frozen" is the same in every step.
    assert!(
        out.contains("written:   ") && out.contains("shared with earlier steps"),
        "{out}"
    );
    assert!(!out.contains("save:"), "no cost recorded: {out}");
    let (_, out, _) = common::ckpt(&["show", p, "10"])?;
    assert!(out.contains("(pinned)"), "{out}");
    let (code, out, _) = common::ckpt(&["show", p, "10", "--json"])?;
    assert_eq!(code, 0);
    let info: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(info["blobs"]["frozen"].as_u64(), Some(300_000));
    let (written, logical) = (
        info["bytes_written"].as_u64(),
        info["logical_bytes"].as_u64(),
    );
    assert!(written.zip(logical).is_some_and(|(w, l)| w < l), "{info}");

    let (code, out, _) = common::ckpt(&["stats", p, "--json"])?;
    assert_eq!(code, 0);
    let stats: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(stats["steps"].as_u64(), Some(3));
    let (_, out, _) = common::ckpt(&["stats", p])?;
    assert!(out.contains("dedup ratio"), "{out}");

    // Errors: one line, exit 1; usage errors exit 2.
    let (code, _, err) = common::ckpt(&["show", p, "99"])?;
    assert_eq!(code, 1);
    assert_eq!(err.trim(), "ckpt: step 99 is not in the store");
    let (code, _, err) = common::ckpt(&["show", p, "soon"])?;
    assert_eq!((code, err.lines().count()), (1, 1), "{err}");
    let missing = dir.path().join("missing.ckpt");
    let (code, _, err) = common::ckpt(&["ls", missing.to_str().ok_or("path")?])?;
    assert_eq!(code, 1);
    assert!(err.contains("no such store"), "{err}");
    assert!(!missing.exists(), "ls created a store");
    let (code, _, _) = common::ckpt(&["ls"])?;
    assert_eq!(code, 2);
    Ok(())
}

#[test]
fn show_and_ls_read_a_steps_save_record() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let p = path.to_str().ok_or("path")?;
    {
        let store = CheckpointStore::open(&path)?;
        let mut ckpt = common::deterministic(3).with_metric("acc", 0.5);
        ckpt.save_record = ckptstore::SaveRecord::default()
            .with_staging(ckptstore::Staging::new(0.25, 0.0625).ok_or("finite")?)
            .with_name("lightning:ckpts/epoch=0.ckpt");
        store.commit(&ckpt)?;
    }
    let (code, out, err) = common::ckpt(&["show", p, "3"])?;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("save:      blocked 0.062 s, staging 0.250 s"),
        "{out}"
    );
    assert!(
        out.contains("saved as:  lightning:ckpts/epoch=0.ckpt"),
        "{out}"
    );
    assert!(
        !out.contains("ckptstore."),
        "the record is not a metric: {out}"
    );
    let (_, out, _) = common::ckpt(&["show", p, "3", "--json"])?;
    let info: serde_json::Value = serde_json::from_str(&out)?;
    let record = &info["save_record"];
    assert_eq!(record["staging"]["blocked_seconds"].as_f64(), Some(0.0625));
    assert_eq!(record["names"][0], "lightning:ckpts/epoch=0.ckpt");
    let (_, out, _) = common::ckpt(&["ls", p])?;
    assert!(
        out.contains("acc=0.5 loss=0.25 lightning:ckpts/epoch=0.ckpt"),
        "{out}"
    );
    let (_, out, _) = common::ckpt(&["ls", p, "--json"])?;
    let rows: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(
        rows[0]["save_record"]["staging"]["staging_seconds"].as_f64(),
        Some(0.25)
    );
    Ok(())
}
