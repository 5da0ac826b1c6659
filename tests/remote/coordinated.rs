//! Global steps a coordinator completes (`upload_shard`, `commit_global`)
//! and reads of parts of a step (`open_global`, `read_pieces`): what
//! `ckptstore.dcp` stands on.

use std::sync::Arc;

use ckptstore::{
    ComputationGraphStore, Entry, Error, GradientCheckpoint, Remote, ShardHash, ShardSource,
    ShardUpload, ShardWrite, Step,
};
use object_store::memory::InMemory;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use super::faults::Failing;
use super::Result;

const MIB: usize = 1 << 20;

fn shard(step: u64, fill: u8, len: usize) -> Step {
    let mut c = Step::new(step);
    c.timestamp = 1_700_000_000 + step; // the same whenever it is built
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ fill).collect();
    c.insert("big", Entry::Blob(data));
    c.insert("small", Entry::Blob(vec![fill; 100]));
    c
}

/// The bytes of blob `name` of `s`.
fn blob(s: &Step, name: &str) -> Vec<u8> {
    s.entries[name].bytes().to_vec()
}

fn upload_all(remote: &Remote, step: u64, world: u32, fill: u8) -> Result<Vec<ShardHash>> {
    (0..world)
        .map(|r| {
            Ok(remote
                .upload_shard(step, r, world, &shard(step, fill + r as u8, 3 * MIB))?
                .shard)
        })
        .collect()
}

#[test]
fn a_step_is_listed_only_once_the_coordinator_commits_it() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = Remote::open(&format!("file://{}", dir.path().display()))?;
    let names = upload_all(&remote, 4, 3, 0)?;
    assert!(
        remote.steps()?.is_empty(),
        "uploaded shards alone make no step"
    );
    remote.commit_global(4, &names)?;
    assert_eq!(remote.steps()?, vec![4]);
    assert!(
        remote.get_shard(4, 2)? == Some(shard(4, 2, 3 * MIB)),
        "remote.get_shard(4, 2)?"
    );
    assert!(remote.verify()?.is_ok());
    Ok(())
}

#[test]
fn shards_of_a_dead_attempt_never_mix_in_or_block() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = Remote::open(&format!("file://{}", dir.path().display()))?;
    // An attempt at 4 ranks: three shards land, then it dies.
    for r in 0..3 {
        remote.upload_shard(9, r, 4, &shard(9, 50 + r as u8, MIB))?;
    }
    // The rerun at 2 ranks is neither refused nor mixed with them.
    let names = upload_all(&remote, 9, 2, 0)?;
    remote.commit_global(9, &names)?;
    assert!(
        remote.get_shard(9, 0)? == Some(shard(9, 0, 3 * MIB)),
        "remote.get_shard(9, 0)?"
    );
    assert!(
        remote.get_shard(9, 1)? == Some(shard(9, 1, 3 * MIB)),
        "remote.get_shard(9, 1)?"
    );
    assert_eq!(remote.world_size(9)?, Some(2));
    // Redone with other content: a newer commit, exactly the new shards.
    let again = upload_all(&remote, 9, 2, 100)?;
    remote.commit_global(9, &again)?;
    assert!(
        remote.get_shard(9, 1)? == Some(shard(9, 101, 3 * MIB)),
        "remote.get_shard(9, 1)?"
    );
    Ok(())
}

#[test]
fn commit_global_refuses_shards_that_are_not_there_and_whole() -> Result {
    let memory = Arc::new(InMemory::new());
    let remote = Remote::with_store(memory.clone(), "c", "mem://c")?;
    let mut names = upload_all(&remote, 2, 2, 0)?;
    let absent = ShardHash::from_hex(&"ab".repeat(32)).expect("a name");
    let e = remote
        .commit_global(2, &[names[0], absent])
        .expect_err("a shard that is not there");
    assert!(matches!(e, Error::Corrupt { step: Some(2), .. }), "{e}");
    // A pack deleted by hand: the coordinator asks one object per rank
    // (the ranks proved their packs), so the step is committed, but no
    // reader counts it and verify names the pack.
    let packs = futures::executor::block_on(async {
        use futures::TryStreamExt;
        let all: Vec<_> = memory.list(Some(&"c/packs".into())).try_collect().await?;
        Ok::<_, object_store::Error>(all.into_iter().map(|m| m.location).collect::<Vec<_>>())
    })?;
    assert_eq!(packs.len(), 2, "a pack per rank: {packs:?}");
    futures::executor::block_on(memory.delete(&packs[1]))?;
    remote.commit_global(2, &names)?;
    // The rank whose pack is gone has no whole shard; the other has.
    let whole: Vec<bool> = (0..2)
        .map(|r| Ok(remote.get_shard(2, r)?.is_some()))
        .collect::<Result<_>>()?;
    assert_eq!(whole.iter().filter(|w| **w).count(), 1, "{whole:?}");
    let verified = remote.verify()?;
    assert_eq!(verified.damaged.len(), 1, "{verified:?}");
    assert!(
        verified.damaged[0].1.to_string().contains("/packs/"),
        "{verified:?}"
    );
    names.clear();
    let e = remote.commit_global(2, &names).expect_err("no shards");
    assert!(matches!(e, Error::InvalidCheckpoint { .. }), "{e}");
    Ok(())
}

