//! What a bucket manifest needs and where its chunks lie: its chunk
//! objects (formats 1 and 2) or ranges of its packs (formats 3 and 4).

use std::collections::{BTreeMap, HashMap};

use crate::format::manifest::Hash;
use crate::remote::format::hash::HexHash;
use crate::remote::format::manifest::{RemoteBlob, RemoteManifest};
use crate::remote::format::pack_format::{Location, Object};
use crate::remote::format::stored::{Stored, Width};
use crate::Dtype;

impl RemoteManifest {
    /// Where chunk `hash` lies and what is stored of it there: its own
    /// object (formats 1 and 2), or a range of a pack (formats 3 and 4);
    /// `None` if a manifest with packs does not index it (refused by its
    /// checks).
    pub(crate) fn locate(&self, hash: &Hash) -> Option<(Object, Option<u64>, Stored)> {
        let (Some(packs), Some(index)) = (&self.packs, &self.index) else {
            return Some((Object::Chunk(*hash), None, Stored::Raw));
        };
        let entry = index.get(&HexHash(*hash))?;
        let pack = packs.get(usize::try_from(entry.pack).ok()?)?;
        Some((Object::Pack(pack.hash.0), Some(entry.at), entry.stored))
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
    /// Each chunk's location (formats 3 and 4; none for other formats).
    pub(crate) fn locations(&self) -> Vec<(Hash, Location)> {
        let (Some(packs), Some(index)) = (&self.packs, &self.index) else {
            return Vec::new();
        };
        index
            .iter()
            .filter_map(|(chunk, entry)| {
                let pack = packs.get(usize::try_from(entry.pack).ok()?)?;
                let location = Location {
                    pack: pack.hash.0,
                    pack_len: pack.len,
                    at: entry.at,
                    stored: entry.stored,
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

impl RemoteManifest {
    /// The element width of each chunk of its tensors' (by which a chunk
    /// is split into byte planes where it is compressed).
    pub(crate) fn chunk_widths(&self) -> HashMap<Hash, Width> {
        let mut widths = HashMap::new();
        for blob in self.blobs.values() {
            let Some(dtype) = blob
                .tensor
                .as_ref()
                .and_then(|t| Dtype::from_name(&t.dtype))
            else {
                continue;
            };
            let width = Width::of_element(usize::try_from(dtype.bits() / 8).unwrap_or(1));
            for hash in blob.chunks() {
                widths.entry(hash.0).or_insert(width);
            }
        }
        widths
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
