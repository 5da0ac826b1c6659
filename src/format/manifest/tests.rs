use std::collections::{BTreeMap, HashMap};

use super::*;
use crate::format::codec::hex;
use crate::GradientCheckpoint;

fn chunked(len: u64, chunks: &[(u8, u64)]) -> BlobRef {
    BlobRef {
        len,
        at: Placement::Chunks(
            chunks
                .iter()
                .map(|&(b, id)| ChunkRef {
                    hash: [b; HASH_LEN],
                    id,
                })
                .collect(),
        ),
    }
}

/// The typed section of `ckpt`'s tensors.
fn typed(ckpt: &GradientCheckpoint) -> Vec<TypedRef<'_>> {
    ckpt.tensors
        .iter()
        .map(|(n, t)| (n.as_str(), t.dtype, t.shape.as_slice()))
        .collect()
}

fn sample() -> (GradientCheckpoint, BTreeMap<String, BlobRef>, PackedRef) {
    let mut graph = ComputationGraphStore::new();
    let a = graph.add_node(ComputationNode::new("load", vec![]).with_meta("dtype", "f32"));
    graph.record_output(&a, "cid_x").expect("node exists");
    let b = graph.add_node(ComputationNode::new("relu", vec!["cid_x".into()]));
    graph.record_gradient(&b, "cid_g").expect("node exists");
    let mut ckpt = GradientCheckpoint::new(graph, 9).with_loss_cid("cid_loss");
    ckpt.metrics.insert("loss".into(), 1.0 / 11.0);
    ckpt.metrics.insert("acc".into(), -0.0);
    let mut blobs = BTreeMap::new();
    blobs.insert("w".to_owned(), chunked(3, &[(7, 4), (8, 300)]));
    blobs.insert(
        "tiny".to_owned(),
        BlobRef {
            len: 2,
            at: Placement::Packed { offset: 1 },
        },
    );
    let packed = PackedRef {
        len: 3,
        hash: [9u8; 32],
    };
    (ckpt, blobs, packed)
}

/// A format 1 manifest of `ckpt`, as ckptstore 0.1 wrote it: blobs by
/// hash, without chunk ids.
fn encode_v1(
    ckpt: &GradientCheckpoint,
    blobs: &BTreeMap<String, BlobRef>,
    packed: Option<&PackedRef>,
) -> Vec<u8> {
    let blobs: serde_json::Map<String, serde_json::Value> = blobs
        .iter()
        .map(|(name, b)| {
            let value = match &b.at {
                Placement::Packed { offset } => {
                    serde_json::json!({"len": b.len, "chunks": [], "packed": offset})
                }
                Placement::Chunks(c) => serde_json::json!({
                    "len": b.len,
                    "chunks": c.iter().map(|c| hex(&c.hash)).collect::<Vec<_>>(),
                }),
                Placement::Format1Chunks(h) => serde_json::json!({
                    "len": b.len,
                    "chunks": h.iter().map(hex).collect::<Vec<_>>(),
                }),
            };
            (name.clone(), value)
        })
        .collect();
    let mut json = serde_json::json!({
        "format": 1,
        "step": ckpt.step,
        "timestamp": ckpt.timestamp,
        "loss_cid": ckpt.loss_cid,
        "metrics": ckpt.metrics,
        "graph": ckpt.graph,
        "blobs": blobs,
    });
    if let Some(p) = packed {
        json["packed"] = serde_json::json!({"len": p.len, "hash": hex(&p.hash)});
    }
    crate::format::manifest_v1::encode(&json)
}

fn assert_same(m: &Manifest, ckpt: &GradientCheckpoint, blobs: &BTreeMap<String, BlobRef>) {
    assert_eq!(m.step, ckpt.step);
    assert_eq!(m.timestamp, ckpt.timestamp);
    assert_eq!(m.loss_cid, ckpt.loss_cid);
    assert_eq!(m.graph, ckpt.graph);
    assert_eq!(&m.blobs, blobs);
    assert_eq!(m.metrics.len(), ckpt.metrics.len());
    for (k, v) in &ckpt.metrics {
        assert_eq!(m.metrics[k].to_bits(), v.to_bits(), "metric {k}");
    }
}