#[test]
fn a_piece_fetches_only_the_chunks_it_overlaps() -> Result {
    let counting = Arc::new(Failing::new(Arc::new(InMemory::new()), 0));
    let remote = Remote::with_store(counting.clone(), "p", "mem://p")?;
    let names = upload_all(&remote, 1, 2, 0)?;
    remote.commit_global(1, &names)?;
    let global = remote.open_global(1)?.expect("complete");
    assert_eq!(global.world_size(), 2);
    assert_eq!(remote.entries(&global, 1)?["big"].len, 3 * MIB as u64);
    let chunk_gets = || {
        let gets = counting.gets.lock().expect("lock");
        gets.iter().filter(|k| k.contains("/packs/")).count()
    };
    let whole = blob(&shard(1, 1, 3 * MIB), "big");
    let small = blob(&shard(1, 0, 3 * MIB), "small");
    let before = chunk_gets();
    // Inside the second chunk: one chunk fetched (a ranged GET of its pack).
    let at = MIB as u64 + 10;
    let got = remote.read_pieces(&global, &[(1, "big", at, 1000)])?;
    assert_eq!(got[0], whole[at as usize..at as usize + 1000]);
    assert_eq!(chunk_gets() - before, 1);
    // Across a chunk boundary, and a packed blob: the two chunks, neighbours
    // in their pack, in one request; the packed chunk in another.
    let before = chunk_gets();
    let boundary = MIB - 128; // chunks are 1 MiB - 128 B
    let got = remote.read_pieces(
        &global,
        &[(1, "big", boundary as u64 - 5, 10), (0, "small", 3, 4)],
    )?;
    assert_eq!(got[0], whole[boundary - 5..boundary + 5]);
    assert_eq!(got[1], small[3..7]);
    assert_eq!(chunk_gets() - before, 2);
    // Outside the entry: refused before anything is fetched.
    let e = remote
        .read_pieces(&global, &[(1, "big", 3 * MIB as u64 - 1, 2)])
        .expect_err("outside");
    assert!(matches!(e, Error::InvalidCheckpoint { .. }), "{e}");
    // Into the caller's buffers: the same bytes; a buffer of another
    // length is refused.
    let (mut a, mut b) = (vec![0u8; 10], vec![0u8; 4]);
    let pieces = [(1, "big", boundary as u64 - 5, 10), (0, "small", 3, 4)];
    remote.read_pieces_into(&global, &pieces, &mut [&mut a, &mut b])?;
    assert_eq!(
        (&a[..], &b[..]),
        (&whole[boundary - 5..boundary + 5], &small[3..7])
    );
    // The whole entry, and two pieces of one chunk: every chunk placed in
    // each piece that needs it, each fetched once.
    let before = chunk_gets();
    let (mut all, mut first, mut second) = (vec![0u8; 3 * MIB], vec![0u8; 100], vec![0u8; 50]);
    let pieces3 = [
        (1, "big", 0, 3 * MIB as u64),
        (1, "big", 7, 100),
        (1, "big", 200, 50),
    ];
    remote.read_pieces_into(&global, &pieces3, &mut [&mut all, &mut first, &mut second])?;
    assert!(all == whole, "the whole entry differs");
    assert_eq!(
        (&first[..], &second[..]),
        (&whole[7..107], &whole[200..250])
    );
    assert_eq!(
        chunk_gets() - before,
        1,
        "3 MiB is four chunks in a row in one pack"
    );
    let mut short = vec![0u8; 9];
    let e = remote
        .read_pieces_into(&global, &pieces[..1], &mut [&mut short])
        .expect_err("short buffer");
    assert!(matches!(e, Error::InvalidCheckpoint { .. }), "{e}");
    Ok(())
}

