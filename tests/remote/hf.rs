//! Hugging Face export (issue 42): a step's tensors as safetensors shards
//! with an index, from a store and from a DCP step in a bucket; what a
//! failed export leaves.

use std::collections::BTreeMap;
use std::path::Path;

use ckptstore::{
    CheckpointStore, ComputationGraphStore, Dtype, GradientCheckpoint, Remote, Tensor,
};

use crate::Result;

/// Tensors `t0..t4` of f32, 1,000 elements (4,000 bytes) each, and an
/// untyped blob.
fn step(step: u64) -> Result<GradientCheckpoint> {
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    for i in 0..5u32 {
        let data: Vec<u8> = (0..1000u32)
            .flat_map(|k| (k as f32 * 0.5 + i as f32).to_le_bytes())
            .collect();
        c.set_tensor(
            format!("model.t{i}"),
            Tensor::new(Dtype::F32, vec![10, 100], data)?,
        );
    }
    c.set_optimizer_state("adam", vec![1; 64]);
    Ok(c)
}

/// Tensors read back: by name, (dtype, shape, bytes).
type Read = BTreeMap<String, (String, Vec<usize>, Vec<u8>)>;

/// Every tensor of the shards in `dir`, and the index if there is one.
fn read_dir(dir: &Path) -> Result<(Read, Option<serde_json::Value>)> {
    let mut tensors = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .ok_or("name")?
            .to_string_lossy()
            .into_owned();
        assert!(!name.starts_with('.'), "a temporary file is left: {name}");
        if !name.ends_with(".safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path)?;
        let file = safetensors::SafeTensors::deserialize(&bytes)?;
        for (t, view) in file.tensors() {
            let dtype = format!("{:?}", view.dtype());
            tensors.insert(t, (dtype, view.shape().to_vec(), view.data().to_vec()));
        }
    }
    let index = match std::fs::read(dir.join("model.safetensors.index.json")) {
        Ok(bytes) => Some(serde_json::from_slice(&bytes)?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(e.into()),
    };
    Ok((tensors, index))
}

#[test]
fn a_store_step_exports_as_shards_with_an_exact_index() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let c = step(3)?;
    store.commit(&c)?;
    let out = dir.path().join("hf");
    std::fs::create_dir(&out)?;
    // 4,000 bytes a tensor, at most 9,000 a shard: 2 + 2 + 1.
    let written = store.export_hf(3, &out, 9_000, Some("model."), None)?;
    assert_eq!(written.shards.len(), 3);
    assert_eq!(written.total_size, 5 * 4000);
    let (tensors, index) = read_dir(&out)?;
    let index = index.ok_or("an index")?;
    assert_eq!(index["metadata"]["total_size"], 20_000);
    let map = index["weight_map"].as_object().ok_or("a map")?;
    assert_eq!(map.len(), 5);
    assert_eq!(map["t0"], "model-00001-of-00003.safetensors");
    assert_eq!(map["t4"], "model-00003-of-00003.safetensors");
    for (name, t) in &c.tensors {
        let got = &tensors[name.strip_prefix("model.").ok_or("prefix")?];
        assert_eq!(
            (got.0.as_str(), &got.1, &got.2),
            ("F32", &vec![10, 100], &t.data)
        );
    }
    assert!(!tensors.contains_key("adam"), "untyped blobs are left out");

    // One shard: model.safetensors and no index (the old one removed);
    // cast to bf16.
    let written = store.export_hf(3, &out, 1 << 30, None, Some(Dtype::BF16))?;
    assert_eq!(written.shards, ["model.safetensors"]);
    assert!(!out.join("model.safetensors.index.json").exists());
    let names: Vec<String> = std::fs::read_dir(&out)?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    assert_eq!(names, ["model.safetensors"], "the old shards are gone");
    let bytes = std::fs::read(out.join("model.safetensors"))?;
    let file = safetensors::SafeTensors::deserialize(&bytes)?;
    let t1 = file.tensor("model.t1")?;
    assert_eq!(format!("{:?}", t1.dtype()), "BF16");
    let bf = t1.data();
    for k in [0usize, 7, 999] {
        let x = f32::from_bits(u32::from(u16::from_le_bytes([bf[2 * k], bf[2 * k + 1]])) << 16);
        let want = k as f32 * 0.5 + 1.0;
        assert!((x - want).abs() <= want / 128.0, "{k}: {x} for {want}");
    }
    Ok(())
}

