//! The computation graph a checkpoint carries.
//!
//! Tensors are referenced by content identifier (CID) strings only; the graph
//! records which operation produced which CID from which inputs, so a run can
//! find what depends on a tensor or where a tensor came from.

use std::collections::{BTreeSet, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// One operation in the computation graph.
///
/// The JSON form has exactly the fields below, as the original file format
/// wrote them.
///
/// ```
/// use ckptstore::ComputationNode;
///
/// let node = ComputationNode::new("matmul", vec!["cid_a".into(), "cid_w".into()])
///     .with_meta("dtype", "f32");
/// assert_eq!(node.op, "matmul");
/// assert_eq!(node.metadata["dtype"], "f32");
/// assert!(node.output_cid.is_none());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComputationNode {
    /// Unique id (a UUID v4 for nodes made by [`ComputationNode::new`]).
    pub id: String,
    /// The operation's name ("matmul", "relu", ...).
    pub op: String,
    /// CIDs of the tensors the operation reads.
    pub input_cids: Vec<String>,
    /// CID of the tensor it produced, once known.
    pub output_cid: Option<String>,
    /// CID of the gradient with respect to its output, once known.
    pub gradient_cid: Option<String>,
    /// Free-form annotations.
    pub metadata: HashMap<String, String>,
}

impl ComputationNode {
    /// A new node with a fresh UUID v4 id and no output yet.
    pub fn new(op: impl Into<String>, input_cids: Vec<String>) -> Self {
        ComputationNode {
            id: uuid::Uuid::new_v4().to_string(),
            op: op.into(),
            input_cids,
            output_cid: None,
            gradient_cid: None,
            metadata: HashMap::new(),
        }
    }

    /// Add one metadata entry.
    pub fn with_meta(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }
}

/// A directed graph of [`ComputationNode`]s, linked producer to consumer
/// through the CIDs they share.
///
/// ```
/// use ckptstore::{ComputationGraphStore, ComputationNode};
///
/// let mut g = ComputationGraphStore::new();
/// let a = g.add_node(ComputationNode::new("load", vec![]));
/// g.record_output(&a, "cid_x")?;
/// let b = g.add_node(ComputationNode::new("relu", vec!["cid_x".into()]));
/// assert_eq!(g.edge_count(), 1);
/// assert_eq!(g.topological_order()?, vec![a.clone(), b.clone()]);
/// assert_eq!(g.find_consumers("cid_x")[0].id, b);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComputationGraphStore {
    nodes: HashMap<String, ComputationNode>,
    edges: Vec<(String, String)>,
}

impl ComputationGraphStore {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    /// The node map and the edge list, as stored.
    pub(crate) fn parts(&self) -> (&HashMap<String, ComputationNode>, &[(String, String)]) {
        (&self.nodes, &self.edges)
    }

    /// A graph of exactly these nodes and edges (a decoded manifest's).
    pub(crate) fn from_parts(
        nodes: HashMap<String, ComputationNode>,
        edges: Vec<(String, String)>,
    ) -> Self {
        ComputationGraphStore { nodes, edges }
    }

    /// Insert a node and link it to every existing node whose output it
    /// reads. Returns the node's id. A node with the id of an existing node
    /// replaces it.
    pub fn add_node(&mut self, node: ComputationNode) -> String {
        let id = node.id.clone();
        let mut producers: Vec<&str> = self
            .nodes
            .values()
            .filter(|n| n.id != id)
            .filter(|n| {
                n.output_cid
                    .as_ref()
                    .is_some_and(|cid| node.input_cids.contains(cid))
            })
            .map(|n| n.id.as_str())
            .collect();
        producers.sort_unstable();
        let new_edges: Vec<(String, String)> = producers
            .into_iter()
            .map(|p| (p.to_owned(), id.clone()))
            .collect();
        for edge in new_edges {
            self.push_edge(edge);
        }
        self.nodes.insert(id.clone(), node);
        id
    }

    /// Set the output CID of node `id` and link it to every existing node
    /// that reads that CID (never twice).
    pub fn record_output(&mut self, id: &str, cid: impl Into<String>) -> Result<()> {
        let cid = cid.into();
        let node = self.node_mut(id)?;
        node.output_cid = Some(cid.clone());
        let consumers: Vec<String> = self
            .find_consumers(&cid)
            .into_iter()
            .filter(|n| n.id != id)
            .map(|n| n.id.clone())
            .collect();
        for consumer in consumers {
            self.push_edge((id.to_owned(), consumer));
        }
        Ok(())
    }

