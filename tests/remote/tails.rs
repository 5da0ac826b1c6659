//! A blob's small end (its last pieces under 64 KiB): manifest format 2
//! packed it with a shard's small blobs ("tails", to spare a chunk
//! object); a format-3 shard keeps it as a chunk like any other, in its
//! packs. Shards of formats 1 and 2, and format-3 shards with tails (the
//! 0.4.0 fixture), read the same.

use std::path::Path;

use ckptstore::{Dtype, Entry, Error, Remote, Step, Tensor};

use super::promise::copy_dir;
use super::Result;
use crate::common::bytes;

const MIB: usize = 1 << 20;

/// Four tensors of 1 MiB (each a chunk of 1 MiB - 128 B and one of 128
/// bytes), a blob of 3 MiB + 5 B, and a small blob.
fn shard(step: u64) -> Result<Step> {
    let mut c = Step::new(step);
    c.timestamp = 1_800_000_000 + step;
    for i in 0..4u64 {
        let t = Tensor::new(Dtype::F32, vec![256, 1024], bytes(step * 10 + i, MIB))?;
        c.insert(format!("w{i}"), Entry::Tensor(t));
    }
    c.insert("odd", Entry::Blob(bytes(step + 99, 3 * MIB + 5)));
    c.insert("rng", Entry::Blob(bytes(step + 7, 100)));
    Ok(c)
}

/// A directory bucket in a new temporary directory.
fn dir_bucket() -> Result<(tempfile::TempDir, Remote)> {
    let dir = tempfile::tempdir()?;
    let remote = Remote::open(&format!("file://{}", dir.path().display()))?;
    Ok((dir, remote))
}

fn objects(dir: &Path, folder: &str) -> Result<Vec<std::path::PathBuf>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir.join(folder))? {
        found.push(entry?.path());
    }
    Ok(found)
}

