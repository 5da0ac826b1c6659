//! Pack files: where a large commit's chunk bytes live outside the redb
//! file, and the record that says where a chunk is in one.
//!
//! A store at `run.ckpt` keeps its pack files in the sibling directory
//! `run.ckpt.packs/`, one file per write transaction that packed chunks,
//! named by a number given out in ascending order (`00000007.pack`). A
//! pack file is a 32-byte header ([`PackHeader`]: which store wrote it)
//! and then the chunks' bytes back to back (files written before headers
//! existed have none): where each
//! chunk is, its length and its BLAKE3 hash are in table `pack_chunks`
//! (a [`PackLoc`] per chunk id), and each file's length and live bytes in
//! table `pack_files`. The bytes are written and fsynced before the
//! transaction that records them commits, so a committed record always
//! points at durable bytes; a file no committed record names is left by
//! a transaction that did not commit, and is deleted if its header says
//! this store wrote it (a file without one, or another store's, is left
//! where it is and reported).

use std::path::{Path, PathBuf};

use redb::ReadableTable;

use super::manifest::Hash;
use super::tables::{META_PACK_OWNER, META_STORE_ID};
use crate::error::StorageContext;
use crate::{Error, Result};

/// The directory of the pack files of the store at `store`.
pub(crate) fn pack_dir(store: &Path) -> PathBuf {
    let mut name = store.as_os_str().to_owned();
    name.push(".packs");
    PathBuf::from(name)
}

/// The file name of pack file `id`.
pub(crate) fn pack_name(id: u32) -> String {
    format!("{id:08}.pack")
}

/// The id of the pack file named `name`, if it is one.
pub(crate) fn parse_pack_name(name: &str) -> Option<u32> {
    let digits = name.strip_suffix(".pack")?;
    if digits.len() != 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Which store wrote a pack file: 16 bytes recorded in its `meta` table.
pub(crate) type OwnerTag = [u8; 16];

/// The tag a store with id `store_id` gives its pack files.
pub(crate) fn owner_tag(store_id: &[u8]) -> OwnerTag {
    let mut hasher = blake3::Hasher::new();
    hasher.update(b"ckptstore pack owner\0");
    hasher.update(store_id);
    let mut tag = [0u8; 16];
    tag.copy_from_slice(&hasher.finalize().as_bytes()[..16]);
    tag
}

/// The `meta`'s `pack_owner` tag of the store whose `meta` table is `meta`:
/// the recorded one, else the one its first pack file gets (derived from
/// the store id, so that a transaction that fails and its retry agree).
pub(crate) fn pack_owner(
    meta: &impl ReadableTable<&'static str, &'static [u8]>,
) -> Result<OwnerTag> {
    let ctx = || "reading the pack owner from table meta".to_owned();
    if let Some(tag) = meta.get(META_PACK_OWNER).context(ctx)? {
        if let Ok(tag) = <OwnerTag>::try_from(tag.value()) {
            return Ok(tag);
        }
    }
    let id = meta.get(META_STORE_ID).context(ctx)?;
    let id = id.as_ref().map_or(&[][..], |v| v.value());
    Ok(owner_tag(id))
}

/// The first bytes of a pack file with a header.
const PACK_MAGIC: &[u8; 8] = b"ckptpack";
/// The header's layout version.
const PACK_HEADER_VERSION: u32 = 1;
/// Bytes of a pack file's header: magic (8), version (u32), pack id (u32),
/// owner tag (16), integers little endian.
pub(crate) const PACK_HEADER_BYTES: usize = 32;

/// A pack file's header: the file's id and the tag of the store that
/// wrote it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PackHeader {
    pub(crate) pack: u32,
    pub(crate) owner: OwnerTag,
}

impl PackHeader {
    pub(crate) fn encode(&self) -> [u8; PACK_HEADER_BYTES] {
        let mut out = [0u8; PACK_HEADER_BYTES];
        out[..8].copy_from_slice(PACK_MAGIC);
        out[8..12].copy_from_slice(&PACK_HEADER_VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&self.pack.to_le_bytes());
        out[16..].copy_from_slice(&self.owner);
        out
    }

