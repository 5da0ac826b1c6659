//! A BLAKE3 hash as the bucket's objects hold it: 64 lowercase hex digits
//! in JSON and in object names, 32 bytes in memory. Decoded once, where an
//! object is read (a body naming anything else is not one this build
//! reads), never re-parsed where it is used.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::format::manifest::{hex, Hash};

/// A hash in a bucket object's body (a chunk, a pack, a packed chunk, a
/// shard manifest).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct HexHash(pub(crate) Hash);

impl HexHash {
    /// `s` if it is 64 lowercase hex digits.
    pub(crate) fn parse(s: &str) -> Option<HexHash> {
        parse_hex(s).map(HexHash)
    }
}

/// The bytes 64 lowercase hex digits spell; None for anything else.
pub(crate) use crate::hex::decode as parse_hex;

impl From<Hash> for HexHash {
    fn from(h: Hash) -> Self {
        HexHash(h)
    }
}

impl fmt::Display for HexHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Debug for HexHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HexHash({self})")
    }
}

/// A shard's name in a global step: the BLAKE3 hash of the bytes of its
/// manifest, as [`ShardInfo::shard`](crate::ShardInfo::shard) gives it
/// and [`Remote::commit_global`](crate::Remote::commit_global) takes it.
/// Shown (`Display`) as 64 lowercase hex digits, and read back from them
/// by [`from_hex`](Self::from_hex).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ShardHash(pub(crate) Hash);

impl ShardHash {
    /// The hash's 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The name `Display` shows as `hex`: 64 lowercase hex digits, or None.
    pub fn from_hex(hex: &str) -> Option<ShardHash> {
        parse_hex(hex).map(ShardHash)
    }
}

impl fmt::Display for ShardHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Debug for ShardHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ShardHash({self})")
    }
}

/// Which save a shard of a rank-local save belongs to
/// ([`ShardUpload::RankLocal`](crate::ShardUpload::RankLocal)): the BLAKE3
/// hash of an identity every rank of the save gives alike and no other
/// save of the step gives. A step completes only with shards of one save.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SaveId(pub(crate) Hash);

impl SaveId {
    /// The id of the save `identity` names.
    pub fn of(identity: &str) -> SaveId {
        SaveId(*blake3::hash(identity.as_bytes()).as_bytes())
    }
}

impl fmt::Display for SaveId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Debug for SaveId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SaveId({self})")
    }
}

impl Serialize for HexHash {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex(&self.0))
    }
}

impl<'de> Deserialize<'de> for HexHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct HexVisitor;
        impl Visitor<'_> for HexVisitor {
            type Value = HexHash;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a hash: 64 lowercase hex digits")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<HexHash, E> {
                HexHash::parse(s).ok_or_else(|| E::invalid_value(de::Unexpected::Str(s), &self))
            }
        }
        d.deserialize_str(HexVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_is_64_lowercase_hex_digits_both_ways() {
        let h = HexHash([0xab; 32]);
        let json = serde_json::to_string(&h).expect("encodes");
        assert_eq!(json, format!("\"{}\"", "ab".repeat(32)));
        assert_eq!(serde_json::from_str::<HexHash>(&json).expect("decodes"), h);
        for bad in [
            "AB".repeat(32),
            "ab".repeat(31),
            "+b".repeat(32),
            "ab".repeat(33),
            "gg".repeat(32),
        ] {
            assert!(HexHash::parse(&bad).is_none(), "{bad}");
            assert!(
                serde_json::from_str::<HexHash>(&format!("\"{bad}\"")).is_err(),
                "{bad}"
            );
        }
        assert!(serde_json::from_str::<HexHash>("7").is_err());
        // Lowercase hex sorts as the bytes do: maps keyed by hash keep
        // the order they were written in.
        let (lo, hi) = (HexHash([0x0f; 32]), HexHash([0xa0; 32]));
        assert!(lo < hi && lo.to_string() < hi.to_string());
    }

    #[test]
    fn a_shard_name_reads_back_from_what_it_shows() {
        let name = ShardHash([0x5c; 32]);
        assert_eq!(ShardHash::from_hex(&name.to_string()), Some(name));
        assert_eq!(
            format!("{name:?}"),
            format!("ShardHash({})", "5c".repeat(32))
        );
        for bad in ["5C".repeat(32), "5c".repeat(31), String::new(), "x".into()] {
            assert_eq!(ShardHash::from_hex(&bad), None, "{bad}");
        }
    }
}
