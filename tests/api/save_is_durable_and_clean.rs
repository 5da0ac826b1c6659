//! `save` replaces the target whole and never leaves its temporary file
//! behind, whether it succeeds or fails.

use crate::common;

use ckptstore::{ComputationGraphStore, Error, GradientCheckpoint};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn save_overwrites_whole_and_cleans_up_on_failure() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("ckpt.json");
    let mut a = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
    a.set_optimizer_state("w", vec![7; 10_000]);
    a.save(&path)?;
    let b = GradientCheckpoint::new(ComputationGraphStore::new(), 2);
    b.save(&path)?;
    assert_eq!(GradientCheckpoint::load(&path)?, b);
    assert_eq!(common::dir_names(dir.path())?, vec!["ckpt.json".to_owned()]);

    // The target is a directory: the rename fails, the temp file goes.
    let blocked = dir.path().join("blocked");
    std::fs::create_dir(&blocked)?;
    std::fs::write(blocked.join("keep"), b"x")?;
    let err = a.save(&blocked).expect_err("saved over a directory");
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("blocked"), "{err}");
    assert_eq!(
        common::dir_names(dir.path())?,
        vec!["blocked".to_owned(), "ckpt.json".to_owned()]
    );

    // A missing directory: nothing is created.
    let err = a
        .save(&dir.path().join("nope/ckpt.json"))
        .expect_err("no dir");
    assert!(matches!(err, Error::Io { .. }), "{err:?}");

    // Loading garbage is an error naming the file.
    let junk = dir.path().join("junk.json");
    std::fs::write(&junk, b"{\"graph\": 3")?;
    let err = GradientCheckpoint::load(&junk).expect_err("junk loaded");
    assert!(matches!(err, Error::Json { .. }) && err.to_string().contains("junk.json"));
    Ok(())
}
