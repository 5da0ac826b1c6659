use std::io::Cursor;

use proptest::prelude::*;

use super::read::{parse, Parse};

/// A valid file of two tensors, metadata, and a padded header.
fn valid() -> Vec<u8> {
    let header = br#"{"__metadata__":{"ckptstore.step":"3","ckptstore.blobs":"[\"b\"]"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}    "#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(&[1, 0, 0, 0, 2, 0, 0, 0, 7, 8, 9]);
    file
}

fn parse_bytes(bytes: &[u8]) -> Result<crate::GradientCheckpoint, Parse> {
    parse(&mut Cursor::new(bytes), bytes.len() as u64, 3)
}

#[test]
fn a_valid_file_parses() {
    let c = parse_bytes(&valid()).expect("valid");
    assert_eq!(c.tensors["a"].shape, vec![2]);
    assert_eq!(c.blob("b"), Some(&[7u8, 8, 9][..]));
}

#[test]
fn each_kind_of_bad_file_is_refused_with_its_reason() {
    let file = |header: &str, data: &[u8]| {
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header.as_bytes());
        f.extend_from_slice(data);
        f
    };
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("too short", vec![1, 2, 3], "too short"),
        (
            "header past the end",
            {
                let mut f = valid();
                f.truncate(20);
                f
            },
            "header of",
        ),
        (
            "huge header",
            (200_000_000u64).to_le_bytes().to_vec(),
            "allowed",
        ),
        ("not JSON", file("{nope", &[]), "invalid header"),
        (
            "not UTF-8",
            {
                let mut f = 4u64.to_le_bytes().to_vec();
                f.extend_from_slice(&[b'{', 0xff, 0xfe, b'}']);
                f
            },
            "UTF-8",
        ),
        (
            "overlap",
            file(
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
                &[0; 6],
            ),
            "invalid header",
        ),
        (
            "gap",
            file(
                r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#,
                &[0; 6],
            ),
            "invalid header",
        ),
        (
            "past the data",
            file(
                r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#,
                &[0; 4],
            ),
            "describes 8 bytes",
        ),
        (
            "size mismatch",
            file(
                r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                &[0; 8],
            ),
            "invalid header",
        ),
        (
            "unknown dtype",
            file(
                r#"{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}"#,
                &[0; 16],
            ),
            "invalid header",
        ),
        (
            "duplicate",
            file(
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                &[0; 1],
            ),
            "named twice",
        ),
        (
            "data after",
            file(
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
                &[0; 5],
            ),
            "describes 1 bytes",
        ),
    ];
    for (what, bytes, reason) in cases {
        match parse_bytes(&bytes) {
            Err(Parse::Bad(r)) => assert!(r.contains(reason), "{what}: {r}"),
            other => panic!("{what}: {other:?}"),
        }
    }
    // Zero tensors: a valid, empty file.
    let empty = file("{}      ", &[]);
    let c = parse_bytes(&empty).expect("empty file");
    assert!(c.into_step().entries.is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        if std::env::var_os("CKPT_LONG").is_some() { 1_000_000 } else { 3_000 }
    ))]

    /// Arbitrary bytes never panic the parser.
    #[test]
    fn arbitrary_bytes_do_not_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = parse_bytes(&bytes);
    }

    /// Mutations of a valid file parse to a consistent checkpoint or fail.
    #[test]
    fn mutated_files_parse_consistently_or_fail(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)
    ) {
        let mut bytes = valid();
        for (at, byte) in edits {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        if let Ok(c) = parse_bytes(&bytes) {
            for t in c.tensors.values() {
                prop_assert!(t.check().is_ok());
            }
        }
    }
}
