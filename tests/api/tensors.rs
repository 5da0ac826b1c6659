//! Typed tensors: stored and read back with dtype and shape, deduplicated
//! as blobs are, typed in `info`, refused when inconsistent; a store gets
//! format 3 only with its first tensor.

use crate::common;

use ckptstore::{CheckpointStore, ComputationGraphStore, Dtype, Error, GradientCheckpoint, Tensor};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

const META: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");

fn format_of(path: &std::path::Path) -> Result<u32> {
    use redb::ReadableDatabase;
    let db = redb::Database::open(path)?;
    let txn = db.begin_read()?;
    let v = txn
        .open_table(META)?
        .get("format_version")?
        .ok_or("no version")?
        .value()
        .to_vec();
    Ok(u32::from_le_bytes(v.as_slice().try_into()?))
}

fn tensors(step: u64) -> Result<GradientCheckpoint> {
    let mut c = common::checkpoint(step, &[100, 200_000])?;
    c.set_tensor(
        "embed",
        Tensor::new(Dtype::F32, vec![256, 1024], common::bytes(7, 1 << 20))?,
    );
    c.set_tensor(
        "layer.w",
        Tensor::new(Dtype::BF16, vec![3, 5], common::bytes(step, 30))?,
    );
    c.set_tensor(
        "scale",
        Tensor::new(Dtype::F64, vec![], 0.5f64.to_le_bytes().to_vec())?,
    );
    c.set_tensor("empty", Tensor::new(Dtype::I64, vec![4, 0, 2], Vec::new())?);
    c.set_tensor(
        "fp4",
        Tensor::new(Dtype::F4, vec![6], vec![0x12, 0x34, 0x56])?,
    );
    c.set_tensor(
        "fp8",
        Tensor::new(Dtype::F8_E4M3, vec![2, 2], vec![1, 2, 3, 4])?,
    );
    Ok(c)
}

#[test]
fn tensors_round_trip_with_dtype_and_shape() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = CheckpointStore::open(&path)?;
    store.commit(&common::checkpoint(0, &[10])?)?;
    drop(store);
    assert_eq!(
        format_of(&path)?,
        2,
        "a store without tensors stays format 2"
    );

    let store = CheckpointStore::open(&path)?;
    let c1 = tensors(1)?;
    store.commit(&c1)?;
    let c2 = tensors(2)?;
    let info = store.commit(&c2)?;
    // The unchanged 1 MiB embedding is stored once.
    assert!(info.bytes_reused >= 1 << 20, "{info:?}");
    assert_eq!(store.get(1)?, Some(c1.clone()));
    assert_eq!(store.latest()?, Some(c2.clone()));
    assert_eq!(
        store.get_tensor(2, "layer.w")?.as_ref(),
        c2.tensors.get("layer.w")
    );
    assert_eq!(
        store.get_tensor(2, "param_0")?,
        None,
        "a blob is not a tensor"
    );
    assert_eq!(store.get_blob(2, "embed")?, None, "a tensor is not a blob");
    let step = store.info(2)?.ok_or("info")?;
    assert_eq!(step.tensors["embed"].dtype, Dtype::F32);
    assert_eq!(step.tensors["embed"].shape, vec![256, 1024]);
    assert_eq!(step.tensors["empty"].shape, vec![4, 0, 2]);
    assert_eq!(step.blobs.len(), 2);
    assert_eq!(step.logical_bytes(), c2.logical_bytes());
    assert!(store.verify()?.is_ok());
    drop(store);
    assert_eq!(
        format_of(&path)?,
        3,
        "the first tensor marks the store format 3"
    );
    let reader = CheckpointStore::open_read_only(&path)?;
    assert_eq!(reader.get(0)?.map(|c| c.step), Some(0));
    assert_eq!(reader.get(2)?, Some(c2));
    Ok(())
}

#[test]
fn inconsistent_tensors_are_refused_before_anything_is_written() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
    c.set_optimizer_state("w", vec![1; 8]);
    c.set_tensor("w", Tensor::new(Dtype::U8, vec![8], vec![1; 8])?);
    let e = store.commit(&c).expect_err("a name both ways");
    assert!(matches!(e, Error::InvalidCheckpoint { step: 1, .. }), "{e}");
    assert!(e.to_string().contains("\"w\""), "{e}");

    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 2);
    c.tensors.insert(
        "bad".into(),
        Tensor {
            dtype: Dtype::F16,
            shape: vec![3],
            data: vec![0; 5],
        },
    );
    let e = store.commit(&c).expect_err("wrong length");
    assert!(
        matches!(e, Error::InvalidTensor { name: Some(ref n), .. } if n == "bad"),
        "{e}"
    );
    assert!(e.to_string().contains("needs 6 bytes"), "{e}");
    assert!(store.steps()?.is_empty());
    Ok(())
}

#[test]
fn json_keeps_tensors_and_leaves_the_seed_format_alone() -> Result {
    let dir = tempfile::tempdir()?;
    let c = tensors(3)?;
    let path = dir.path().join("step3.json");
    c.save(&path)?;
    assert_eq!(GradientCheckpoint::load(&path)?, c);
    let plain = common::checkpoint(4, &[10])?;
    let text = String::from_utf8(serde_json::to_vec(&plain)?)?;
    assert!(!text.contains("tensors"), "{text}");
    let bad = br#"{"graph":{"nodes":{},"edges":[]},"step":1,"loss_cid":null,"optimizer_state":{},"timestamp":0,
        "tensors":{"t":{"dtype":"F32","shape":[2],"data":[1,2,3]}}}"#;
    assert!(GradientCheckpoint::from_json(bad).is_err());
    Ok(())
}

