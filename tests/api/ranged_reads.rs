//! Ranged reads (`read_ranges`): any bytes of any entry, in pieces of any
//! size, equal to the whole read; only the chunks holding them checked,
//! each before its bytes are handed out; another save of the step (by its
//! content digest) and bytes the step does not hold refused.

use crate::common;

use ckptstore::{CheckpointStore, Dtype, Error, Tensor};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// A full chunk's length (docs/design.md: a page run of 1 MiB less redb's
/// leaf overhead); a blob's tail is cut in smaller pieces.
const CHUNK: usize = (1 << 20) - 128;

/// A step with a tensor of 3.5 chunks, a blob of 2 chunks and a small
/// (packed) blob.
/// The store, then the bytes of `w`, `param_0` and `param_1`.
type Stored = (CheckpointStore, Vec<u8>, Vec<u8>, Vec<u8>);

fn stored(dir: &std::path::Path) -> Result<Stored> {
    let store = CheckpointStore::open(dir.join("run.ckpt"))?;
    let big = common::bytes(1, 3 * (1 << 20) + 700_000);
    let mut c = common::checkpoint(5, &[2 << 20, 1000])?;
    c.set_tensor(
        "w",
        Tensor::new(Dtype::U8, vec![big.len() as u64], big.clone())?,
    );
    let blob = c.optimizer_state["param_0"].clone();
    let small = c.optimizer_state["param_1"].clone();
    store.commit(&c)?;
    Ok((store, big, blob, small))
}

fn read(store: &CheckpointStore, name: &str, start: usize, len: usize) -> Result<Vec<u8>> {
    let mut out = vec![0u8; len];
    assert!(store.read_ranges(5, None, &mut [(name, start as u64, &mut out[..])])?);
    Ok(out)
}

#[test]
fn any_range_is_the_bytes_of_the_whole_read() -> Result {
    let dir = tempfile::tempdir()?;
    let (store, big, blob, small) = stored(dir.path())?;
    let chunk = CHUNK;
    // Inside one chunk, across one and several boundaries, whole chunks,
    // the tail, the whole entry, empty.
    for (start, len) in [
        (10, 100),
        (chunk - 5, 10),
        (chunk - 5, 2 * chunk + 10),
        (chunk, 2 * chunk),
        (big.len() - 3, 3),
        (0, big.len()),
        (77, 0),
    ] {
        let got = read(&store, "w", start, len)?;
        assert!(got == big[start..start + len], "w {start}+{len}");
    }
    assert!(read(&store, "param_0", chunk - 1, 2)? == blob[chunk - 1..=chunk]);
    assert_eq!(read(&store, "param_1", 10, 20)?, small[10..30]);
    // Several ranges of several entries in one call.
    let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 16]);
    assert!(store.read_ranges(
        5,
        None,
        &mut [
            ("w", 2 * chunk as u64 - 100, &mut a[..]),
            ("param_1", 0, &mut b[..])
        ]
    )?);
    assert!(a == big[2 * chunk - 100..2 * chunk + 3996] && b == small[..16]);
    Ok(())
}

#[test]
fn another_save_of_the_step_and_bytes_not_held_are_refused() -> Result {
    let dir = tempfile::tempdir()?;
    let (store, big, _, _) = stored(dir.path())?;
    let digest = store.content_digest(5)?.ok_or("no digest")?;
    let mut out = vec![9u8; 8];
    assert!(store.read_ranges(5, Some(&digest), &mut [("w", 0, &mut out[..])])?);
    assert_eq!(out, big[..8]);

    let mut other = common::checkpoint(5, &[10])?;
    other.set_tensor("w", Tensor::new(Dtype::U8, vec![8], vec![1; 8])?);
    store.replace(&other)?;
    let mut out = vec![9u8; 8];
    assert!(!store.read_ranges(5, Some(&digest), &mut [("w", 0, &mut out[..])])?);
    assert_eq!(out, [9; 8], "nothing filled from another save");
    assert!(!store.read_ranges(6, None, &mut [("w", 0, &mut out[..])])?);

    for (name, start) in [("w", 1), ("nope", 0)] {
        let e = store
            .read_ranges(5, None, &mut [(name, start, &mut out[..])])
            .expect_err("refused");
        assert!(matches!(e, Error::RangeNotStored { step: 5, .. }), "{e}");
        assert!(e.to_string().contains(name), "{e}");
    }
    Ok(())
}

#[test]
fn a_damaged_chunk_fails_only_the_reads_that_need_it() -> Result {
    let dir = tempfile::tempdir()?;
    let (store, big, _, _) = stored(dir.path())?;
    let path = store.path().to_owned();
    drop(store);
    // A byte of the third chunk of "w".
    let chunk = CHUNK;
    common::flip_stored_byte(&path, &big[2 * chunk + 5000..2 * chunk + 5064], 10)?;
    let store = CheckpointStore::open(&path)?;
    assert!(
        read(&store, "w", 0, 2 * chunk)? == big[..2 * chunk],
        "the chunks before it read"
    );
    assert!(read(&store, "w", 3 * chunk, 1000)? == big[3 * chunk..3 * chunk + 1000]);
    for (start, len) in [
        (2 * chunk + 5010, 1),
        (chunk, 2 * chunk),
        (2 * chunk + 7, 10),
    ] {
        let mut out = vec![0u8; len];
        let e = store
            .read_ranges(5, None, &mut [("w", start as u64, &mut out[..])])
            .expect_err("refused");
        assert!(matches!(e, Error::Corrupt { step: Some(5), .. }), "{e}");
        // An edge chunk is checked in a buffer of its own: none of its
        // bytes reach the caller.
        if len <= 10 {
            assert!(
                out.iter().all(|&b| b == 0),
                "bytes of a damaged chunk handed out"
            );
        }
    }
    Ok(())
}
