//! `ckpt export` writes the original JSON format; `ckpt import` commits such
//! files; the round trip is exact.

use crate::common;

use ckptstore::{CheckpointStore, GradientCheckpoint};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn export_then_import_round_trips() -> Result {
    let dir = tempfile::tempdir()?;
    let a = dir.path().join("a.ckpt");
    let b = dir.path().join("b.ckpt");
    {
        let store = CheckpointStore::open(&a)?;
        for step in 0..3 {
            store.commit(&common::deterministic(step))?;
        }
    }
    let mut files = Vec::new();
    for step in ["0", "1", "latest"] {
        let file = dir.path().join(format!("step-{step}.json"));
        let f = file.to_str().ok_or("path")?;
        let (code, out, err) = common::ckpt(&["export", a.to_str().ok_or("path")?, step, "-o", f])?;
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("exported step"), "{out}");
        files.push(file);
    }
    // The exported file is the original format.
    let loaded = GradientCheckpoint::load(&files[2])?;
    assert!(loaded == common::deterministic(2));

    let mut args = vec!["import".to_owned(), b.to_str().ok_or("path")?.to_owned()];
    args.extend(files.iter().map(|f| f.to_string_lossy().into_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = common::ckpt(&args)?;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out.lines()
            .filter(|l| l.starts_with("imported step"))
            .count(),
        3,
        "{out}"
    );
    // Importing again is refused (the steps exist) unless --replace.
    let (code, _, err) = common::ckpt(&args)?;
    assert_eq!(code, 1);
    assert!(err.contains("already stored"), "{err}");
    let mut replace = args.clone();
    replace.push("--replace");
    assert_eq!(common::ckpt(&replace)?.0, 0);

    let store = CheckpointStore::open_read_only(&b)?;
    for step in 0..3 {
        assert!(
            store.get(step)? == Some(common::deterministic(step)),
            "step {step}"
        );
    }
    // A file that is not a checkpoint: one-line error naming it.
    let junk = dir.path().join("junk.json");
    std::fs::write(&junk, b"[1,2")?;
    let (code, _, err) = common::ckpt(&[
        "import",
        b.to_str().ok_or("path")?,
        junk.to_str().ok_or("path")?,
    ])?;
    assert_eq!(code, 1);
    assert!(
        err.contains("junk.json") && err.lines().count() == 1,
        "{err}"
    );
    Ok(())
}
