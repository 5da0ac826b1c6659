//! "Not compressed" keeps a bucket readable by 0.4 (issue 73, item 3): a
//! writer that does not compress never writes a step that names a
//! compressed chunk (it uploads raw a chunk it knows only compressed),
//! and a collection keeps each chunk in the form it found it, so a
//! format-3 bucket collected on `s3://` (where compression is on by
//! default) stays format 3.

use ckptstore::{CheckpointStore, Remote, Retention};
use object_store::ObjectStoreExt;

use super::compressed::{manifest_formats, state};
use super::Result;
use crate::common::{bytes, ckpt};

/// The `"format"` of every step manifest under the bucket at `url`
/// (`file://` or, through the test server's variables, `s3://`).
fn formats(url: &str) -> Result<Vec<u64>> {
    if let Some(path) = url.strip_prefix("file://") {
        let mut found = manifest_formats(std::path::Path::new(path))?;
        found.sort_unstable();
        return Ok(found);
    }
    let rest = url.strip_prefix("s3://").ok_or("an s3:// URL")?;
    let (bucket, prefix) = rest.split_once('/').ok_or("a prefix")?;
    let s3 = object_store::aws::AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .build()?;
    // The S3 client needs a tokio runtime under it.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        use futures::TryStreamExt;
        let at = format!("{prefix}/manifests").into();
        let listed: Vec<_> = object_store::ObjectStore::list(&s3, Some(&at))
            .try_collect()
            .await?;
        let mut found = Vec::new();
        for meta in listed {
            let body = s3.get(&meta.location).await?.bytes().await?;
            let json: serde_json::Value = serde_json::from_slice(&body)?;
            found.push(json["format"].as_u64().ok_or("no format")?);
        }
        found.sort_unstable();
        Ok(found)
    })
}

#[test]
fn a_push_without_compression_after_a_compressed_one_writes_format_3() -> Result {
    let dir = tempfile::tempdir()?;
    let url = format!("file://{}", dir.path().join("bucket").display());
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    store.commit(&state(1)?)?;
    Remote::open(&url)?.with_compression(true).push(&store)?;
    assert_eq!(formats(&url)?, vec![4]);
    // Step 2 shares every tensor with step 1, whose chunks lie compressed.
    store.commit(&state(2)?)?;
    let report = Remote::open(&url)?.with_compression(false).push(&store)?;
    assert_eq!(formats(&url)?, vec![3, 4]);
    assert!(report.bytes_uploaded > 4 << 20, "{report:?}");
    assert!(Remote::open(&url)?.get(2)? == store.get(2)?);
    // A third step without compression reuses the raw chunks.
    store.commit(&state(3)?)?;
    let report = Remote::open(&url)?.with_compression(false).push(&store)?;
    assert!(report.bytes_uploaded < 1 << 20, "{report:?}");
    assert_eq!(formats(&url)?, vec![3, 3, 4]);
    Ok(())
}

/// Step `step`: `state`'s tensors and 8 MiB of its own, so that a pack
/// of a deleted step is mostly dead and a collection rewrites it.
fn moving(step: u64) -> Result<ckptstore::GradientCheckpoint> {
    let mut c = state(step)?;
    c.set_optimizer_state("moving", bytes(step + 50, 8 << 20));
    Ok(c)
}

/// Steps 1-2 pushed raw to `url`, then a collection with compression
/// on (`collect`) that keeps step 2 and rewrites step 1's pack: every
/// manifest stays format 3 and step 2 loads.
fn collected_stays_format_3(url: &str, collect: &dyn Fn(&str) -> Result<u64>) -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let remote = Remote::open(url)?.with_compression(false);
    for step in 1..3 {
        store.commit(&moving(step)?)?;
        remote.push(&store)?;
    }
    assert_eq!(formats(url)?, vec![3, 3]);
    let repacked = collect(url)?;
    assert!(repacked > 0, "nothing repacked");
    assert!(formats(url)?.iter().all(|&f| f == 3), "{:?}", formats(url)?);
    assert!(Remote::open(url)?.get(2)? == store.get(2)?);
    Ok(())
}

#[test]
fn a_collection_keeps_each_chunk_in_its_form_in_a_directory() -> Result {
    let dir = tempfile::tempdir()?;
    let url = format!("file://{}", dir.path().join("bucket").display());
    collected_stays_format_3(&url, &|url| {
        let remote = Remote::open(url)?.with_compression(true);
        let report = remote.gc(&Retention::new().keep_last(1))?;
        assert_eq!(report.steps_removed, vec![1], "{report:?}");
        Ok(report.packs_repacked)
    })
}

#[test]
fn ckpt_gc_on_s3_keeps_a_format_3_bucket_format_3() -> Result {
    let Some((_server, bucket)) =
        super::garage::server("ckpt_gc_on_s3_keeps_a_format_3_bucket_format_3")
    else {
        return Ok(());
    };
    let url = format!("s3://{bucket}/{}", super::garage::fresh_prefix());
    assert!(Remote::open(&url)?.compression());
    collected_stays_format_3(&url, &|url| {
        let (code, out, err) = ckpt(&["gc", url, "--keep-last", "1"])?;
        assert_eq!(code, 0, "{out}{err}");
        // "rewrote the needed chunks of mostly unneeded packs into N packs"
        let said = out
            .split("into ")
            .nth(1)
            .ok_or(format!("no repack: {out}"))?;
        let n = said.split(' ').next().ok_or(out.clone())?;
        Ok(n.parse()?)
    })
}
