//! The computation graph: linking by CID, no duplicate edges, a repeatable
//! topological order, cycles reported, consumers and provenance.

use ckptstore::{ComputationGraphStore, ComputationNode, Error};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

fn node(id: &str, op: &str, inputs: &[&str]) -> ComputationNode {
    let mut n = ComputationNode::new(
        op,
        inputs
            .iter()
            .map(std::string::ToString::to_string)
            .collect(),
    );
    id.clone_into(&mut n.id);
    n
}

#[test]
fn graph_links_orders_and_traces() -> Result {
    let mut g = ComputationGraphStore::new();
    let fresh = ComputationNode::new("noop", vec![]);
    assert_eq!(uuid::Uuid::parse_str(&fresh.id)?.get_version_num(), 4);

    // Consumers added before their producer is known are linked by
    // record_output; producers known first are linked by add_node.
    g.add_node(node("c", "add", &["x", "y"]));
    g.add_node(node("a", "load", &[]));
    g.add_node(node("b", "load", &[]));
    g.record_output("a", "x")?;
    g.record_output("b", "y")?;
    g.record_output("a", "x")?; // again: no duplicate edge
    g.add_node(node("d", "relu", &["z"]));
    g.record_output("c", "z")?;
    g.add_node(node("e", "sum", &["z", "x"]));
    assert_eq!(g.node_count(), 5);
    assert_eq!(
        g.edges(),
        &[
            ("a".into(), "c".into()),
            ("b".into(), "c".into()),
            ("c".into(), "d".into()),
            ("a".into(), "e".into()),
            ("c".into(), "e".into()),
        ]
    );
    assert_eq!(g.edge_count(), 5);
    assert_eq!(g.topological_order()?, vec!["a", "b", "c", "d", "e"]);

    let consumers: Vec<&str> = g
        .find_consumers("z")
        .iter()
        .map(|n| n.id.as_str())
        .collect();
    assert_eq!(consumers, vec!["d", "e"]);
    assert!(g.find_consumers("nothing").is_empty());

    g.record_output("d", "out")?;
    let chain: Vec<&str> = g
        .provenance_chain("out")
        .iter()
        .map(|n| n.id.as_str())
        .collect();
    assert_eq!(chain, vec!["a", "b", "c", "d"]);
    assert!(g.provenance_chain("unknown").is_empty());

    g.record_gradient("c", "grad_z")?;
    assert_eq!(
        g.get_node("c").and_then(|n| n.gradient_cid.as_deref()),
        Some("grad_z")
    );
    assert!(matches!(
        g.record_output("nope", "q"),
        Err(Error::UnknownNode { .. })
    ));
    assert!(matches!(
        g.record_gradient("nope", "q"),
        Err(Error::UnknownNode { .. })
    ));
    assert_eq!(g.nodes().len(), 5);
    Ok(())
}

#[test]
fn a_cycle_is_an_error_not_a_partial_order() -> Result {
    let mut g = ComputationGraphStore::new();
    g.add_node(node("root", "load", &[]));
    g.record_output("root", "r")?;
    g.add_node(node("p", "f", &["r", "q_out"]));
    g.add_node(node("q", "g", &["p_out"]));
    g.record_output("p", "p_out")?;
    g.record_output("q", "q_out")?;
    let err = g.topological_order().expect_err("cycle ordered");
    assert!(
        matches!(err, Error::GraphCycle { stuck: 2, total: 3 }),
        "{err:?}"
    );
    // Provenance of a cycle terminates.
    assert_eq!(g.provenance_chain("q_out").len(), 3);
    Ok(())
}

#[test]
fn json_shape_is_the_original() -> Result {
    let mut g = ComputationGraphStore::new();
    g.add_node(node("a", "load", &[]).with_meta("dtype", "f32"));
    g.record_output("a", "x")?;
    g.add_node(node("b", "relu", &["x"]));
    let v = serde_json::to_value(&g)?;
    assert_eq!(
        v,
        serde_json::json!({
            "nodes": {
                "a": {"id": "a", "op": "load", "input_cids": [], "output_cid": "x",
                      "gradient_cid": null, "metadata": {"dtype": "f32"}},
                "b": {"id": "b", "op": "relu", "input_cids": ["x"], "output_cid": null,
                      "gradient_cid": null, "metadata": {}}
            },
            "edges": [["a", "b"]]
        })
    );
    let back: ComputationGraphStore = serde_json::from_value(v)?;
    assert_eq!(back, g);
    Ok(())
}
