//! A step `ckptstore.dcp` saved into a store (one rank's, its metadata
//! beside its boxes) out as one safetensors file of whole tensors, as a
//! bucket's global step is (`Remote::consolidate`).

use ckptstore::{CheckpointStore, ComputationGraphStore, Dtype, Error, GradientCheckpoint, Tensor};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

fn bytes_of(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Step 9: `model.w` (4 x 3) saved as two boxes of rows, `model.b`, a
/// complex128 `extra.z` safetensors cannot hold, and a non-tensor value.
fn dcp_step(w: &[f32]) -> Result<GradientCheckpoint> {
    let metadata = serde_json::json!({
        "format": 1,
        "state_dict": {
            "model.w": {"dtype": "F32", "size": [4, 3], "chunks": [
                {"offsets": [0, 0], "sizes": [2, 3]}, {"offsets": [2, 0], "sizes": [2, 3]}]},
            "model.b": {"dtype": "F32", "size": [3], "chunks": [{"offsets": [0], "sizes": [3]}]},
            "extra.z": {"dtype": "torch.complex128", "itemsize": 16, "size": [1],
                        "chunks": [{"offsets": [0], "sizes": [1]}]},
            "step": {"bytes": true}
        },
        "storage": [
            {"fqn": "model.w", "offset": [0, 0], "rank": 0, "entry": "t/model.w@0,0"},
            {"fqn": "model.w", "offset": [2, 0], "rank": 0, "entry": "t/model.w@2,0"},
            {"fqn": "model.b", "offset": [0], "rank": 0, "entry": "t/model.b@0"},
            {"fqn": "extra.z", "offset": [0], "rank": 0, "entry": "t/extra.z@0"},
            {"fqn": "step", "rank": 0, "entry": "b/step"}
        ]
    });
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 9);
    for (at, rows) in [(0, &w[..6]), (2, &w[6..])] {
        let t = Tensor::new(Dtype::F32, vec![2, 3], bytes_of(rows))?;
        c.set_tensor(format!("t/model.w@{at},0"), t);
    }
    c.set_tensor(
        "t/model.b@0",
        Tensor::new(Dtype::F32, vec![3], bytes_of(&[7.0, 8.0, 9.0]))?,
    );
    c.set_tensor(
        "t/extra.z@0",
        Tensor::new(Dtype::U8, vec![16], vec![3; 16])?,
    );
    c.set_optimizer_state("b/step", vec![1, 2, 3]);
    c.set_optimizer_state(ckptstore::DCP_METADATA, serde_json::to_vec(&metadata)?);
    Ok(c)
}

#[test]
fn a_dcp_step_of_a_store_consolidates_into_whole_tensors() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let w: Vec<f32> = (0..12).map(|k| k as f32).collect();
    store.commit(&dcp_step(&w)?)?;
    let out = dir.path().join("model.safetensors");

    let names = store.consolidate(9, &out, Some("model."))?;
    assert_eq!(names, ["b", "w"]);
    let bytes = std::fs::read(&out)?;
    let file = safetensors::SafeTensors::deserialize(&bytes)?;
    let w_out = file.tensor("w")?;
    assert_eq!(
        (w_out.shape(), w_out.data()),
        (&[4, 3][..], &bytes_of(&w)[..])
    );
    assert_eq!(file.tensor("b")?.data(), &bytes_of(&[7.0, 8.0, 9.0])[..]);

    // A dtype safetensors cannot hold is named, and no file is written.
    let all = dir.path().join("all.safetensors");
    let refused = store.consolidate(9, &all, None).expect_err("complex128");
    assert!(
        matches!(refused, Error::InvalidCheckpoint { .. }),
        "{refused}"
    );
    assert!(refused.to_string().contains("extra.z"), "{refused}");
    assert!(!all.exists());

    // A step not stored, and one not saved through DCP.
    assert!(matches!(
        store.consolidate(8, &all, None),
        Err(Error::StepNotFound { step: 8 })
    ));
    let mut plain = GradientCheckpoint::new(ComputationGraphStore::new(), 10);
    plain.set_optimizer_state("x", vec![0; 4]);
    store.commit(&plain)?;
    let refused = store.consolidate(10, &all, None).expect_err("not DCP");
    assert!(refused.to_string().contains("ckptstore.dcp"), "{refused}");
    assert!(!all.exists());
    Ok(())
}
