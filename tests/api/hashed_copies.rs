//! Tensors committed with the chunk hashes taken as they were copied
//! (`ChunkHashes::copy_all`, `TensorRef::with_hashes`): stored exactly as
//! the same bytes hashed by the commit, and never read back wrong when
//! the bytes changed after their copy.

use std::collections::BTreeMap;

use crate::common;
use ckptstore::{CheckpointStore, ChunkHashes, Dtype, Error, TensorRef};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// `(source, destination)` pairs over `states` and fresh buffers.
fn staged(states: &[&[u8]]) -> Result<(Vec<Vec<u8>>, Vec<ChunkHashes>)> {
    let mut copies: Vec<Vec<u8>> = states.iter().map(|s| vec![0; s.len()]).collect();
    let pairs = states
        .iter()
        .zip(copies.iter_mut())
        .map(|(s, d)| (*s, &mut d[..]))
        .collect();
    let hashes = ChunkHashes::copy_all(pairs, 2)?;
    Ok((copies, hashes))
}

#[test]
fn hashed_copies_commit_as_the_same_bytes_hashed_by_the_commit() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    // A tensor of many chunks with an odd tail, one of one chunk, and one
    // small enough to be packed (no chunk hashes).
    let big = common::bytes(1, (9 << 20) + 4100);
    let one = common::bytes(2, 1 << 20);
    let small = common::bytes(3, 4000);
    let (copies, hashes) = staged(&[&big, &one, &small])?;
    assert!(copies[0] == big && copies[1] == one && copies[2] == small);
    for (copy, h) in copies.iter().zip(&hashes) {
        assert_eq!(
            *h,
            ChunkHashes::of(copy),
            "the same hashes as a second pass"
        );
        assert_eq!(ChunkHashes::from_bytes(h.bytes(), &h.to_bytes())?, *h);
    }
    assert!(
        hashes[2].to_bytes().is_empty(),
        "packed bytes have no chunk hashes"
    );

    let names = ["big", "one", "small"];
    let tensors = |with: bool| -> Result<BTreeMap<String, TensorRef<'_>>> {
        let mut out = BTreeMap::new();
        for ((name, copy), h) in names.iter().zip(&copies).zip(&hashes) {
            let t = TensorRef::new(Dtype::U8, vec![copy.len() as u64], copy)?;
            out.insert((*name).to_owned(), if with { t.with_hashes(h)? } else { t });
        }
        Ok(out)
    };
    store.commit_borrowed(&common::checkpoint(1, &[])?, &tensors(true)?)?;
    store.commit_borrowed(&common::checkpoint(2, &[])?, &tensors(false)?)?;
    assert_eq!(store.content_digest(1)?, store.content_digest(2)?);
    let again = store.commit_borrowed(&common::checkpoint(3, &[])?, &tensors(true)?)?;
    let chunked = (big.len() + one.len()) as u64;
    assert!(
        again.bytes_reused >= chunked,
        "every chunk deduplicated: {again:?}"
    );
    assert!(
        again.bytes_written < 8192,
        "only the packed bytes: {again:?}"
    );
    let back = store.get(1)?.ok_or("stored")?;
    assert_eq!(back.tensors["big"].data, big);
    assert_eq!(back.tensors["small"].data, small);
    assert!(store.verify()?.is_ok());
    Ok(())
}

#[test]
fn bytes_changed_after_their_copy_are_never_read_back() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let state = common::bytes(4, 3 << 20);
    let (mut copies, hashes) = staged(&[&state])?;
    store.commit_borrowed(&common::checkpoint(1, &[])?, &BTreeMap::new())?;

    // Chunks not in the store yet: the changed bytes are written under
    // the copy's hashes, and every read refuses them.
    copies[0][100] ^= 0xff;
    let t = TensorRef::new(Dtype::U8, vec![state.len() as u64], &copies[0])?;
    let mut tensors = BTreeMap::new();
    tensors.insert("w".to_owned(), t.with_hashes(&hashes[0])?);
    store.commit_borrowed(&common::checkpoint(2, &[])?, &tensors)?;
    let e = store.get(2).expect_err("a chunk that fails its hash");
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    assert!(!store.verify()?.is_ok());

    // Hashes of chunks the store holds: the step holds the bytes as they
    // were copied (the stored chunks), never the changed ones.
    store.remove(2)?;
    let mut good = BTreeMap::new();
    good.insert(
        "w".to_owned(),
        TensorRef::new(Dtype::U8, vec![state.len() as u64], &state)?,
    );
    store.commit_borrowed(&common::checkpoint(3, &[])?, &good)?;
    store.commit_borrowed(&common::checkpoint(4, &[])?, &tensors)?;
    assert_eq!(store.get(4)?.ok_or("stored")?.tensors["w"].data, state);
    Ok(())
}

#[test]
fn hashes_of_other_bytes_are_refused() -> Result {
    let state = common::bytes(5, 1 << 20);
    let other = ChunkHashes::of(&state[1..]);
    let t = TensorRef::new(Dtype::U8, vec![state.len() as u64], &state)?;
    let e = t.with_hashes(&other).expect_err("other length");
    assert!(e.to_string().contains("chunk hashes of"), "{e}");
    let e = ChunkHashes::from_bytes(1 << 20, &[0; 31]).expect_err("not whole hashes");
    assert!(matches!(e, Error::InvalidTensor { .. }), "{e}");
    let mut short = [0u8; 10];
    let e = ChunkHashes::copy_all(vec![(&state[..], &mut short[..])], 2).expect_err("lengths");
    assert!(e.to_string().contains("a copy of"), "{e}");
    Ok(())
}