#[test]
fn a_blobs_small_end_is_a_chunk_in_the_shards_packs() -> Result {
    let (dir, remote) = dir_bucket()?;
    let c = shard(1)?;
    let info = remote.commit_shard(1, 0, 1, &c)?;
    assert!(info.complete);
    // Two chunks per 1 MiB tensor (1 MiB - 128 B, then 128 B), four for
    // "odd" (its last 389 bytes a chunk), and the packed chunk of the
    // small blob: one pack object, no chunk objects, no tails (format 2
    // packed the small ends with the small blobs, to spare an object per
    // chunk; in packs that spares nothing).
    assert_eq!(objects(dir.path(), "packs")?.len(), 1);
    assert!(!dir.path().join("chunks").exists());
    let manifest =
        std::fs::read_to_string(&objects(dir.path(), "shards/00000000000000000001")?[0])?;
    assert!(manifest.starts_with(r#"{"format":3,"#), "{manifest}");
    assert_eq!(manifest.matches(r#""tail":"#).count(), 0, "{manifest}");
    assert!(remote.get_shard(1, 0)? == Some(c.clone()));
    // Pieces: inside a small end, across a chunk's end into it, a whole
    // entry, and a small blob.
    let global = remote.open_global(1)?.ok_or("complete")?;
    let w2 = c.entries["w2"].bytes();
    let odd = c.entries["odd"].bytes();
    let end = 3 * (MIB - 128);
    let pieces = [
        (0, "w2", MIB as u64 - 100, 50),
        (0, "odd", end as u64 - 10, 15),
        (0, "w2", 0, MIB as u64),
        (0, "rng", 10, 20),
    ];
    let got = remote.read_pieces(&global, &pieces)?;
    assert_eq!(got[0], w2[MIB - 100..MIB - 50]);
    assert_eq!(got[1], odd[end - 10..end + 5]);
    assert!(got[2] == *w2);
    assert_eq!(got[3], c.entries["rng"].bytes()[10..30]);
    let verified = remote.verify()?;
    assert!(verified.is_ok() && verified.steps_ok == 1, "{verified:?}");
    // A tensor unchanged in the next step: none of it goes again (its
    // small end went again while it was packed with the small blobs).
    let mut next = shard(2)?;
    next.insert("w0", c.entries["w0"].clone());
    let info = remote.commit_shard(2, 0, 1, &next)?;
    assert!(info.bytes_skipped >= MIB as u64, "{info:?}");
    Ok(())
}

/// A tail (format 2's, in a format-3 shard of the 0.4.0 fixture) is
/// checked against its own hash: a flipped byte in rank 0's tail fails a
/// read of it, not of rank 1's; rank 0's packed chunk as a whole fails
/// its hash.
#[test]
fn a_damaged_tail_fails_its_reads_only() -> Result {
    let dir = tempfile::tempdir()?;
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bucket-0.4.0");
    copy_dir(&fixture, dir.path())?;
    let remote = Remote::open(&format!("file://{}", dir.path().display()))?;
    let global = remote.open_global(5)?.ok_or("complete")?;
    let before = remote.read_pieces(&global, &[(0, "params", 0, 66_000)])?;
    // Rank 0's shard: its packed chunk (the tail at offset 8) in a pack.
    let name = objects(dir.path(), "shards/00000000000000000005")?
        .into_iter()
        .find(|p| p.to_string_lossy().contains("/000000-of-000002-"))
        .ok_or("rank 0's shard")?;
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(&name)?)?;
    let packed_hash = manifest["packed"]["hash"].as_str().ok_or("packed")?;
    let at = |i: usize| manifest["index"][packed_hash][i].as_u64().ok_or("indexed");
    let (pack, base) = (at(0)?, at(1)?);
    let pack = manifest["packs"][pack as usize]["hash"]
        .as_str()
        .ok_or("a pack")?;
    let packed = dir.path().join("packs").join(pack);
    let mut data = std::fs::read(&packed)?;
    data[(base + 8) as usize + 5] ^= 1;
    std::fs::write(&packed, data)?;
    let global = remote.open_global(5)?.ok_or("complete")?;
    let e = remote
        .read_pieces(&global, &[(0, "params", 60_000, 10)])
        .expect_err("the tail is damaged");
    assert!(matches!(e, Error::Corrupt { step: Some(5), .. }), "{e}");
    let other = remote.read_pieces(&global, &[(1, "params", 0, 66_000)])?;
    assert!(other[0] != before[0], "rank 1's params are its own");
    let e = remote.get_shard(5, 0).expect_err("damaged");
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    assert!(remote.get_shard(5, 1)?.is_some());
    Ok(())
}

/// The fixture `tests/fixtures/bucket-shards-format1` was written by this
/// repository at 1cd1910, before tails were packed: global step 3 of 2
/// ranks, each a tensor "w" of 128 KiB (a chunk and a 128-byte tail
/// chunk) and a 100-byte blob "small".
#[test]
fn shards_written_before_tails_were_packed_read_the_same() -> Result {
    let dir = tempfile::tempdir()?;
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bucket-shards-format1");
    copy_dir(&fixture, dir.path())?;
    let remote = Remote::open(&format!("file://{}", dir.path().display()))?;
    assert_eq!(remote.steps()?, vec![3]);
    let global = remote.open_global(3)?.ok_or("complete")?;
    assert_eq!(global.world_size(), 2);
    let n = 131_072u64;
    for rank in 0..2u32 {
        let w: Vec<u8> = (0..n)
            .map(|i| ((i * 7 + u64::from(rank) * 13) % 251) as u8)
            .collect();
        let boundary = n - 128;
        let got = remote.read_pieces(
            &global,
            &[
                (rank, "w", 0, n),
                (rank, "w", boundary - 3, 6),
                (rank, "small", 0, 100),
            ],
        )?;
        assert!(got[0] == w, "rank {rank}");
        assert_eq!(got[1], w[boundary as usize - 3..boundary as usize + 3]);
        assert_eq!(got[2], vec![rank as u8; 100]);
        let shard = remote.get_shard(3, rank)?.ok_or("a shard")?;
        assert!(shard.entries["w"].bytes() == w);
    }
    let verified = remote.verify()?;
    assert!(verified.is_ok() && verified.steps_ok == 1, "{verified:?}");
    Ok(())
}

/// Through the object store (any bucket but a directory): a blob's small
/// end is a ranged GET of its pack, checked alone; a pack cut short is
/// damage, not a failing bucket.
#[test]
fn a_small_end_is_a_ranged_read_of_its_pack() -> Result {
    use object_store::memory::InMemory;
    use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
    use std::sync::Arc;
    let memory = Arc::new(InMemory::new());
    let remote = Remote::with_store(memory.clone(), "p", "mem://p")?;
    let c = shard(1)?;
    remote.commit_shard(1, 0, 1, &c)?;
    let global = remote.open_global(1)?.ok_or("complete")?;
    let w3 = c.entries["w3"].bytes();
    let got = remote.read_pieces(&global, &[(0, "w3", MIB as u64 - 200, 200)])?;
    assert_eq!(got[0], w3[MIB - 200..]);
    // Cut the pack short (the end of its last chunks).
    let packed = futures::executor::block_on(async {
        let mut list = memory.list(Some(&"p/packs".into()));
        futures::StreamExt::next(&mut list).await.transpose()
    })?
    .ok_or("a pack")?
    .location;
    let bytes = futures::executor::block_on(async { memory.get(&packed).await?.bytes().await })?;
    let cut = bytes.len() - 1000;
    futures::executor::block_on(memory.put(&packed, PutPayload::from(bytes[..cut].to_vec())))?;
    let e = remote
        .read_pieces(&global, &[(0, "w3", MIB as u64 - 10, 10)])
        .expect_err("cut short");
    assert!(matches!(e, Error::Corrupt { step: Some(1), .. }), "{e}");
    Ok(())
}

/// A pack file deleted by hand: no reader counts the step (the object is
/// missing), `verify` names it, and an upload by a remote that does not
/// remember the pack puts the chunks back.
#[test]
fn a_directory_bucket_sees_a_pack_file_gone() -> Result {
    let (dir, remote) = dir_bucket()?;
    let c = shard(1)?;
    let first = remote.upload_shard(1, 0, 1, &c)?;
    remote.commit_global(1, &[first.shard])?;
    for pack in objects(dir.path(), "packs")? {
        std::fs::remove_file(&pack)?;
    }
    assert_eq!(remote.get_shard(1, 0)?, None);
    let verified = remote.verify()?;
    assert!(
        verified.damaged[0].1.to_string().contains("/packs/"),
        "{verified:?}"
    );
    let fresh = Remote::open(remote.url())?;
    let again = fresh.upload_shard(1, 0, 1, &c)?;
    assert!(again.bytes_uploaded >= 7 * MIB as u64, "{again:?}");
    fresh.commit_global(1, &[again.shard])?;
    assert!(fresh.get_shard(1, 0)? == Some(c));
    Ok(())
}

/// The content of the fixture of shard manifest format 2: rank `rank`'s
/// shard of step 3, a tensor "w" of 200,000 bytes (chunks and a tail in
/// the packed chunk) and a 100-byte blob "small".
fn format2_shard(rank: u32) -> Result<Step> {
    let mut c = Step::new(3);
    c.timestamp = 1_800_000_003;
    let n = 200_000u64;
    let w = (0..n)
        .map(|i| ((i * 7 + u64::from(rank) * 13) % 251) as u8)
        .collect();
    c.insert("w", Entry::Tensor(Tensor::new(Dtype::U8, vec![n], w)?));
    c.insert("small", Entry::Blob(vec![rank as u8; 100]));
    Ok(c)
}

/// The fixture `tests/fixtures/bucket-shards-format2` was written by this
/// repository at 584fefd (`upload_shard` of [`format2_shard`] at ranks 0
/// and 1, then `commit_global`), before bucket format 3: it reads,
/// verifies and survives a collection as then.
#[test]
fn shards_of_format_2_read_verify_and_collect_the_same() -> Result {
    let dir = tempfile::tempdir()?;
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bucket-shards-format2");
    copy_dir(&fixture, dir.path())?;
    let remote = Remote::open(&format!("file://{}", dir.path().display()))?
        .with_grace_period(std::time::Duration::ZERO);
    assert_eq!(remote.steps()?, vec![3]);
    for round in 0..2 {
        let global = remote.open_global(3)?.ok_or("complete")?;
        assert_eq!(global.world_size(), 2);
        for rank in 0..2u32 {
            let want = format2_shard(rank)?;
            let w = want.entries["w"].bytes();
            let n = w.len() as u64;
            let got = remote.read_pieces(
                &global,
                &[
                    (rank, "w", 0, n),
                    (rank, "w", n - 10, 10),
                    (rank, "small", 0, 100),
                ],
            )?;
            assert!(got[0] == *w, "rank {rank}");
            assert_eq!(got[1], w[w.len() - 10..]);
            assert_eq!(got[2], vec![rank as u8; 100]);
            assert_eq!(remote.get_shard(3, rank)?, Some(want), "round {round}");
        }
        let verified = remote.verify()?;
        assert!(verified.is_ok() && verified.steps_ok == 1, "{verified:?}");
        // Nothing of a complete step is garbage.
        let report = remote.collect_garbage()?;
        assert_eq!(
            (report.chunks_deleted, report.manifests_deleted),
            (0, 0),
            "{report:?}"
        );
    }
    Ok(())
}

/// Bytes a rank reads to hand on carry proofs against the bucket's chunk
/// hashes: a receiver checks each range with nothing but the manifest it
/// holds — within a chunk, across a chunk into its tail, a whole entry,
/// a small blob in the packed chunk — and a flipped byte fails.
#[test]
fn ranges_read_to_hand_on_check_against_the_buckets_chunk_hashes() -> Result {
    let (_dir, remote) = dir_bucket()?;
    let c = shard(1)?;
    remote.commit_shard(1, 0, 1, &c)?;
    let global = remote.open_global(1)?.ok_or("complete")?;
    let end = 3 * (MIB - 128);
    // What the reader reads (its stripes), and the ranges it hands on.
    let stripes = [
        (0, "w2", 0, MIB as u64),
        (0, "odd", 0, 3 * MIB as u64 + 5),
        (0, "rng", 0, 100),
    ];
    let ranges = [
        (0, "w2", 1000, 5000),
        (0, "odd", end as u64 - 10, 15),
        (0, "w2", 0, MIB as u64),
        (0, "rng", 10, 20),
    ];
    let mut bufs: Vec<Vec<u8>> = stripes.iter().map(|s| vec![0; s.3 as usize]).collect();
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let proofs = remote.read_pieces_proving(&global, &stripes, &mut outs, &ranges)?;
    drop(outs);
    assert!(bufs[0] == c.entries["w2"].bytes() && bufs[1] == c.entries["odd"].bytes());
    let data = |(_, name, at, n): (u32, &str, u64, u64)| -> Vec<u8> {
        let whole = c.entries[name].bytes();
        whole[at as usize..(at + n) as usize].to_vec()
    };
    for (range, proof) in ranges.iter().zip(&proofs) {
        let slices = remote.slices(&global, range)?;
        let bytes = data(*range);
        assert!(check(&slices, proof, &bytes)?, "{range:?}");
        let mut flipped = bytes.clone();
        flipped[bytes.len() / 2] ^= 1;
        assert!(
            !check(&slices, proof, &flipped)?,
            "{range:?}: a flipped byte passed"
        );
    }
    // The small blob's slice lies in the packed chunk (the small blobs').
    let rng = remote.slices(&global, &ranges[3])?;
    let packed = (rng[0].len, rng[0].a, rng[0].b);
    assert!(rng.len() == 1 && packed == (100, 10, 30), "{rng:?}");
    // Across a chunk's end into the next: two slices, two hashes.
    assert_eq!(remote.slices(&global, &ranges[1])?.len(), 2);
    Ok(())
}

/// A range of a format-2 tail (the 0.4.0 fixture's) checks against the
/// tail's own hash.
#[test]
fn a_range_of_a_tail_checks_against_its_hash() -> Result {
    let dir = tempfile::tempdir()?;
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bucket-0.4.0");
    copy_dir(&fixture, dir.path())?;
    let remote = Remote::open(&format!("file://{}", dir.path().display()))?;
    let global = remote.open_global(5)?.ok_or("complete")?;
    let range = (1, "params", 30_000, 5_000);
    let mut buf = vec![0u8; 66_000];
    let proofs = remote.read_pieces_proving(
        &global,
        &[(1, "params", 0, 66_000)],
        &mut [&mut buf],
        &[range],
    )?;
    let slices = remote.slices(&global, &range)?;
    assert!(slices.len() == 1 && slices[0].len == 66_000, "{slices:?}");
    let bytes = &buf[30_000..35_000];
    assert!(check(&slices, &proofs[0], bytes)?);
    let mut flipped = bytes.to_vec();
    flipped[7] ^= 1;
    assert!(!check(&slices, &proofs[0], &flipped)?);
    Ok(())
}

/// Check `bytes` (a range, slice after slice) against `slices` with their
/// proofs back to back.
fn check(slices: &[ckptstore::ChunkSlice], proof: &[u8], bytes: &[u8]) -> Result<bool> {
    let (mut p, mut at) = (0, 0);
    let mut ok = true;
    for s in slices {
        let n = ckptstore::slice_proof_len(s.len, s.a, s.b)?;
        let mut check = ckptstore::SliceCheck::new(s.hash, s.len, s.a, s.b, &proof[p..p + n])?;
        let len = (s.b - s.a) as usize;
        check.update(&bytes[at..at + len]);
        ok &= check.finish();
        (p, at) = (p + n, at + len);
    }
    Ok(ok && p == proof.len() && at == bytes.len())
}
