//! Ranges a rank hands on (`slices`, `read_ranges_proving`): where a
//! range lies in the store's chunks, and proofs that let a rank handed the
//! range check it against those chunks' hashes alone, made from the bytes
//! just read or from the chunk read again; a flipped byte of the range or
//! of its proof fails the check.

use crate::common;

use ckptstore::{slice_proof_len, CheckpointStore, Dtype, SliceCheck, Tensor};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

const CHUNK: u64 = (1 << 20) - 128;

/// Whether `bytes` (entry `name` from `start`) check out against the
/// store's chunk hashes with `proof` (its slices' proofs back to back),
/// fed in parts of `part` bytes.
fn checks(
    store: &CheckpointStore,
    step: u64,
    range: (&str, u64, u64),
    bytes: &[u8],
    proof: &[u8],
    part: usize,
) -> Result<bool> {
    let slices = store.slices(step, None, &[range])?.ok_or("no step")?;
    let mut at = (0usize, 0usize);
    for s in &slices[0] {
        let n = slice_proof_len(s.len, s.a, s.b)?;
        let Some(mine) = proof.get(at.0..at.0 + n) else {
            return Ok(false);
        };
        let mut check = SliceCheck::new(s.hash, s.len, s.a, s.b, mine)?;
        let len = (s.b - s.a) as usize;
        for piece in bytes[at.1..at.1 + len].chunks(part.max(1)) {
            check.update(piece);
        }
        if !check.finish() {
            return Ok(false);
        }
        at = (at.0 + n, at.1 + len);
    }
    Ok(at == (proof.len(), bytes.len()))
}

#[test]
fn ranges_read_to_hand_on_check_against_the_stores_chunk_hashes() -> Result {
    for pack_files in [false, true] {
        let dir = tempfile::tempdir()?;
        let store = ckptstore::StoreOptions::new()
            .pack_files(pack_files)
            .pack_threshold(64 << 10)
            .open(dir.path().join("run.ckpt"))?;
        let big = common::bytes(1, 3 * (1 << 20) + 700_000);
        let mut c = common::checkpoint(5, &[2 << 20, 1000, 300])?;
        c.set_tensor(
            "w",
            Tensor::new(Dtype::U8, vec![big.len() as u64], big.clone())?,
        );
        let small = c.optimizer_state["param_1"].clone();
        store.commit(&c)?;
        let entry = |name: &str| {
            if name == "w" {
                big.clone()
            } else {
                small.clone()
            }
        };
        // Within a chunk, across one and two boundaries, whole chunks, the
        // last (short) chunk, the whole entry, a small blob in the packed
        // bytes, nothing.
        let ranges: [(&str, u64, u64); 8] = [
            ("w", 10, 100),
            ("w", CHUNK - 5, 10),
            ("w", CHUNK - 5, 2 * CHUNK + 10),
            ("w", CHUNK, 2 * CHUNK),
            ("w", big.len() as u64 - 3, 3),
            ("w", 0, big.len() as u64),
            ("param_1", 10, 900),
            ("w", 77, 0),
        ];
        for (name, start, len) in ranges {
            let want = &entry(name)[start as usize..(start + len) as usize];
            // Proofs made from the bytes read (the range itself, or the
            // whole entry holding it), and from chunks read again.
            let mut exact = vec![0u8; len as usize];
            let mut whole = vec![0u8; entry(name).len()];
            for reads in [
                vec![(name, start, &mut exact[..])],
                vec![(name, 0, &mut whole[..])],
                vec![],
            ] {
                let mut reads = reads;
                let proofs = store
                    .read_ranges_proving(5, None, &mut reads, &[(name, start, len)])?
                    .ok_or("no step")?;
                for part in [1, 1000, 1 << 20] {
                    assert!(
                        checks(&store, 5, (name, start, len), want, &proofs[0], part)?,
                        "{name} {start}+{len}"
                    );
                }
                if len == 0 {
                    continue;
                }
                let mut bad = want.to_vec();
                bad[len as usize / 2] ^= 1;
                assert!(
                    !checks(&store, 5, (name, start, len), &bad, &proofs[0], 4096)?,
                    "{name} {start}+{len}"
                );
                if !proofs[0].is_empty() {
                    let mut bad = proofs[0].clone();
                    bad[proofs[0].len() / 2] ^= 1;
                    assert!(!checks(&store, 5, (name, start, len), want, &bad, 4096)?);
                }
            }
            assert!(exact == want && whole == entry(name));
        }
        // Chunk-aligned whole chunks need no proof; a small blob's slice is
        // of the packed bytes, shared by the step's small blobs.
        let slices = store.slices(
            5,
            None,
            &[
                ("w", CHUNK, 2 * CHUNK),
                ("param_1", 10, 900),
                ("param_2", 0, 300),
            ],
        )?;
        let slices = slices.ok_or("no step")?;
        assert!(slices[0].iter().all(ckptstore::ChunkSlice::is_whole) && slices[0].len() == 2);
        assert_eq!(slices[1][0].hash, slices[2][0].hash);
        assert!(slices[1][0].len >= 1200);
    }
    Ok(())
}