/// A shard that cannot be written (its name taken by a directory) fails
/// the export: no index is left, the old one is gone, and nothing
/// temporary stays.
#[test]
fn a_failed_export_leaves_no_index() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    store.commit(&step(3)?)?;
    let out = dir.path().join("hf");
    std::fs::create_dir(&out)?;
    store.export_hf(3, &out, 9_000, None, None)?;
    std::fs::create_dir(out.join("model-00002-of-00003.safetensors.d"))?;
    std::fs::remove_file(out.join("model-00002-of-00003.safetensors"))?;
    std::fs::rename(
        out.join("model-00002-of-00003.safetensors.d"),
        out.join("model-00002-of-00003.safetensors"),
    )?;
    std::fs::write(out.join("model-00002-of-00003.safetensors/x"), b"taken")?;
    let e = store
        .export_hf(3, &out, 9_000, None, None)
        .expect_err("a shard fails");
    assert!(
        e.to_string().contains("model-00002-of-00003.safetensors"),
        "{e}"
    );
    assert!(!out.join("model.safetensors.index.json").exists());
    for entry in std::fs::read_dir(&out)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        assert!(!name.starts_with('.'), "a temporary file is left: {name}");
    }
    Ok(())
}

/// A DCP step of 2 ranks in a bucket (its metadata as `ckptstore.dcp`
/// writes it): a tensor split by rows across the ranks comes out whole.
#[test]
fn a_dcp_step_in_a_bucket_exports_whole_tensors() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = Remote::open(&format!("file://{}/b", dir.path().display()))?;
    let w: Vec<f32> = (0..12).map(|k| k as f32).collect();
    let bytes_of = |xs: &[f32]| xs.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let metadata = serde_json::json!({
        "format": 1,
        "state_dict": {
            "model.w": {"dtype": "F32", "size": [4, 3], "chunks": [
                {"offsets": [0, 0], "sizes": [2, 3]}, {"offsets": [2, 0], "sizes": [2, 3]}]},
            "model.b": {"dtype": "F32", "size": [3], "chunks": [{"offsets": [0], "sizes": [3]}]},
            "step": {"bytes": true}
        },
        "storage": [
            {"fqn": "model.w", "offset": [0, 0], "rank": 0, "entry": "t/model.w@0,0"},
            {"fqn": "model.w", "offset": [2, 0], "rank": 1, "entry": "t/model.w@2,0"},
            {"fqn": "model.b", "offset": [0], "rank": 0, "entry": "t/model.b@0"}
        ]
    });
    let mut shards = Vec::new();
    for rank in 0..2u32 {
        let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 9);
        let rows = &w[rank as usize * 6..rank as usize * 6 + 6];
        c.set_tensor(
            format!("t/model.w@{},0", rank * 2),
            Tensor::new(Dtype::F32, vec![2, 3], bytes_of(rows))?,
        );
        if rank == 0 {
            c.set_tensor(
                "t/model.b@0",
                Tensor::new(Dtype::F32, vec![3], bytes_of(&[7.0, 8.0, 9.0]))?,
            );
            c.set_optimizer_state(ckptstore::DCP_METADATA, serde_json::to_vec(&metadata)?);
        }
        shards.push(remote.upload_shard(9, rank, 2, &c.into_step())?.shard);
    }
    remote.commit_global(9, &shards)?;
    let out = dir.path().join("hf");
    std::fs::create_dir(&out)?;
    let written = remote.export_hf(9, &out, 1 << 30, Some("model."), None)?;
    assert_eq!(written.shards, ["model.safetensors"]);
    let (tensors, index) = read_dir(&out)?;
    assert!(index.is_none());
    assert_eq!(tensors["w"], ("F32".to_owned(), vec![4, 3], bytes_of(&w)));
    assert_eq!(
        tensors["b"],
        ("F32".to_owned(), vec![3], bytes_of(&[7.0, 8.0, 9.0]))
    );
    // Two shards: the index names both.
    let written = remote.export_hf(9, &out, 40, Some("model."), None)?;
    assert_eq!(written.shards.len(), 2);
    let (again, index) = read_dir(&out)?;
    assert_eq!(again, tensors);
    let index = index.ok_or("an index")?;
    assert_eq!(index["metadata"]["total_size"], 60);
    assert_eq!(index["weight_map"]["b"], "model-00001-of-00002.safetensors");
    assert_eq!(index["weight_map"]["w"], "model-00002-of-00002.safetensors");
    Ok(())
}
