//! A step of files (issue 76): any directory a framework wrote, committed
//! as one step and written back byte for byte, unchanged chunks not
//! written again, nothing written outside the directory asked for.

use std::fs;
use std::path::Path;

use ckptstore::{CheckpointStore, Entry, Error, GradientCheckpoint, Step, FILES_ENTRY};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// A directory as `DeepSpeed` leaves one: a tag folder of rank files, a
/// `latest` pointer, an empty file, and 3 MiB of "model" bytes.
fn framework_dir(root: &Path, salt: u8) -> Result {
    fs::create_dir_all(root.join("global_step100"))?;
    let model: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
    fs::write(
        root.join("global_step100/mp_rank_00_model_states.pt"),
        &model,
    )?;
    let optim = vec![salt; 100_000];
    fs::write(
        root.join("global_step100/zero_pp_rank_0_optim_states.pt"),
        optim,
    )?;
    fs::write(root.join("latest"), b"global_step100")?;
    fs::write(root.join("empty"), b"")?;
    Ok(())
}

/// Every file under `dir`, by path, with its bytes.
fn contents(dir: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            for (name, bytes) in contents(&path)? {
                let prefix = path.file_name().and_then(|n| n.to_str()).ok_or("name")?;
                found.push((format!("{prefix}/{name}"), bytes));
            }
        } else {
            let name = path.file_name().and_then(|n| n.to_str()).ok_or("name")?;
            found.push((name.to_owned(), fs::read(&path)?));
        }
    }
    found.sort();
    Ok(found)
}

#[test]
fn a_directory_is_one_step_and_comes_back_byte_for_byte() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let saved = dir.path().join("saved");
    framework_dir(&saved, 1)?;
    let first = store.save_dir(100, &saved)?;
    assert_eq!(store.steps()?, vec![100]);

    let back = dir.path().join("out/back");
    let paths = store.load_dir(100, &back)?;
    assert_eq!(paths.len(), 4, "{paths:?}");
    assert_eq!(contents(&back)?, contents(&saved)?);

    // A second save with the optimizer file changed writes that file's
    // chunks, not the model's again.
    framework_dir(&saved, 2)?;
    let second = store.save_dir(101, &saved)?;
    assert!(
        second.bytes_written * 3 < first.bytes_written,
        "{} then {}",
        first.bytes_written,
        second.bytes_written
    );
    assert!(store.verify()?.is_ok());
    Ok(())
}

#[test]
fn a_load_into_a_directory_that_holds_files_changes_nothing() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let saved = dir.path().join("saved");
    framework_dir(&saved, 1)?;
    store.save_dir(100, &saved)?;
    let there = dir.path().join("there");
    fs::create_dir_all(&there)?;
    fs::write(there.join("mine"), b"keep")?;
    let e = store
        .load_dir(100, &there)
        .err()
        .ok_or("a load over files")?;
    assert!(e.is_io(), "{e}");
    assert_eq!(
        contents(&there)?,
        vec![("mine".to_owned(), b"keep".to_vec())]
    );
    // No half-written directory is left beside it.
    let left: Vec<_> = fs::read_dir(dir.path())?
        .filter_map(std::result::Result::ok)
        .map(|e| e.file_name())
        .collect();
    assert!(
        left.iter().all(|n| !n.to_string_lossy().contains(".tmp")),
        "{left:?}"
    );
    // An empty directory is taken.
    let empty = dir.path().join("empty");
    fs::create_dir(&empty)?;
    store.load_dir(100, &empty)?;
    assert_eq!(contents(&empty)?, contents(&saved)?);
    Ok(())
}

#[test]
fn only_steps_of_files_load_and_only_inside_the_directory() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let mut plain = Step::new(1);
    plain.insert("w", Entry::Blob(vec![1; 10]));
    store.commit(&GradientCheckpoint::from(plain))?;
    let e = store
        .load_dir(1, &dir.path().join("a"))
        .err()
        .ok_or("a step of no files")?;
    assert!(matches!(e, Error::InvalidCheckpoint { step: 1, .. }), "{e}");

    // A listing naming a path outside the directory (a damaged or hostile
    // store) writes nothing.
    let mut hostile = Step::new(2);
    let listing = br#"{"format":1,"files":[{"path":"../escaped","len":3,"mode":420}]}"#;
    hostile.insert(FILES_ENTRY, Entry::Blob(listing.to_vec()));
    hostile.insert("files/../escaped", Entry::Blob(b"bad".to_vec()));
    store.commit(&GradientCheckpoint::from(hostile))?;
    let target = dir.path().join("inner/b");
    let e = store.load_dir(2, &target).err().ok_or("a path outside")?;
    assert!(matches!(e, Error::InvalidCheckpoint { step: 2, .. }), "{e}");
    assert!(!dir.path().join("inner/escaped").exists() && !target.exists());
    assert!(matches!(
        store.load_dir(3, &target),
        Err(Error::StepNotFound { step: 3 })
    ));
    Ok(())
}

#[cfg(unix)]
#[test]
fn links_are_refused_and_permissions_kept() -> Result {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let saved = dir.path().join("saved");
    fs::create_dir_all(&saved)?;
    fs::write(saved.join("run.sh"), b"#!/bin/sh\n")?;
    fs::set_permissions(saved.join("run.sh"), fs::Permissions::from_mode(0o750))?;
    store.save_dir(1, &saved)?;
    store.load_dir(1, &dir.path().join("back"))?;
    let mode = fs::metadata(dir.path().join("back/run.sh"))?
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o750);

    std::os::unix::fs::symlink(saved.join("run.sh"), saved.join("link"))?;
    let e = store.save_dir(2, &saved).err().ok_or("a link")?;
    assert!(matches!(e, Error::InvalidCheckpoint { step: 2, .. }), "{e}");
    assert_eq!(store.steps()?, vec![1]);
    Ok(())
}