    /// The header at the start of `bytes`; `None` for a file without one
    /// (written before headers, cut short, or not a pack file).
    pub(crate) fn decode(bytes: &[u8]) -> Option<PackHeader> {
        let bytes = bytes.get(..PACK_HEADER_BYTES)?;
        if &bytes[..8] != PACK_MAGIC || bytes[8..12] != PACK_HEADER_VERSION.to_le_bytes() {
            return None;
        }
        Some(PackHeader {
            pack: u32::from_le_bytes(bytes[12..16].try_into().ok()?),
            owner: bytes[16..].try_into().ok()?,
        })
    }
}

/// Where one chunk's bytes are: pack file, offset, length, and the hash
/// they must have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PackLoc {
    pub(crate) pack: u32,
    pub(crate) offset: u64,
    pub(crate) len: u32,
    pub(crate) hash: Hash,
}

/// Bytes of an encoded [`PackLoc`]: pack u32, offset u64, length u32 (all
/// little endian), hash.
pub(crate) const PACK_LOC_BYTES: usize = 4 + 8 + 4 + 32;

impl PackLoc {
    pub(crate) fn encode(&self) -> [u8; PACK_LOC_BYTES] {
        let mut out = [0u8; PACK_LOC_BYTES];
        out[..4].copy_from_slice(&self.pack.to_le_bytes());
        out[4..12].copy_from_slice(&self.offset.to_le_bytes());
        out[12..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..].copy_from_slice(&self.hash);
        out
    }

    /// Decode the record of chunk `id`.
    pub(crate) fn decode(id: u64, bytes: &[u8]) -> Result<PackLoc> {
        let bytes: &[u8; PACK_LOC_BYTES] = bytes.try_into().map_err(|_| {
            Error::corrupt(
                None,
                format!(
                    "the pack record of chunk {id} has {} bytes, not {PACK_LOC_BYTES}",
                    bytes.len()
                ),
            )
        })?;
        let (pack, rest) = bytes.split_at(4);
        let (offset, rest) = rest.split_at(8);
        let (len, hash) = rest.split_at(4);
        let le4 = |b: &[u8]| <[u8; 4]>::try_from(b).unwrap_or_default();
        Ok(PackLoc {
            pack: u32::from_le_bytes(le4(pack)),
            offset: u64::from_le_bytes(<[u8; 8]>::try_from(offset).unwrap_or_default()),
            len: u32::from_le_bytes(le4(len)),
            hash: <Hash>::try_from(hash).unwrap_or_default(),
        })
    }

    /// The offset just past the chunk.
    pub(crate) fn end(&self) -> u64 {
        self.offset + u64::from(self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_names_round_trip() {
        let loc = PackLoc {
            pack: 7,
            offset: (5 << 32) + 3,
            len: 1 << 20,
            hash: [9; 32],
        };
        assert_eq!(PackLoc::decode(1, &loc.encode()).expect("decodes"), loc);
        assert!(PackLoc::decode(1, &[0; 47]).is_err());
        assert_eq!(parse_pack_name(&pack_name(42)), Some(42));
        assert_eq!(parse_pack_name("0000004.pack"), None);
        assert_eq!(parse_pack_name("0000004x.pack"), None);
        let header = PackHeader {
            pack: 7,
            owner: owner_tag(b"store"),
        };
        assert_eq!(PackHeader::decode(&header.encode()), Some(header));
        assert_ne!(owner_tag(b"store"), owner_tag(b"other"));
        assert_eq!(PackHeader::decode(&header.encode()[..31]), None);
        assert_eq!(PackHeader::decode(&[0; 32]), None);
        assert_eq!(
            pack_dir(Path::new("/a/run.ckpt")),
            PathBuf::from("/a/run.ckpt.packs")
        );
    }
}
