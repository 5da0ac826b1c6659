//! Creating a store leaves either no file or a complete store, and no
//! temporary file behind. (A process killed while redb wrote a new file's
//! header used to leave a file no later open accepted; the long kill -9 run
//! found it.)

use crate::common;

use ckptstore::{CheckpointStore, ComputationGraphStore, Error, GradientCheckpoint};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn a_new_store_appears_whole_and_alone() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    CheckpointStore::open(&path)?
        .commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    assert_eq!(common::dir_names(dir.path())?, vec!["run.ckpt".to_owned()]);
    // Reopening an existing store does not go through creation again.
    assert_eq!(CheckpointStore::open(&path)?.steps()?, vec![1]);
    assert_eq!(common::dir_names(dir.path())?, vec!["run.ckpt".to_owned()]);

    // A store in a missing directory: an error naming the directory, no
    // debris.
    let missing = dir.path().join("no/such/dir/run.ckpt");
    let err = CheckpointStore::open(&missing).expect_err("opened in a missing directory");
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("no/such/dir:"), "{err}");
    assert_eq!(common::dir_names(dir.path())?, vec!["run.ckpt".to_owned()]);
    Ok(())
}
