//! Bucket formats 3 and 4's names and index types: what a shard
//! manifest says about packs and (format 4) each chunk's stored form
//! (`docs/design.md` has the bytes). Nothing here reads or writes the
//! bucket.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::format::manifest::Hash;
use crate::remote::format::hash::HexHash;
use crate::remote::format::stored::{Stored, Width};

/// The size a pack is filled to (a pack holds at least one chunk, so one
/// larger chunk makes a larger pack): a save costs about one request per
/// this many bytes.
pub const DEFAULT_PACK_BYTES: u64 = 64 << 20;

/// An object a manifest needs in the bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Object {
    /// `chunks/<hash>`: one chunk (formats 1 and 2).
    Chunk(Hash),
    /// `packs/<hash>`: chunks back to back (format 3).
    Pack(Hash),
}

/// A pack a format 3 manifest names: its name's hash and its length.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RemotePack {
    pub(crate) hash: HexHash,
    pub(crate) len: u64,
}

/// A manifest's index (formats 3 and 4): each chunk it names (hex) to
/// where it lies.
pub(crate) type PackIndex = BTreeMap<HexHash, IndexEntry>;

/// Where a chunk lies: the number of its pack in the manifest's `packs`,
/// its offset there and its stored form. Written `[pack, offset]` for a
/// chunk stored raw (formats 3 and 4), `[pack, offset, stored length,
/// width]` for one stored compressed (format 4 only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IndexEntry {
    pub(crate) pack: u32,
    pub(crate) at: u64,
    pub(crate) stored: Stored,
}

impl Serialize for IndexEntry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.stored {
            Stored::Raw => (self.pack, self.at).serialize(s),
            Stored::Zstd { len, width } => (self.pack, self.at, len, width.get()).serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for IndexEntry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let numbers = <Vec<u64>>::deserialize(d)?;
        let pack =
            |n: u64| u32::try_from(n).map_err(|_| D::Error::custom("a pack number past 2^32"));
        match numbers[..] {
            [p, at] => Ok(IndexEntry {
                pack: pack(p)?,
                at,
                stored: Stored::Raw,
            }),
            [p, at, len, width] => {
                let width = Width::from_written(width)
                    .ok_or_else(|| D::Error::custom(format!("an element width of {width}")))?;
                Ok(IndexEntry {
                    pack: pack(p)?,
                    at,
                    stored: Stored::Zstd { len, width },
                })
            }
            _ => Err(D::Error::custom(
                "an index entry of neither 2 nor 4 numbers",
            )),
        }
    }
}

/// Where a chunk lies in a pack, and what the pack holds of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Location {
    pub(crate) pack: Hash,
    pub(crate) pack_len: u64,
    pub(crate) at: u64,
    pub(crate) stored: Stored,
}

/// The name of the pack holding `chunks` (hash, raw length and stored
/// form), in order: of a pack of raw chunks, format 3's name; of one
/// holding a compressed chunk, a name of its own domain, which also
/// names each chunk's stored length and width.
pub(crate) fn pack_name(chunks: &[(Hash, u64, Stored)]) -> Hash {
    let mut hasher = blake3::Hasher::new();
    if chunks.iter().all(|(_, _, s)| *s == Stored::Raw) {
        hasher.update(b"ckptstore pack 1\0");
        for (hash, len, _) in chunks {
            hasher.update(hash);
            hasher.update(&len.to_le_bytes());
        }
        return *hasher.finalize().as_bytes();
    }
    hasher.update(b"ckptstore pack 2\0");
    for (hash, len, stored) in chunks {
        hasher.update(hash);
        hasher.update(&len.to_le_bytes());
        let (n, width) = match *stored {
            Stored::Raw => (*len, 0),
            Stored::Zstd { len, width } => (len, width.get()),
        };
        hasher.update(&n.to_le_bytes());
        hasher.update(&[u8::try_from(width).unwrap_or(u8::MAX)]);
    }
    *hasher.finalize().as_bytes()
}