/// `commit_borrowed` stores tensors from the caller's buffers as `commit`
/// stores owned ones: same bytes back, same dedup, typed in `info`, and a
/// large one is staged like any large commit.
#[test]
fn borrowed_tensors_commit_like_owned_ones() -> Result {
    use ckptstore::{StoreOptions, TensorRef};
    use std::collections::BTreeMap;

    let dir = tempfile::tempdir()?;
    // A small cache so that the 8 MiB tensor takes the staged path.
    let store = StoreOptions::new()
        .cache_size(4 << 20)
        .open(dir.path().join("run.ckpt"))?;
    let big = common::bytes(3, 8 << 20);
    let small = common::bytes(4, 40);
    for step in 0..2u64 {
        let changing = common::bytes(10 + step, 1 << 20);
        let mut borrowed = BTreeMap::new();
        borrowed.insert(
            "big".to_owned(),
            TensorRef::new(Dtype::F32, vec![1024, 2048], &big)?,
        );
        borrowed.insert(
            "small".to_owned(),
            TensorRef::new(Dtype::I16, vec![4, 5], &small)?,
        );
        borrowed.insert(
            "changing".to_owned(),
            TensorRef::new(Dtype::U8, vec![1 << 20], &changing)?,
        );
        let mut ckpt = common::checkpoint(step, &[100])?;
        ckpt.set_tensor("owned", Tensor::new(Dtype::F64, vec![1], vec![1; 8])?);
        let info = store.commit_borrowed(&ckpt, &borrowed)?;
        assert_eq!(info.logical_bytes, ckpt.logical_bytes() + (9 << 20) + 40);
        if step == 1 {
            assert!(
                info.bytes_reused >= 8 << 20,
                "the unchanged tensor is reused: {info:?}"
            );
            assert!(info.bytes_written < (1 << 20) + 4096, "{info:?}");
        }
        let back = store.get(step)?.ok_or("stored")?;
        assert_eq!(back.tensors["big"].data, big);
        assert_eq!(back.tensors["big"].shape, vec![1024, 2048]);
        assert_eq!(back.tensors["small"].dtype, Dtype::I16);
        assert_eq!(back.tensors["small"].data, small);
        assert_eq!(back.tensors["changing"].data, changing);
        assert_eq!(back.tensors["owned"], ckpt.tensors["owned"]);
        assert_eq!(back.optimizer_state, ckpt.optimizer_state);
        let info = store.info(step)?.ok_or("stored")?;
        assert_eq!(info.tensors.len(), 4);
    }
    assert!(store.verify()?.is_ok());

    // A name both borrowed and in the checkpoint is refused; nothing lands.
    let mut borrowed = BTreeMap::new();
    borrowed.insert(
        "owned".to_owned(),
        TensorRef::new(Dtype::U8, vec![2], &small[..2])?,
    );
    let mut ckpt = common::checkpoint(5, &[])?;
    ckpt.set_tensor("owned", Tensor::new(Dtype::U8, vec![1], vec![1])?);
    let e = store.commit_borrowed(&ckpt, &borrowed).expect_err("clash");
    assert!(matches!(e, Error::InvalidCheckpoint { step: 5, .. }), "{e}");
    // A step stored already is refused as by commit.
    let ckpt = common::checkpoint(1, &[])?;
    let e = store
        .commit_borrowed(&ckpt, &BTreeMap::new())
        .expect_err("exists");
    assert!(matches!(e, Error::StepExists { step: 1 }), "{e}");
    assert_eq!(store.steps()?, vec![0, 1]);

    // replace_borrowed swaps the step whole, in one transaction; the
    // chunks only the old version held are freed.
    let mut borrowed = BTreeMap::new();
    borrowed.insert(
        "only".to_owned(),
        TensorRef::new(Dtype::I16, vec![4, 5], &small)?,
    );
    let ckpt = common::checkpoint(1, &[7])?;
    store.replace_borrowed(&ckpt, &borrowed)?;
    let back = store.get(1)?.ok_or("stored")?;
    assert_eq!(back.tensors.keys().collect::<Vec<_>>(), vec!["only"]);
    assert_eq!(back.tensors["only"].data, small);
    assert_eq!(back.optimizer_state, ckpt.optimizer_state);
    store.replace_borrowed(&common::checkpoint(9, &[])?, &borrowed)?; // a new step too
    assert_eq!(store.steps()?, vec![0, 1, 9]);
    store.remove(0)?;
    assert!(store.get_tensor(1, "big")?.is_none());
    assert!(
        store.stats()?.stored_bytes < 1 << 20,
        "the 8 MiB tensor was freed"
    );
    assert!(store.verify()?.is_ok());
    Ok(())
}

/// A failure writing another file (an export target that cannot be
/// created) is that file's: the store's handle stays open, so its writer
/// lock still keeps a second writer out, and it goes on working.
#[test]
fn a_failed_export_target_leaves_the_store_open() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let store = CheckpointStore::open(&path)?;
    store.commit(&common::deterministic(1))?;
    let e = store
        .export_safetensors(1, "/proc/ckptstore-no/such.safetensors")
        .expect_err("/proc refuses new files");
    assert!(e.os_error().is_some(), "{e}");
    assert!(
        CheckpointStore::open(&path).is_err_and(|e| e.is_locked()),
        "the writer's lock was released by a failed export"
    );
    assert_eq!(store.steps()?, vec![1]);
    Ok(())
}
