//! What a bucket manifest needs and where its chunks lie: its chunk
//! objects (formats 1 and 2) or ranges of its packs (format 3).

use std::collections::BTreeMap;

use crate::format::manifest::Hash;
use crate::remote::format::hash::HexHash;
use crate::remote::format::manifest::{RemoteBlob, RemoteManifest};
use crate::remote::format::pack_format::{Location, Object};

impl RemoteManifest {
    /// Where chunk `hash` lies: its own object (formats 1 and 2), or a
    /// range of a pack (format 3); `None` if a format 3 manifest does not
    /// index it (refused by its checks).
    pub(crate) fn locate(&self, hash: &Hash) -> Option<(Object, Option<u64>)> {
        let (Some(packs), Some(index)) = (&self.packs, &self.index) else {
            return Some((Object::Chunk(*hash), None));
        };
        let &(pack, at) = index.get(&HexHash(*hash))?;
        let pack = packs.get(usize::try_from(pack).ok()?)?;
        Some((Object::Pack(pack.hash.0), Some(at)))
    }

    /// The objects it needs: its packs (format 3), else its chunks and
    /// its packed chunk.
    pub(crate) fn objects(&self) -> Vec<Object> {
        if let Some(packs) = &self.packs {
            return packs.iter().map(|p| Object::Pack(p.hash.0)).collect();
        }
        chunks_of(self).map(Object::Chunk).collect()
    }

    /// What [`locate`](Self::locate) needs of it, without its blobs and
    /// graph.
    pub(crate) fn locator(&self) -> RemoteManifest {
        RemoteManifest {
            format: self.format,
            step: self.step,
            timestamp: self.timestamp,
            loss_cid: None,
            metrics: BTreeMap::new(),
            graph: serde_json::Value::Null,
            blobs: BTreeMap::new(),
            packed: self.packed.clone(),
            packs: self.packs.clone(),
            index: self.index.clone(),
            save_record: Box::default(),
            save: self.save.clone(),
        }
    }
}

impl RemoteManifest {
    /// Each chunk's location (format 3; none for other formats).
    pub(crate) fn locations(&self) -> Vec<(Hash, Location)> {
        let (Some(packs), Some(index)) = (&self.packs, &self.index) else {
            return Vec::new();
        };
        index
            .iter()
            .filter_map(|(chunk, &(pack, at))| {
                let pack = packs.get(usize::try_from(pack).ok()?)?;
                let location = Location {
                    pack: pack.hash.0,
                    pack_len: pack.len,
                    at,
                };
                Some((chunk.0, location))
            })
            .collect()
    }
}

impl RemoteManifest {
    /// Each distinct chunk it names, with its length: its blobs' chunks
    /// in name order, then its packed chunk.
    pub(crate) fn chunk_lengths(&self) -> Vec<(Hash, u64)> {
        let mut seen = std::collections::HashSet::new();
        let blobs = self.blobs.values().flat_map(|b| {
            let hashes = b.chunks().iter();
            hashes.zip(b.chunk_lengths().map(|n| n as u64))
        });
        let packed = self.packed.iter().map(|p| (&p.hash, p.len));
        blobs
            .chain(packed)
            .map(|(h, n)| (h.0, n))
            .filter(|(h, _)| seen.insert(*h))
            .collect()
    }
}

/// The chunks a manifest names (its blobs' and its packed chunk).
pub(crate) fn chunks_of(m: &RemoteManifest) -> impl Iterator<Item = Hash> + '_ {
    m.blobs
        .values()
        .flat_map(RemoteBlob::chunks)
        .chain(m.packed.iter().map(|p| &p.hash))
        .map(|h| h.0)
}
