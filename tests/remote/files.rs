//! A step of files in a bucket (issue 76): a directory saved as one step,
//! unchanged chunks not uploaded again, written back byte for byte.

use std::fs;

use ckptstore::Remote;

use super::Result;

#[test]
fn a_directory_is_one_step_of_the_bucket() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = Remote::open(&format!("file://{}/bucket", dir.path().display()))?;
    let saved = dir.path().join("saved");
    fs::create_dir_all(saved.join("tag"))?;
    let model: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
    fs::write(saved.join("tag/model.pt"), &model)?;
    fs::write(saved.join("latest"), b"tag")?;
    let first = remote.save_dir(7, &saved)?;
    assert!(first.complete);
    fs::write(saved.join("latest"), b"tag2")?;
    let second = remote.save_dir(8, &saved)?;
    assert!(
        second.bytes_uploaded * 3 < first.bytes_uploaded,
        "{first:?} {second:?}"
    );
    assert_eq!(remote.steps()?, vec![7, 8]);
    let back = dir.path().join("back");
    assert_eq!(remote.load_dir(7, &back)?, vec!["latest", "tag/model.pt"]);
    assert_eq!(fs::read(back.join("tag/model.pt"))?, model);
    assert_eq!(fs::read(back.join("latest"))?, b"tag");
    assert!(remote.verify()?.is_ok());
    Ok(())
}