#[test]
fn both_formats_round_trip() -> Result<()> {
    let (ckpt, blobs, packed) = sample();
    // Format 1 blobs have no chunk ids: their chunks are found by hash.
    let mut v1_blobs = blobs.clone();
    for b in v1_blobs.values_mut() {
        if let Placement::Chunks(c) = &b.at {
            b.at = Placement::Format1Chunks(c.iter().map(|c| c.hash).collect());
        }
    }
    for (bytes, blobs) in [
        (
            encode_manifest(&ckpt, &typed(&ckpt), &blobs, Some(&packed))?,
            &blobs,
        ),
        (encode_v1(&ckpt, &blobs, Some(&packed)), &v1_blobs),
    ] {
        let m = decode_manifest(9, &bytes)?;
        assert_same(&m, &ckpt, blobs);
        assert_eq!(m.packed, Some(packed.clone()));
    }
    // A format 1 blob is never written as format 2.
    assert!(encode_manifest(&ckpt, &typed(&ckpt), &v1_blobs, None).is_err());
    Ok(())
}

#[test]
fn a_node_stored_under_another_key_and_dangling_edges_survive() -> Result<()> {
    let mut nodes = HashMap::new();
    let node = ComputationNode::new("matmul", vec!["cid_a".into()]);
    nodes.insert("not-its-id".to_owned(), node);
    let edges = vec![
        ("not-its-id".to_owned(), "gone".to_owned()),
        ("gone".to_owned(), "not-its-id".to_owned()),
    ];
    let graph = ComputationGraphStore::from_parts(nodes, edges);
    let ckpt = GradientCheckpoint::new(graph, 3);
    let m = decode_manifest(
        3,
        &encode_manifest(&ckpt, &typed(&ckpt), &BTreeMap::new(), None)?,
    )?;
    assert_eq!(m.graph, ckpt.graph);
    Ok(())
}

#[test]
fn damage_is_detected() -> Result<()> {
    let (ckpt, blobs, packed) = sample();
    let bytes = encode_manifest(&ckpt, &typed(&ckpt), &blobs, Some(&packed))?;
    let mut damaged = bytes.clone();
    let last = damaged.len() - 2;
    damaged[last] ^= 1;
    assert!(matches!(
        decode_manifest(9, &damaged),
        Err(Error::Corrupt { step: Some(9), .. })
    ));
    assert!(matches!(
        decode_manifest(10, &bytes),
        Err(Error::Corrupt { step: Some(10), .. })
    ));
    for cut in [0, 5, HASH_LEN, HEADER_LEN, bytes.len() - 1] {
        assert!(decode_manifest(9, &bytes[..cut]).is_err(), "cut at {cut}");
        assert!(
            decode_body(9, &bytes[HASH_LEN..cut.max(HASH_LEN)]).is_err(),
            "cut at {cut}"
        );
    }
    let mut longer = bytes[HASH_LEN..].to_vec();
    longer.push(0);
    assert!(matches!(
        decode_body(9, &longer),
        Err(Error::Corrupt { step: Some(9), .. })
    ));
    Ok(())
}

#[test]
fn blob_longer_than_its_chunks_is_rejected() -> Result<()> {
    let json = br#"{"format":1,"step":1,"timestamp":0,"loss_cid":null,
        "graph":{"nodes":{},"edges":[]},
        "blobs":{"w":{"len":18446744073709551615,"chunks":[]}}}"#;
    assert!(matches!(decode_body(1, json), Err(Error::Corrupt { .. })));
    let mut blobs = BTreeMap::new();
    blobs.insert("w".to_owned(), chunked(u64::MAX, &[(1, 0)]));
    let ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
    let bytes = encode_manifest(&ckpt, &typed(&ckpt), &blobs, None)?;
    let e = decode_manifest(1, &bytes).expect_err("too long");
    assert!(e.to_string().contains("claims"), "{e}");
    Ok(())
}

#[test]
fn a_save_record_is_format_4_and_round_trips() -> Result<()> {
    let (mut ckpt, blobs, packed) = sample();
    let plain = encode_manifest(&ckpt, &typed(&ckpt), &blobs, Some(&packed))?;
    assert_ne!(plain[HASH_LEN], BINARY_RECORDED, "no record, no format 4");
    ckpt.save_record = SaveRecord::default()
        .with_staging(Staging::new(1.5, 0.0).expect("finite"))
        .with_name("lightning:b")
        .with_name("lightning:a");
    let bytes = encode_manifest(&ckpt, &typed(&ckpt), &blobs, Some(&packed))?;
    assert_eq!(bytes[HASH_LEN], BINARY_RECORDED);
    let m = decode_manifest(9, &bytes)?;
    assert_same(&m, &ckpt, &blobs);
    assert_eq!(m.save_record, ckpt.save_record);
    // Cut short anywhere in the record, or with its bytes changed to an
    // empty record, it is damage.
    let body = &bytes[HASH_LEN..];
    for cut in 1..12 {
        let short = &body[..body.len() - cut];
        assert!(matches!(decode_body(9, short), Err(Error::Corrupt { .. })));
    }
    let mut empty = plain[HASH_LEN..].to_vec();
    if empty[0] == BINARY {
        empty.push(0); // no tensors
    }
    empty[0] = BINARY_RECORDED;
    empty.extend([0, 0]); // no staging, no names
    assert!(matches!(decode_body(9, &empty), Err(Error::Corrupt { .. })));
    Ok(())
}