#[test]
fn a_damaged_chunk_fails_a_piece_naming_the_step() -> Result {
    let memory = Arc::new(InMemory::new());
    let remote = Remote::with_store(memory.clone(), "d", "mem://d")?;
    let names = upload_all(&remote, 7, 1, 0)?;
    remote.commit_global(7, &names)?;
    let global = remote.open_global(7)?.expect("complete");
    let data = blob(&shard(7, 0, 3 * MIB), "big");
    // Overwrite every pack with same-length garbage.
    let keys = futures::executor::block_on(async {
        use futures::TryStreamExt;
        memory
            .list(Some(&"d/packs".into()))
            .try_collect::<Vec<_>>()
            .await
    })?;
    assert!(!keys.is_empty());
    for meta in &keys {
        let bytes = vec![0u8; meta.size as usize];
        futures::executor::block_on(memory.put(&meta.location, PutPayload::from(bytes)))?;
    }
    let e = remote
        .read_pieces(&global, &[(0, "big", 0, 100)])
        .expect_err("damaged");
    assert!(matches!(e, Error::Corrupt { step: Some(7), .. }), "{e}");
    assert!(e.to_string().contains("fails its hash check"), "{e}");
    assert_ne!(data[..100], [0u8; 100]);
    // Into a buffer: the same error, and none of the garbage lands.
    let mut out = vec![7u8; 100];
    let e = remote
        .read_pieces_into(&global, &[(0, "big", 0, 100)], &mut [&mut out])
        .expect_err("damaged");
    assert!(e.to_string().contains("fails its hash check"), "{e}");
    assert_eq!(out, vec![7u8; 100]);
    Ok(())
}

/// A checkpoint with every kind of entry: large and small blobs, a large
/// and a small tensor, metrics, a loss CID.
fn every_kind(step: u64) -> Result<GradientCheckpoint> {
    use ckptstore::{Dtype, Tensor};
    // (No graph nodes: a node's id is a fresh UUID.)
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step)
        .with_loss_cid("cid_loss")
        .with_metric("loss", 0.25);
    c.timestamp = 1_700_000_000;
    c.set_optimizer_state("big", (0..3 * MIB).map(|i| (i % 253) as u8).collect());
    c.set_optimizer_state("rng", vec![7; 100]);
    c.set_tensor(
        "w",
        Tensor::new(Dtype::BF16, vec![1024, 1024], vec![3; 2 * MIB])?,
    );
    c.set_tensor("b", Tensor::new(Dtype::F32, vec![4], vec![1; 16])?);
    Ok(c)
}

/// The bucket's manifests are the same bytes whenever they are built: a
/// shard's and a pushed step's are pinned at format 3 (chunks in packs,
/// named by their chunk lists; the pushed step's chunks deduplicated
/// against the shard's packs, which the same remote wrote), so that a
/// change of their bytes is a decision, not an accident. (The shard's
/// changed once: 2026-12-05, its blobs' small ends are chunks like any
/// other, not packed with its small blobs; the pushed step then finds
/// every chunk of the store, its small ends too, in the shard's packs.
/// The shard's input changed on 2026-12-07: a shard is a `Step`, which
/// has no loss CID; its bytes are those 0.5.0 wrote for the same shard
/// without one.)
#[test]
fn manifests_keep_their_bytes() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = Remote::open(&format!("file://{}/b", dir.path().display()))?;
    let shard = remote
        .upload_shard(5, 0, 1, &every_kind(5)?.into_step())?
        .shard;
    let store = ckptstore::CheckpointStore::open(dir.path().join("s.ckpt"))?;
    store.commit(&every_kind(6)?)?;
    remote.push(&store)?;
    let manifests: Vec<String> = std::fs::read_dir(dir.path().join("b/manifests"))?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    assert_eq!(
        shard.to_string(),
        "523d749ace49c1285e87035d09813903d771b358135cc6208967411b45895d59"
    );
    assert_eq!(
        manifests,
        ["00000000000000000006-5d61e02e4d6fdadabd08196ba76ff7799f0c0f48a149f9b4d91b61af68465ef7.json"]
    );
    Ok(())
}

