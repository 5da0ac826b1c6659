//! Opening something that is not a store gives a clear error, never a panic:
//! a directory, JSON, random bytes, truncated stores, a redb file of another
//! program.

use crate::common;

use std::path::Path;

use ckptstore::{CheckpointStore, Error};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

fn open_err(path: &Path) -> Error {
    match CheckpointStore::open(path) {
        Ok(_) => panic!("{} opened as a store", path.display()),
        Err(e) => e,
    }
}

#[test]
fn bad_files_are_refused_with_their_path() -> Result {
    let dir = tempfile::tempdir()?;

    let e = open_err(dir.path());
    assert!(matches!(e, Error::Open { .. }), "directory: {e:?}");
    assert!(e.to_string().contains(&dir.path().display().to_string()));

    let json = dir.path().join("step.json");
    common::checkpoint(1, &[10])?.save(&json)?;
    let e = open_err(&json);
    assert!(matches!(e, Error::Open { .. }), "json: {e:?}");
    assert!(e.to_string().contains("step.json"), "{e}");

    let random = dir.path().join("random.bin");
    std::fs::write(&random, common::bytes(9, 1 << 20))?;
    assert!(matches!(open_err(&random), Error::Open { .. }));

    // A real store, truncated at several points.
    let good = dir.path().join("good.ckpt");
    {
        let store = CheckpointStore::open(&good)?;
        for step in 0..4 {
            store.commit(&common::checkpoint(step, &[3 << 20])?)?;
        }
    }
    let full = std::fs::read(&good)?;
    for cut in [
        1,
        100,
        512,
        4096,
        full.len() / 3,
        full.len() / 2,
        full.len() - 4096,
    ] {
        let p = dir.path().join(format!("cut{cut}.ckpt"));
        std::fs::write(&p, &full[..cut])?;
        match CheckpointStore::open(&p) {
            Err(e) => assert!(e.to_string().contains(&format!("cut{cut}")), "{e}"),
            // redb may repair a file cut inside unused space; then every
            // step it still lists must read back intact or as an error.
            Ok(store) => {
                for step in store.steps()? {
                    if let Ok(Some(c)) = store.get(step) {
                        assert_eq!(
                            c,
                            common::checkpoint(step, &[3 << 20])?.with_time(c.timestamp)
                        );
                    }
                }
            }
        }
    }

    // A redb database that some other program made.
    let other = dir.path().join("other.redb");
    {
        let db = redb::Database::create(&other)?;
        let txn = db.begin_write()?;
        {
            let def: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("users");
            txn.open_table(def)?.insert("ann", 1)?;
        }
        txn.commit()?;
    }
    let e = open_err(&other);
    assert!(matches!(e, Error::NotAStore { .. }), "{e:?}");
    assert!(CheckpointStore::open_read_only(&other).is_err());
    Ok(())
}

trait WithTime {
    fn with_time(self, t: u64) -> Self;
}

impl WithTime for ckptstore::GradientCheckpoint {
    fn with_time(mut self, t: u64) -> Self {
        self.timestamp = t;
        self
    }
}
