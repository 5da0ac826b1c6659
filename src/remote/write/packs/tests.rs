//! Placing chunks in packs, building packs, their manifests' index.

use std::collections::HashMap;

use bytes::Bytes;

use super::build::{build, compress_all};
use super::place::{format_of, index_of, place_pieces};
use crate::format::manifest::Hash;
use crate::remote::format::hash::HexHash;
use crate::remote::format::manifest::ManifestFormat;
use crate::remote::format::pack_format::{pack_name, IndexEntry, Location, PackIndex};
use crate::remote::format::stored::{self, Stored, Width};

#[test]
fn pieces_fill_packs_to_the_target_and_known_chunks_stay_put(
) -> Result<(), std::num::TryFromIntError> {
    let h = |x: u8| [x; 32];
    let raw = |x: u8| (Bytes::from(vec![x; 40]), Stored::Raw);
    let mut known = HashMap::new();
    let old = Location {
        pack: [9; 32],
        pack_len: 500,
        at: 100,
        stored: Stored::Raw,
    };
    known.insert(h(2), old);
    let pieces = [(h(1), 40), (h(2), 40), (h(3), 40), (h(1), 40)];
    let packs = place_pieces(&pieces, |h| known.contains_key(h), 64);
    // 1 and 3 are new; 40 + 40 > 64: a pack each.
    assert_eq!(packs.len(), 2);
    assert_eq!(
        (&packs[0].members[..], &packs[1].members[..]),
        (&[0][..], &[2][..])
    );
    let two = place_pieces(&pieces, |h| known.contains_key(h), 100);
    assert_eq!(two[0].members, [0, 2]);
    let one = build(&[pieces[0]], vec![raw(1)]);
    let three = build(&[pieces[2]], vec![raw(3)]);
    assert_eq!(
        (three.placed[0].1.pack, three.placed[0].1.at),
        (three.name, 0)
    );
    let both = build(&[pieces[0], pieces[2]], vec![raw(1), raw(3)]);
    assert_eq!(both.placed[1].1.at, 40);
    known.extend(one.placed.iter().chain(&three.placed).copied());
    let locate = |h: &Hash| known.get(h).copied();
    let (list, index) = index_of([h(1), h(2), h(3)].into_iter(), locate).expect("all known");
    assert_eq!(list.len(), 3);
    // Packs in order of name: the same locations, the same manifest.
    assert!(list.windows(2).all(|w| w[0].hash < w[1].hash));
    let old = list
        .iter()
        .position(|p| p.hash == HexHash([9; 32]))
        .expect("listed");
    let entry = IndexEntry {
        pack: u32::try_from(old)?,
        at: 100,
        stored: Stored::Raw,
    };
    assert_eq!(index[&HexHash(h(2))], entry);
    assert_eq!(format_of(&index), ManifestFormat::Packs);
    let again = index_of([h(3), h(2), h(1)].into_iter(), locate).expect("all known");
    assert_eq!(again, (list, index));
    assert!(index_of([h(4)].into_iter(), locate).is_none());
    // The name is the chunk list's: the same chunks, the same pack; a
    // pack of raw chunks keeps format 3's name.
    assert_eq!(pack_name(&[(h(1), 40, Stored::Raw)]), one.name);
    assert_ne!(pack_name(&[(h(1), 41, Stored::Raw)]), one.name);
    Ok(())
}

#[test]
fn compressed_chunks_lie_at_their_stored_lengths_and_name_their_pack() {
    let h = |x: u8| [x; 32];
    let floats: Vec<u8> = (0..4096u32)
        .flat_map(|i| ((i % 7) as f32).to_le_bytes())
        .collect();
    let n = floats.len() as u64;
    let noise = stored::noise(7, 4096);
    let pieces = [(h(1), n), (h(2), noise.len() as u64)];
    let stored = compress_all(
        vec![Bytes::from(floats.clone()), Bytes::from(noise.clone())],
        &[Some(Width::Four), Some(Width::One)],
    );
    let Stored::Zstd { len, width } = stored[0].1 else {
        panic!("the floats shrink: {:?}", stored[0].1)
    };
    assert_eq!((width, stored[1].1), (Width::Four, Stored::Raw));
    let built = build(&pieces, stored);
    let (first, second) = (built.placed[0].1, built.placed[1].1);
    assert_eq!((first.at, second.at), (0, len));
    assert_eq!(first.pack_len, len + noise.len() as u64);
    assert_ne!(
        built.name,
        pack_name(&[(h(1), n, Stored::Raw), (h(2), 4096, Stored::Raw)])
    );
    let index: PackIndex = [(
        HexHash(h(1)),
        IndexEntry {
            pack: 0,
            at: 0,
            stored: first.stored,
        },
    )]
    .into();
    assert_eq!(format_of(&index), ManifestFormat::Compressed);
    // Written as four numbers, read back the same; format 3's two.
    let json = serde_json::to_string(&index).expect("encodes");
    assert_eq!(json, format!("{{\"{}\":[0,0,{len},4]}}", HexHash(h(1))));
    assert_eq!(
        serde_json::from_str::<PackIndex>(&json).expect("decodes"),
        index
    );
    for bad in [
        "[0,0,5,3]",
        "[0,0,5]",
        "[0]",
        "[0,0,1,2,3]",
        "[4294967296,0]",
    ] {
        let text = format!("{{\"{}\":{bad}}}", HexHash(h(1)));
        assert!(serde_json::from_str::<PackIndex>(&text).is_err(), "{bad}");
    }
}