    /// Set the gradient CID of node `id`.
    pub fn record_gradient(&mut self, id: &str, cid: impl Into<String>) -> Result<()> {
        self.node_mut(id)?.gradient_cid = Some(cid.into());
        Ok(())
    }

    /// Node ids ordered so that every producer comes before its consumers
    /// (Kahn's algorithm; among nodes ready at the same time, ids sort
    /// ascending, so the order is repeatable).
    ///
    /// Edges naming a node that is not in the graph are ignored.
    ///
    /// # Errors
    /// [`Error::GraphCycle`] when the graph has a cycle.
    pub fn topological_order(&self) -> Result<Vec<String>> {
        let mut indegree: HashMap<&str, usize> =
            self.nodes.keys().map(|k| (k.as_str(), 0)).collect();
        let mut out_edges: HashMap<&str, Vec<&str>> = HashMap::new();
        for (from, to) in &self.edges {
            if !self.nodes.contains_key(from) || !self.nodes.contains_key(to) {
                continue;
            }
            out_edges.entry(from).or_default().push(to);
            *indegree.entry(to).or_default() += 1;
        }
        let mut ready: BTreeSet<&str> = indegree
            .iter()
            .filter(|(_, &d)| d == 0)
            .map(|(&k, _)| k)
            .collect();
        let mut order = Vec::with_capacity(self.nodes.len());
        while let Some(next) = ready.pop_first() {
            order.push(next.to_owned());
            for &to in out_edges.get(next).map(Vec::as_slice).unwrap_or_default() {
                if let Some(d) = indegree.get_mut(to) {
                    *d -= 1;
                    if *d == 0 {
                        ready.insert(to);
                    }
                }
            }
        }
        if order.len() == self.nodes.len() {
            Ok(order)
        } else {
            Err(Error::GraphCycle {
                stuck: self.nodes.len() - order.len(),
                total: self.nodes.len(),
            })
        }
    }

    /// Nodes that read `cid`, sorted by id.
    pub fn find_consumers(&self, cid: &str) -> Vec<&ComputationNode> {
        let mut found: Vec<&ComputationNode> = self
            .nodes
            .values()
            .filter(|n| n.input_cids.iter().any(|c| c == cid))
            .collect();
        found.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        found
    }

    /// The nodes that led to `output_cid`, earliest first, ending with its
    /// producer. Empty when no node produced it.
    pub fn provenance_chain(&self, output_cid: &str) -> Vec<&ComputationNode> {
        let mut by_output: HashMap<&str, Vec<&ComputationNode>> = HashMap::new();
        for node in self.nodes.values() {
            if let Some(cid) = &node.output_cid {
                by_output.entry(cid).or_default().push(node);
            }
        }
        for producers in by_output.values_mut() {
            producers.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        }
        let Some(root) = by_output.get(output_cid).and_then(|p| p.first()) else {
            return Vec::new();
        };
        // Iterative post-order walk: a node is emitted after all its inputs.
        let mut chain = Vec::new();
        let mut seen: HashSet<&str> = HashSet::new();
        let mut stack: Vec<(&ComputationNode, bool)> = vec![(root, false)];
        while let Some((node, expanded)) = stack.pop() {
            if expanded {
                chain.push(node);
                continue;
            }
            if !seen.insert(&node.id) {
                continue;
            }
            stack.push((node, true));
            for input in node.input_cids.iter().rev() {
                if let Some(&producer) = by_output.get(input.as_str()).and_then(|p| p.first()) {
                    if !seen.contains(producer.id.as_str()) {
                        stack.push((producer, false));
                    }
                }
            }
        }
        chain
    }

    /// The node with this id.
    pub fn get_node(&self, id: &str) -> Option<&ComputationNode> {
        self.nodes.get(id)
    }

    /// How many nodes the graph has.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// How many producer-to-consumer edges the graph has.
    pub fn edge_count(&self) -> usize {
        self.edges.len()
    }

    /// All nodes, keyed by id.
    pub fn nodes(&self) -> &HashMap<String, ComputationNode> {
        &self.nodes
    }

    /// All edges as (producer id, consumer id), in the order they were made.
    pub fn edges(&self) -> &[(String, String)] {
        &self.edges
    }

    fn node_mut(&mut self, id: &str) -> Result<&mut ComputationNode> {
        self.nodes
            .get_mut(id)
            .ok_or_else(|| Error::UnknownNode { id: id.to_owned() })
    }

    fn push_edge(&mut self, edge: (String, String)) {
        if !self.edges.contains(&edge) {
            self.edges.push(edge);
        }
    }
}