#[test]
fn data_uploaded_early_is_not_uploaded_again() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = Remote::open(&format!("file://{}", dir.path().display()))?;
    let data = shard(3, 9, 3 * MIB);
    let early = remote.write_shard(ShardWrite::new(
        (3, 0, 1),
        ShardSource::Owned(&data),
        ShardUpload::ChunksOnly,
    ))?;
    assert!(early.bytes_uploaded >= 3 * MIB as u64);
    assert!(!dir.path().join("shards").exists(), "no shard manifest yet");
    // The shard, later, with one more small entry: only that is new.
    let mut more = data.clone();
    more.insert(".dcp/metadata.json", Entry::Blob(b"{}".to_vec()));
    let info = remote.upload_shard(3, 0, 1, &more)?;
    assert!(info.bytes_uploaded < 64 << 10, "{}", info.bytes_uploaded);
    remote.commit_global(3, &[info.shard])?;
    assert!(remote.get_shard(3, 0)? == Some(more));
    Ok(())
}

/// A shard whose tensors are borrowed is the same shard, byte for byte, as
/// one holding copies: same manifest name, same bytes read back; each of
/// the three ways (`ShardUpload`) goes as far as its owned twin; a name
/// both borrowed and in the checkpoint is refused before any upload.
#[test]
fn borrowed_tensors_upload_the_same_shard() -> Result {
    use ckptstore::TensorRef;
    use std::collections::BTreeMap;
    let dir = tempfile::tempdir()?;
    let remote = Remote::open(&format!("file://{}/b", dir.path().display()))?;
    let whole = every_kind(5)?.into_step();
    let mut skeleton = whole.clone();
    let tensors: Vec<(String, ckptstore::Tensor)> = whole
        .entries
        .iter()
        .filter_map(|(n, e)| match e {
            Entry::Tensor(t) => Some((n.clone(), t.clone())),
            Entry::Blob(_) => None,
        })
        .collect();
    for (n, _) in &tensors {
        skeleton.remove(n);
    }
    let borrowed: BTreeMap<String, TensorRef<'_>> = tensors
        .iter()
        .map(|(n, t)| {
            Ok((
                n.clone(),
                TensorRef::new(t.dtype, t.shape.clone(), &t.data)?,
            ))
        })
        .collect::<ckptstore::Result<_>>()?;
    let info = remote.write_shard(ShardWrite::new(
        (5, 0, 1),
        ShardSource::Borrowed(&skeleton, &borrowed),
        ShardUpload::Manifest,
    ))?;
    // The name manifests_keep_their_bytes pins for the owned shard.
    assert_eq!(
        info.shard.to_string(),
        "523d749ace49c1285e87035d09813903d771b358135cc6208967411b45895d59"
    );
    assert!(
        remote.steps()?.is_empty(),
        "Manifest does not complete the step"
    );
    remote.commit_global(5, &[info.shard])?;
    assert!(remote.get_shard(5, 0)? == Some(whole.clone()));

    // ChunksOnly uploads data and no manifest; Complete commits the step.
    let mut seven = skeleton.clone();
    seven.step = 7;
    let early = remote.write_shard(ShardWrite::new(
        (7, 0, 1),
        ShardSource::Borrowed(&seven, &borrowed),
        ShardUpload::ChunksOnly,
    ))?;
    assert!(!early.complete && early.bytes_uploaded == 0, "{early:?}"); // the chunks of step 5
    assert!(remote.shards(7)?.landed.is_empty(), "no shard manifest yet");
    let done = remote.write_shard(ShardWrite::new(
        (7, 0, 1),
        ShardSource::Borrowed(&seven, &borrowed),
        ShardUpload::Complete,
    ))?;
    assert!(done.complete && done.bytes_uploaded < 64 << 10, "{done:?}");
    assert_eq!(remote.steps()?, vec![5, 7]);

    let mut clash = skeleton.clone();
    clash.step = 8;
    clash.insert("w", Entry::Blob(vec![1]));
    let e = remote
        .write_shard(ShardWrite::new(
            (8, 0, 1),
            ShardSource::Borrowed(&clash, &borrowed),
            ShardUpload::Complete,
        ))
        .expect_err("a name both borrowed and in the checkpoint");
    assert!(matches!(e, Error::InvalidCheckpoint { step: 8, .. }), "{e}");
    assert_eq!(remote.shards(8)?.landed, Vec::<u32>::new());
    Ok(())
}