#[test]
fn a_range_of_another_save_or_not_held_is_refused() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    store.commit(&common::checkpoint(5, &[5000])?)?;
    let digest = store.content_digest(5)?.ok_or("no digest")?;
    store.replace(&common::checkpoint(5, &[6000])?)?;
    assert!(store
        .slices(5, Some(&digest), &[("param_0", 0, 10)])?
        .is_none());
    assert!(store.slices(6, None, &[("param_0", 0, 10)])?.is_none());
    assert!(store
        .read_ranges_proving(5, Some(&digest), &mut [], &[("param_0", 0, 10)])?
        .is_none());
    for (name, start, len) in [("param_0", 5990, 11), ("nope", 0, 1)] {
        let e = store
            .slices(5, None, &[(name, start, len)])
            .expect_err("refused");
        assert!(
            matches!(e, ckptstore::Error::RangeNotStored { step: 5, .. }),
            "{e}"
        );
        let e = store
            .read_ranges_proving(5, None, &mut [], &[(name, start, len)])
            .expect_err("refused");
        assert!(
            matches!(e, ckptstore::Error::RangeNotStored { step: 5, .. }),
            "{e}"
        );
    }
    Ok(())
}

#[test]
fn a_format1_stores_ranges_check_against_its_chunk_hashes() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("old.ckpt");
    std::fs::copy("tests/fixtures/format1.ckpt", &path)?;
    let store = CheckpointStore::open_read_only(&path)?;
    let info = store.info(10)?.ok_or("no step 10")?;
    let mut checked = 0;
    for (name, len) in &info.blobs {
        let (start, n) = (len / 3, len - len / 3 - len / 4);
        let mut bytes = vec![0u8; n as usize];
        let proofs = store
            .read_ranges_proving(
                10,
                None,
                &mut [(name, start, &mut bytes[..])],
                &[(name, start, n)],
            )?
            .ok_or("no step")?;
        assert!(
            checks(&store, 10, (name, start, n), &bytes, &proofs[0], 333)?,
            "{name}"
        );
        checked += 1;
    }
    assert!(checked > 0);
    Ok(())
}

#[test]
fn a_chunk_map_sent_elsewhere_places_ranges_as_the_store_does_and_only_for_its_save() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let mut c = common::checkpoint(5, &[2 << 20, 1000, 300])?;
    c.set_tensor(
        "w",
        Tensor::new(Dtype::U8, vec![3 << 20], common::bytes(2, 3 << 20))?,
    );
    store.commit(&c)?;
    let digest = store.content_digest(5)?.ok_or("no digest")?;
    let sent = store.chunk_map(5, Some(&digest))?.ok_or("no map")?;
    let map = ckptstore::ChunkMap::decode(5, &sent, &digest)?;
    for (name, start, len) in [
        ("w", 10, 100),
        ("w", CHUNK - 5, 2 * CHUNK),
        ("param_0", 0, 2 << 20),
        ("param_1", 3, 900),
        ("w", 9, 0),
    ] {
        let here = store
            .slices(5, None, &[(name, start, len)])?
            .ok_or("no step")?;
        assert_eq!(
            map.slices(name, start, len)?,
            here[0],
            "{name} {start}+{len}"
        );
    }
    assert!(matches!(
        map.slices("w", 3 << 20, 1),
        Err(ckptstore::Error::RangeNotStored { .. })
    ));
    // A damaged map, one of another step, one of another save: refused.
    for i in [0, sent.len() / 2, sent.len() - 1] {
        let mut bad = sent.clone();
        bad[i] ^= 1;
        let e = ckptstore::ChunkMap::decode(5, &bad, &digest).expect_err("a damaged map");
        assert!(
            matches!(e, ckptstore::Error::Corrupt { step: Some(5), .. }),
            "{e}"
        );
    }
    assert!(ckptstore::ChunkMap::decode(6, &sent, &digest).is_err());
    let mut other = c.clone();
    other.set_optimizer_state("param_1", vec![1; 1000]);
    store.replace(&other)?;
    assert!(store.chunk_map(5, Some(&digest))?.is_none());
    let now = store.chunk_map(5, None)?.ok_or("no map")?;
    let e = ckptstore::ChunkMap::decode(5, &now, &digest).expect_err("another save");
    assert!(e.to_string().contains("another save"), "{e}");
    Ok(())
}