#[test]
fn newer_manifest_formats_are_refused() {
    for body in [&br#"{"format":99,"step":1}"#[..], &[5u8, 1, 0][..]] {
        assert!(matches!(
            decode_body(1, body),
            Err(Error::UnsupportedFormat { .. })
        ));
    }
}

mod proptests {
    use super::*;
    use proptest::prelude::*;

    fn valid_body() -> Vec<u8> {
        let mut graph = ComputationGraphStore::new();
        let a = graph.add_node(ComputationNode::new("load", vec![]));
        graph.record_output(&a, "cid_x").expect("node exists");
        graph.add_node(ComputationNode::new("relu", vec!["cid_x".into()]));
        let mut ckpt = GradientCheckpoint::new(graph, 5);
        ckpt.metrics.insert("loss".into(), 0.5);
        let mut blobs = BTreeMap::new();
        blobs.insert("w".to_owned(), chunked(10, &[(1, 0)]));
        blobs.insert(
            "b".to_owned(),
            BlobRef {
                len: 2,
                at: Placement::Packed { offset: 0 },
            },
        );
        // A save record: the format 4 section is fuzzed too.
        ckpt.save_record = SaveRecord::default()
            .with_staging(Staging::new(0.5, 0.25).expect("finite"))
            .with_name("lightning:a");
        // A typed blob: the format 3 section is fuzzed too.
        ckpt.set_tensor(
            "t",
            Tensor::new(Dtype::I16, vec![1], vec![0, 0]).expect("valid"),
        );
        blobs.insert(
            "t".to_owned(),
            BlobRef {
                len: 2,
                at: Placement::Packed { offset: 0 },
            },
        );
        let packed = PackedRef {
            len: 2,
            hash: [2u8; 32],
        };
        encode_manifest(&ckpt, &typed(&ckpt), &blobs, Some(&packed)).expect("encodes")[HASH_LEN..]
            .to_vec()
    }

    fn assert_consistent(m: &Manifest) -> std::result::Result<(), TestCaseError> {
        prop_assert_eq!(m.step, 5);
        for (name, (dtype, shape)) in &m.typed {
            let want = Tensor::expected_bytes(*dtype, shape);
            prop_assert_eq!(want.ok(), m.blobs.get(name).map(|b| b.len));
        }
        let packed = m.packed.as_ref().map_or(0, |p| p.len);
        for blob in m.blobs.values() {
            let chunks = match &blob.at {
                Placement::Packed { offset } => {
                    prop_assert!(offset + blob.len <= packed);
                    continue;
                }
                Placement::Chunks(c) => c.len(),
                Placement::Format1Chunks(h) => h.len(),
            };
            prop_assert!(blob.len <= chunks as u64 * CHUNK_SIZE as u64);
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            if std::env::var_os("CKPT_LONG").is_some() { 50_000 } else { 2_000 }
        ))]

        /// Arbitrary bytes never panic the decoder, in either format.
        #[test]
        fn arbitrary_bytes_do_not_panic(
            kind in prop::sample::select(vec![None, Some(BINARY), Some(JSON)]),
            bytes in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            let mut body = bytes;
            if let Some(k) = kind {
                body.insert(0, k);
            }
            let _ = decode_manifest(5, &body);
            if let Ok(m) = decode_body(5, &body) {
                assert_consistent(&m)?;
            }
        }

        /// Mutations of a valid manifest (hash bypassed) decode to a
        /// consistent manifest or fail; with the hash in place any change
        /// is caught.
        #[test]
        fn mutated_manifests_decode_consistently_or_fail(
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)
        ) {
            let valid = valid_body();
            let mut body = valid.clone();
            for (at, byte) in edits {
                let i = at.index(body.len());
                body[i] = byte;
            }
            if let Ok(m) = decode_body(5, &body) {
                assert_consistent(&m)?;
            }
            if body != valid {
                let mut hashed = blake3::hash(&valid).as_bytes().to_vec();
                hashed.extend_from_slice(&body);
                prop_assert!(decode_manifest(5, &hashed).is_err());
            }
        }
    }
}