#[test]
fn a_directory_bucket_reads_chunks_straight_into_place_and_checks_them() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = Remote::open(&format!("file://{}", dir.path().display()))?;
    let names = upload_all(&remote, 2, 2, 0)?;
    remote.commit_global(2, &names)?;
    let global = remote.open_global(2)?.expect("complete");
    let whole = blob(&shard(2, 1, 3 * MIB), "big");
    let small = blob(&shard(2, 0, 3 * MIB), "small");
    // Whole chunks, parts of chunks, a chunk shared by two pieces, and a
    // packed blob.
    let boundary = MIB - 128;
    let pieces = [
        (1, "big", 0, 3 * MIB as u64),
        (1, "big", boundary as u64 - 5, 10),
        (1, "big", 3, 4),
        (0, "small", 3, 4),
    ];
    let mut outs = [
        vec![0u8; 3 * MIB],
        vec![0u8; 10],
        vec![0u8; 4],
        vec![0u8; 4],
    ];
    let mut refs: Vec<&mut [u8]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
    remote.read_pieces_into(&global, &pieces, &mut refs)?;
    assert!(outs[0] == whole, "the whole entry differs");
    assert_eq!(outs[1], whole[boundary - 5..boundary + 5]);
    assert_eq!(outs[2], whole[3..7]);
    assert_eq!(outs[3], small[3..7]);

    // A flipped byte in the second chunk: the read fails naming the step
    // and the bucket, and none of that chunk's bytes stay in the buffer.
    let pack_files: Vec<std::path::PathBuf> = std::fs::read_dir(dir.path().join("packs"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    let second = &whole[boundary..2 * boundary];
    // "big" is rank 1's first entry: its chunks open its pack, in order.
    let victim = pack_files
        .iter()
        .find(|p| std::fs::read(p).is_ok_and(|b| b.get(boundary..2 * boundary) == Some(second)))
        .expect("the pack of the second chunk");
    let mut bytes = std::fs::read(victim)?;
    bytes[boundary + 77] ^= 1;
    std::fs::write(victim, &bytes)?;
    let mut out = vec![9u8; 3 * MIB];
    let e = remote
        .read_pieces_into(&global, &[(1, "big", 0, 3 * MIB as u64)], &mut [&mut out])
        .expect_err("damaged");
    assert!(matches!(e, Error::Corrupt { step: Some(2), .. }), "{e}");
    assert!(e.to_string().contains("fails its hash check"), "{e}");
    assert!(out[boundary..2 * boundary].iter().all(|&b| b == 0));
    // A missing pack file: reported by the object store's read.
    std::fs::remove_file(victim)?;
    let e = remote
        .read_pieces_into(&global, &[(1, "big", 0, 3 * MIB as u64)], &mut [&mut out])
        .expect_err("missing");
    assert!(e.to_string().contains("is missing"), "{e}");
    Ok(())
}

#[test]
fn directory_buckets_with_odd_paths_read_through_the_object_store() -> Result {
    for name in ["plain", "with space%and#hash"] {
        let dir = tempfile::tempdir()?;
        let root = dir.path().join(name);
        let remote = Remote::open(&format!("file://{}", root.display()))?;
        let names = upload_all(&remote, 4, 2, 3)?;
        // The shards' chunks are in pack files (no chunk objects), and no
        // staging file is left.
        assert!(!root.join("chunks").exists(), "{name}");
        let packs = std::fs::read_dir(root.join("packs"))?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<Vec<_>>>()?;
        assert!(!packs.is_empty(), "{name}");
        for path in &packs {
            let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            assert!(
                !file_name.contains('#'),
                "{name}: staging file left: {file_name}"
            );
            assert_eq!(file_name.len(), 64, "{name}: {file_name}");
        }
        remote.commit_global(4, &names)?;
        // Read back through a new handle: the same shards, read directly
        // from the plain path and through the object store from the other.
        let again = Remote::open(&format!("file://{}", root.display()))?;
        assert_eq!(again.get_shard(4, 1)?, Some(shard(4, 4, 3 * MIB)));
        let global = again.open_global(4)?.expect("complete");
        let mut out = vec![0u8; 3 * MIB];
        again.read_pieces_into(&global, &[(0, "big", 0, 3 * MIB as u64)], &mut [&mut out])?;
        assert!(out == blob(&shard(4, 3, 3 * MIB), "big"), "{name}");
    }
    Ok(())
}
