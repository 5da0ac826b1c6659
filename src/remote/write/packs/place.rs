//! Where chunks go: which new chunks fill which new pack, and a
//! manifest's pack list and index (format 3, or 4 where a chunk is stored
//! compressed) from where its chunks lie. Pure functions.

use std::collections::{BTreeMap, HashMap};

use crate::format::manifest::Hash;
use crate::remote::format::hash::HexHash;
use crate::remote::format::manifest::ManifestFormat;
use crate::remote::format::pack_format::{IndexEntry, Location, PackIndex, RemotePack};
use crate::remote::format::stored::Stored;

/// A pack to upload: its chunks, by their number in the pieces it was
/// placed from (read when it is uploaded). Its name and the chunks'
/// places in it follow from their stored forms, once it is built.
pub(crate) struct NewPack {
    pub(crate) members: Vec<usize>,
}

/// Which of `pieces` (hash, length) not stored where `usable` accepts go
/// into which new pack: filled to `target` raw bytes, in order.
pub(crate) fn place_pieces(
    pieces: &[(Hash, u64)],
    usable: impl Fn(&Hash) -> bool,
    target: u64,
) -> Vec<NewPack> {
    let mut packs = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    let mut queued = std::collections::HashSet::new();
    let mut size = 0u64;
    for (i, &(hash, len)) in pieces.iter().enumerate() {
        if usable(&hash) || !queued.insert(hash) {
            continue;
        }
        if size > 0 && size + len > target {
            packs.push(NewPack {
                members: std::mem::take(&mut open),
            });
            size = 0;
        }
        size += len;
        open.push(i);
    }
    if !open.is_empty() {
        packs.push(NewPack { members: open });
    }
    packs
}

/// The `packs` and `index` of a format 3 manifest naming `chunks`, from
/// where `locate` says they lie; `None` if it does not know one. Packs are
/// listed in ascending order of name: the same locations give the same
/// bytes, whoever builds the manifest.
pub(crate) fn index_of(
    chunks: impl Iterator<Item = Hash>,
    locate: impl Fn(&Hash) -> Option<Location>,
) -> Option<(Vec<RemotePack>, PackIndex)> {
    let located: Vec<(Hash, Location)> = chunks
        .map(|c| Some((c, locate(&c)?)))
        .collect::<Option<_>>()?;
    let lens: BTreeMap<Hash, u64> = located.iter().map(|(_, l)| (l.pack, l.pack_len)).collect();
    let number: HashMap<Hash, u32> = lens.keys().zip(0..).map(|(pack, n)| (*pack, n)).collect();
    let packs = lens
        .iter()
        .map(|(pack, &len)| RemotePack {
            hash: HexHash(*pack),
            len,
        })
        .collect();
    let index = located
        .iter()
        .map(|(chunk, l)| {
            let entry = IndexEntry {
                pack: number[&l.pack],
                at: l.at,
                stored: l.stored,
            };
            (HexHash(*chunk), entry)
        })
        .collect();
    Some((packs, index))
}

/// The format of a manifest with `index`: 4 where it names a chunk
/// stored compressed, else 3 (which builds before format 4 read).
pub(crate) fn format_of(index: &PackIndex) -> ManifestFormat {
    if index.values().any(|e| e.stored != Stored::Raw) {
        ManifestFormat::Compressed
    } else {
        ManifestFormat::Packs
    }
}
