//! `GradientCheckpoint::save`/`load` keep the original JSON file format,
//! both ways: files the original wrote load, and files we write load in the
//! original's structs.

use std::collections::HashMap;
use std::path::Path;

use ckptstore::{CheckpointStore, GradientCheckpoint};
use serde::{Deserialize, Serialize};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

// The original's types, field for field, as the original declared them.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct SeedNode {
    id: String,
    op: String,
    input_cids: Vec<String>,
    output_cid: Option<String>,
    gradient_cid: Option<String>,
    metadata: HashMap<String, String>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct SeedGraph {
    nodes: HashMap<String, SeedNode>,
    edges: Vec<(String, String)>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct SeedCheckpoint {
    graph: SeedGraph,
    step: u64,
    loss_cid: Option<String>,
    optimizer_state: HashMap<String, Vec<u8>>,
    timestamp: u64,
}

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/seed_step42.json"
);

#[test]
fn a_file_in_the_original_pretty_format_loads() -> Result {
    let ckpt = GradientCheckpoint::load(Path::new(FIXTURE))?;
    assert_eq!(ckpt.step, 42);
    assert_eq!(ckpt.timestamp, 1_750_000_000);
    assert_eq!(ckpt.loss_cid.as_deref(), Some("cid_loss_xyz"));
    assert_eq!(ckpt.optimizer_state["adam_m"], vec![1, 2, 3, 255, 0]);
    assert!(ckpt.optimizer_state["empty"].is_empty());
    assert!(ckpt.metrics.is_empty());
    assert_eq!(ckpt.graph.node_count(), 2);
    assert_eq!(ckpt.graph.edge_count(), 1);
    let relu = ckpt
        .graph
        .get_node("a0b1c2d3-e4f5-4a6b-8c7d-9e0f1a2b3c4d")
        .ok_or("node missing")?;
    assert_eq!(relu.gradient_cid.as_deref(), Some("cid_grad_b"));
    assert_eq!(
        ckpt.graph.topological_order()?,
        vec![
            "6f1c2a9e-3b7d-4c1e-9a2f-0d8e5b4c3a21".to_owned(),
            "a0b1c2d3-e4f5-4a6b-8c7d-9e0f1a2b3c4d".to_owned()
        ]
    );
    Ok(())
}

#[test]
fn saved_files_are_the_original_format_both_ways() -> Result {
    let dir = tempfile::tempdir()?;
    let original = GradientCheckpoint::load(Path::new(FIXTURE))?;

    // What we save parses as the original's struct and is the same JSON
    // document as the fixture.
    let ours = dir.path().join("ours.json");
    original.save(&ours)?;
    let text = std::fs::read_to_string(&ours)?;
    let as_seed: SeedCheckpoint = serde_json::from_str(&text)?;
    let fixture_seed: SeedCheckpoint = serde_json::from_str(&std::fs::read_to_string(FIXTURE)?)?;
    assert_eq!(as_seed, fixture_seed);
    let ours_value: serde_json::Value = serde_json::from_str(&text)?;
    let fixture_value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(FIXTURE)?)?;
    assert_eq!(ours_value, fixture_value);
    assert!(
        text.contains("\n  \"step\": 42,"),
        "not pretty-printed:\n{text}"
    );
    assert!(
        text.contains("\"adam_m\": [\n      1,"),
        "blobs not number arrays"
    );

    // What the original's code writes (to_vec_pretty of its struct) loads.
    let seed_written = dir.path().join("seed.json");
    std::fs::write(&seed_written, serde_json::to_vec_pretty(&fixture_seed)?)?;
    assert_eq!(GradientCheckpoint::load(&seed_written)?, original);

    // And the store carries the same checkpoint unchanged.
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    store.commit(&original)?;
    assert_eq!(store.get(42)?.as_ref(), Some(&original));
    Ok(())
}

#[test]
fn metrics_survive_our_format_and_are_ignored_by_the_original() -> Result {
    let dir = tempfile::tempdir()?;
    let ckpt = GradientCheckpoint::load(Path::new(FIXTURE))?.with_metric("loss", 0.125);
    let path = dir.path().join("m.json");
    ckpt.save(&path)?;
    assert_eq!(GradientCheckpoint::load(&path)?, ckpt);
    let as_seed: SeedCheckpoint = serde_json::from_slice(&std::fs::read(&path)?)?;
    assert_eq!(as_seed.step, 42);
    Ok(())
}
