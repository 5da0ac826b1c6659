//! `ckpt stats URL` and `ckpt show URL STEP` count what the bucket stores
//! (issue 73, item 4): a chunk two writers packed apart (a fresh remote
//! saving a shard packs a shared tensor again, as documented) is two
//! stored copies, counted twice, and the step that uploaded it again says
//! so in its "new" bytes.

use ckptstore::{CheckpointStore, Remote};

use super::compressed::state;
use super::Result;
use crate::common::ckpt;

/// Bytes of the files under `dir`.
fn bytes_under(dir: &std::path::Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        total += entry?.metadata()?.len();
    }
    Ok(total)
}

#[test]
fn stats_count_every_stored_copy_of_a_chunk() -> Result {
    let dir = tempfile::tempdir()?;
    let bucket = dir.path().join("bucket");
    let url = format!("file://{}", bucket.display());
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    for step in 1..3 {
        store.commit(&state(step)?)?;
    }
    Remote::open(&url)?.with_compression(true).push(&store)?;
    let fresh = Remote::open(&url)?.with_compression(true);
    let info = fresh.upload_shard(3, 0, 1, &state(3)?.into_step())?;
    fresh.commit_global(3, &[info.shard])?;
    // The shared tensors went up again.
    assert!(info.bytes_uploaded > 2 << 20, "{info:?}");
    let (code, out, err) = ckpt(&["stats", &url, "--json"])?;
    assert_eq!(code, 0, "{err}");
    let totals: serde_json::Value = serde_json::from_str(&out)?;
    let stored = totals["stored_bytes"].as_u64().ok_or("stored_bytes")?;
    // Every pack byte belongs to a listed step: the stats hold them all.
    assert_eq!(stored, bytes_under(&bucket.join("packs"))?, "{out}");
    let summaries = Remote::open(&url)?.summaries()?;
    let third = summaries.iter().find(|s| s.step == 3).ok_or("step 3")?;
    let raw = state(3)?
        .tensors
        .values()
        .map(|t| t.data.len() as u64)
        .sum::<u64>();
    assert!(third.bytes_written >= raw, "{third:?}: {raw}");
    let chunk_bytes = totals["chunk_bytes"].as_u64().ok_or("chunk_bytes")?;
    // The tensors' chunks are stored twice: pushed once, saved again.
    assert!(chunk_bytes >= 2 * raw, "{out}: {raw}");
    Ok(())
}
