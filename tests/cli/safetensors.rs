//! `ckpt export -o FILE.safetensors` and `ckpt import FILE.safetensors
//! --step N`: a step goes out and back unchanged; bad files leave no trace.

use crate::common;

use ckptstore::{CheckpointStore, Dtype, GradientCheckpoint, Tensor};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

fn step_with_tensors(step: u64) -> Result<GradientCheckpoint> {
    let mut c = common::checkpoint(step, &[100, 300_000])?;
    c.set_tensor(
        "w",
        Tensor::new(Dtype::F32, vec![512, 256], common::bytes(1, 512 * 256 * 4))?,
    );
    c.set_tensor(
        "b",
        Tensor::new(Dtype::BF16, vec![7], common::bytes(2, 14))?,
    );
    c.set_tensor(
        "s",
        Tensor::new(Dtype::I64, vec![], 42i64.to_le_bytes().to_vec())?,
    );
    c.set_tensor("z", Tensor::new(Dtype::F16, vec![0, 3], Vec::new())?);
    c.set_tensor("q", Tensor::new(Dtype::F8_E5M2, vec![4], vec![1, 2, 3, 4])?);
    Ok(c)
}

#[test]
fn export_then_import_gives_the_same_checkpoint() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let stored = step_with_tensors(5)?;
    CheckpointStore::open(&path)?.commit(&stored)?;
    let p = path.to_str().ok_or("path")?;
    let out = dir.path().join("step5.safetensors");
    let o = out.to_str().ok_or("path")?;
    let (code, _, err) = common::ckpt(&["export", p, "5", "-o", o])?;
    assert_eq!(code, 0, "{err}");
    let (code, out_text, err) = common::ckpt(&["show", p, "5"])?;
    assert_eq!(code, 0, "{err}");
    assert!(
        out_text.contains("BF16") && out_text.contains("[512, 256]"),
        "{out_text}"
    );

    let other = dir.path().join("other.ckpt");
    let target = other.to_str().ok_or("path")?;
    let (code, _, err) = common::ckpt(&["import", target, o])?;
    assert_eq!(code, 1, "import without --step");
    assert!(err.contains("--step"), "{err}");
    assert!(!other.exists());
    let (code, _, err) = common::ckpt(&["import", target, o, "--step", "9"])?;
    assert_eq!(code, 0, "{err}");
    let mut want = stored.clone();
    want.step = 9;
    assert_eq!(CheckpointStore::open_read_only(&other)?.get(9)?, Some(want));

    // --format overrides the name; JSON still works.
    let json = dir.path().join("step5.data");
    let json_path = json.to_str().ok_or("path")?;
    assert_eq!(
        common::ckpt(&["export", p, "5", "-o", json_path, "--format", "json"])?.0,
        0
    );
    assert_eq!(GradientCheckpoint::load(&json)?, stored);
    Ok(())
}

#[test]
fn a_bad_safetensors_file_leaves_no_trace() -> Result {
    let dir = tempfile::tempdir()?;
    let bad = dir.path().join("bad.safetensors");
    let header = br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0; 8]); // 8 of the 16 bytes
    std::fs::write(&bad, &bytes)?;
    let store = dir.path().join("new.ckpt");
    let (code, _, err) = common::ckpt(&[
        "import",
        store.to_str().ok_or("path")?,
        bad.to_str().ok_or("path")?,
        "--step",
        "1",
    ])?;
    assert_eq!(code, 1);
    assert!(
        err.contains("bad.safetensors") && err.contains("16 bytes of data"),
        "{err}"
    );
    assert!(!store.exists(), "a refused import created the store");

    // Exporting a missing step or into a missing directory writes nothing.
    let path = dir.path().join("run.ckpt");
    let s = CheckpointStore::open(&path)?;
    s.commit(&step_with_tensors(1)?)?;
    assert!(s
        .export_safetensors(2, dir.path().join("x.safetensors"))
        .is_err());
    assert!(s
        .export_safetensors(1, dir.path().join("no/such/x.safetensors"))
        .is_err());
    let names = common::dir_names(dir.path())?;
    assert_eq!(names, vec!["bad.safetensors", "run.ckpt"], "{names:?}");
    Ok(())
}

#[test]
fn import_streams_large_tensors_and_keeps_the_accounting() -> Result {
    let dir = tempfile::tempdir()?;
    let source = CheckpointStore::open(dir.path().join("a.ckpt"))?;
    let c = step_with_tensors(1)?;
    source.commit(&c)?;
    let file = dir.path().join("one.safetensors");
    source.export_safetensors(1, &file)?;

    let store = CheckpointStore::open(dir.path().join("b.ckpt"))?;
    let first = store.import_safetensors(&file, 1)?;
    assert_eq!(first.logical_bytes, c.logical_bytes());
    let second = store.import_safetensors(&file, 2)?;
    // The 512 KiB tensor and the 300 KB blob were staged, then found again.
    assert!(second.bytes_reused >= 512 * 1024 + 300_000, "{second:?}");
    let e = store
        .import_safetensors(&file, 1)
        .expect_err("step 1 is stored");
    assert!(matches!(e, ckptstore::Error::StepExists { step: 1 }), "{e}");
    assert_eq!(store.steps()?, vec![1, 2]);
    let report = store.verify()?;
    assert!(report.is_ok() && report.staged_chunks == 0, "{report:?}");
    let mut want = c;
    want.step = 2;
    assert_eq!(store.get(2)?, Some(want));
    Ok(())
}
