//! `CheckpointStore::copy_to` (`ckpt cp`): a store is its file and its pack
//! files; the copy takes both, whole and checked, and is named only when
//! complete. Copying the file alone gives a store that says what is missing.

use ckptstore::{CheckpointStore, Dtype, Error, StoreOptions, Tensor};

use crate::common;
use crate::pack_files::{packed, step_of};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn a_copy_holds_every_step_and_pin_in_its_own_pack_files() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = packed(&path)?;
    for step in 0..3 {
        let mut ckpt = step_of(step);
        let w = common::bytes(10 + step, 2 << 20);
        ckpt.set_tensor("w", Tensor::new(Dtype::F32, vec![1 << 19], w)?);
        store.commit(&ckpt)?;
    }
    // A small step, whose chunks stay in the redb file.
    store.commit(&common::checkpoint(3, &[1000])?)?;
    store.pin(1)?;

    let to = dir.path().join("backup.ckpt");
    let copied = store.copy_to(&to, StoreOptions::new().pack_threshold(1 << 20))?;
    assert_eq!(copied, [0, 1, 2, 3]);
    let copy = CheckpointStore::open(&to)?;
    for step in 0..4 {
        assert_eq!(copy.get(step)?, store.get(step)?, "step {step}");
    }
    assert_eq!(copy.pinned()?, [1]);
    assert_ne!(copy.store_id()?, store.store_id()?);
    // Deduplicated as in the original: "frozen" once, the rest per step.
    assert_eq!(copy.stats()?.stored_bytes, store.stats()?.stored_bytes);
    // The large blobs and tensors went to pack files (one per blob: the
    // copy streams them).
    let packs = common::pack_files(&to).len();
    assert!(
        packs >= 3 && packs as u64 == copy.stats()?.pack_files,
        "{packs}"
    );
    let report = copy.verify()?;
    assert!(report.is_ok(), "{report:?}");
    // Nothing but the two stores is left in the directory.
    let names = common::dir_names(dir.path())?;
    assert_eq!(
        names,
        [
            "backup.ckpt",
            "backup.ckpt.packs",
            "run.ckpt",
            "run.ckpt.packs"
        ]
    );

    // A copy never lands on an existing store.
    let err = store
        .copy_to(&to, StoreOptions::new())
        .expect_err("copied over a store");
    assert!(
        err.is_io() && err.to_string().contains("backup.ckpt"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_damaged_step_stops_the_copy_and_leaves_nothing() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = packed(&path)?;
    store.commit(&step_of(0))?;
    store.commit(&step_of(1))?;
    let moving = step_of(1).optimizer_state["moving"].clone();
    common::flip_stored_byte(&path, &moving[1000..1064], 8)?;

    let err = store
        .copy_to(dir.path().join("copy.ckpt"), StoreOptions::new())
        .expect_err("copied a damaged step");
    assert!(
        matches!(err, Error::Corrupt { step: Some(1), .. }),
        "{err:?}"
    );
    assert_eq!(
        common::dir_names(dir.path())?,
        ["run.ckpt", "run.ckpt.packs"]
    );
    Ok(())
}

#[test]
fn the_file_copied_without_its_pack_files_names_what_is_missing() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    packed(&path)?.commit(&step_of(0))?;
    let alone = dir.path().join("alone.ckpt");
    std::fs::copy(&path, &alone)?;

    let store = CheckpointStore::open_read_only(&alone)?;
    let err = store.get(0).expect_err("read without its pack files");
    let text = err.to_string();
    assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
    assert!(
        text.contains("alone.ckpt.packs") && text.contains("ckpt cp"),
        "{text}"
    );
    Ok(())
}

#[test]
fn remove_store_takes_the_pack_files_and_nothing_else() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    {
        let store = packed(&path)?;
        store.commit(&step_of(0))?;
        // Held by a writer: refused, nothing deleted.
        let err = CheckpointStore::remove_store(&path).expect_err("removed a store in use");
        assert!(err.is_locked(), "{err:?}");
        assert!(path.exists() && !common::pack_files(&path).is_empty());
    }
    assert!(CheckpointStore::remove_store(&path)?);
    assert!(common::dir_names(dir.path())?.is_empty());
    assert!(!CheckpointStore::remove_store(&path)?);

    // A file that is not a store is not deleted.
    let other = dir.path().join("notes.txt");
    let text = "not a store, but a long enough text to be read";
    std::fs::write(&other, text)?;
    CheckpointStore::remove_store(&other).expect_err("removed a file that is not a store");
    assert_eq!(std::fs::read_to_string(&other)?, text);
    Ok(())
}
