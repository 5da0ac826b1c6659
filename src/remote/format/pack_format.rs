//! Bucket format 3's names and index types: what a format 3 shard
//! manifest says about packs (`docs/design.md` has the
//! bytes). Nothing here reads or writes the bucket.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::format::manifest::Hash;
use crate::remote::format::hash::HexHash;

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

/// A format 3 manifest's index: each chunk it names (hex) to the number
/// of its pack in `packs` and its offset there.
pub(crate) type PackIndex = BTreeMap<HexHash, (u32, u64)>;

/// Where a chunk lies in a pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Location {
    pub(crate) pack: Hash,
    pub(crate) pack_len: u64,
    pub(crate) at: u64,
}

/// The name of the pack holding `chunks` (hash and length), in order.
pub(crate) fn pack_name(chunks: &[(Hash, u64)]) -> Hash {
    let mut hasher = blake3::Hasher::new();
    hasher.update(b"ckptstore pack 1\0");
    for (hash, len) in chunks {
        hasher.update(hash);
        hasher.update(&len.to_le_bytes());
    }
    *hasher.finalize().as_bytes()
}
