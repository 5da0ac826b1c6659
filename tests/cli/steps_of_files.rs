//! `ckpt save-dir` and `ckpt load-dir` (issue 76): a directory as one step
//! of a store file or a bucket, and back.

use std::fs;

use crate::common;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn a_directory_goes_into_a_store_and_a_bucket_and_comes_back() -> Result {
    let dir = tempfile::tempdir()?;
    let saved = dir.path().join("saved");
    fs::create_dir_all(saved.join("tag"))?;
    fs::write(saved.join("tag/model.pt"), vec![7u8; 300_000])?;
    fs::write(saved.join("latest"), b"tag")?;
    let saved = saved.to_str().ok_or("path")?;
    let store = dir.path().join("run.ckpt");
    let bucket = format!("file://{}/bucket", dir.path().display());
    for (i, target) in [store.to_str().ok_or("path")?, bucket.as_str()]
        .into_iter()
        .enumerate()
    {
        let (code, out, err) = common::ckpt(&["save-dir", target, "12", saved])?;
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("as step 12"), "{out}");
        let back = dir.path().join(format!("back{i}"));
        let back = back.to_str().ok_or("path")?;
        let (code, out, err) = common::ckpt(&["load-dir", target, "latest", back])?;
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("wrote 2 files"), "{out}");
        assert_eq!(
            fs::read(format!("{back}/tag/model.pt"))?,
            vec![7u8; 300_000]
        );
        let (code, _, err) = common::ckpt(&["verify", target])?;
        assert_eq!(code, 0, "{err}");
        // Into a directory that holds files: refused, nothing changed.
        let (code, _, err) = common::ckpt(&["load-dir", target, "12", back])?;
        assert_ne!(code, 0);
        assert!(err.contains(back), "{err}");
    }
    Ok(())
}
