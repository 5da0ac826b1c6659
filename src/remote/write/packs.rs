//! Bucket format 3: a shard's new chunks travel in pack objects of a
//! target size ([`DEFAULT_PACK_BYTES`]), not one object per chunk. A pack
//! is its chunks' bytes back to back; it is named by the BLAKE3 hash of
//! its chunk list ([`pack_name`]), so the name is a function of the bytes
//! and a rewrite puts the same bytes back. The shard's manifest (format 3)
//! lists the packs it needs and an index (chunk -> pack, offset); every
//! chunk is still checked against its own hash when read.
//!
//! Deduplication asks the bucket nothing per chunk: a [`Remote`] remembers
//! where the chunks it wrote or read lie ([`Known`]), with the bucket's
//! collection mark at the time. A garbage collection writes a new mark
//! before it deletes anything, so a memory whose mark is still the
//! bucket's (read under the push lock, which no collection overlaps)
//! names only packs that are there.

use std::collections::HashMap;

use bytes::Bytes;

use crate::format::manifest::{hex, Hash};
use crate::remote::coordination::locks::Lock;
use crate::remote::format::layout::{parse_hex, RemoteManifest};
use crate::remote::format::pack_format::{pack_name, Location, PackIndex, RemotePack};
use crate::remote::Remote;
use crate::{Error, Result};

/// Packs uploaded at once, each held in memory while it goes.
const PACKS_IN_FLIGHT: usize = 4;

/// What a [`Remote`] knows is in its bucket: where chunks lie, while the
/// bucket's collection mark is `mark`.
#[derive(Debug, Default)]
pub(crate) struct Known {
    mark: Option<Vec<u8>>,
    at: HashMap<Hash, Location>,
}

impl Known {
    /// The memory, emptied if the bucket's mark is no longer `mark`.
    pub(crate) fn under(&mut self, mark: &[u8]) -> &mut HashMap<Hash, Location> {
        if self.mark.as_deref() != Some(mark) {
            self.at.clear();
            self.mark = Some(mark.to_vec());
        }
        &mut self.at
    }

    /// Forget every chunk of the packs `gone`.
    pub(crate) fn forget(&mut self, gone: &[Hash]) {
        self.at.retain(|_, loc| !gone.contains(&loc.pack));
    }
}

/// A pack to upload: its name and its chunks' bytes, in order (copied
/// when it is uploaded).
pub(crate) struct NewPack<'a> {
    pub(crate) name: Hash,
    pub(crate) parts: Vec<&'a [u8]>,
}

/// Where each of `pieces` new to `known` will lie: in the new packs
/// returned (filled to `target` bytes, in order), at the locations
/// returned (for `known` to learn once they landed).
pub(crate) fn place_pieces<'a>(
    pieces: &[(Hash, &'a [u8])],
    known: &HashMap<Hash, Location>,
    target: u64,
) -> (Vec<NewPack<'a>>, HashMap<Hash, Location>) {
    let (mut packs, mut placed) = (Vec::new(), HashMap::new());
    let mut open: Vec<(Hash, &[u8])> = Vec::new();
    let mut queued = std::collections::HashSet::new();
    let mut size = 0u64;
    for &(hash, bytes) in pieces {
        if known.contains_key(&hash) || !queued.insert(hash) {
            continue;
        }
        if size > 0 && size + bytes.len() as u64 > target {
            packs.push(close(&mut open, &mut placed));
            size = 0;
        }
        size += bytes.len() as u64;
        open.push((hash, bytes));
    }
    if !open.is_empty() {
        packs.push(close(&mut open, &mut placed));
    }
    (packs, placed)
}

/// The pack of the chunks `open` (emptied), whose locations `placed`
/// learns.
fn close<'a>(
    open: &mut Vec<(Hash, &'a [u8])>,
    placed: &mut HashMap<Hash, Location>,
) -> NewPack<'a> {
    let list: Vec<(Hash, u64)> = open.iter().map(|(h, b)| (*h, b.len() as u64)).collect();
    let name = pack_name(&list);
    let pack_len = list.iter().map(|(_, n)| n).sum();
    let mut at = 0;
    for (hash, n) in list {
        placed.insert(
            hash,
            Location {
                pack: name,
                pack_len,
                at,
            },
        );
        at += n;
    }
    let parts = open.drain(..).map(|(_, b)| b).collect();
    NewPack { name, parts }
}

/// The `packs` and `index` of a format 3 manifest naming `chunks`, from
/// where `locate` says they lie; `None` if it does not know one.
pub(crate) fn index_of(
    chunks: impl Iterator<Item = Hash>,
    locate: impl Fn(&Hash) -> Option<Location>,
) -> Option<(Vec<RemotePack>, PackIndex)> {
    let mut packs: Vec<RemotePack> = Vec::new();
    let mut number: HashMap<Hash, u32> = HashMap::new();
    let mut index = PackIndex::new();
    for chunk in chunks {
        let loc = locate(&chunk)?;
        let n = *number.entry(loc.pack).or_insert_with(|| {
            packs.push(RemotePack {
                hash: hex(&loc.pack),
                len: loc.pack_len,
            });
            u32::try_from(packs.len() - 1).unwrap_or(u32::MAX)
        });
        index.insert(hex(&chunk), (n, loc.at));
    }
    Some((packs, index))
}

/// A format 3 manifest's `packs` and `index`, and the bytes uploaded.
pub(crate) type Packed = (Vec<RemotePack>, PackIndex, u64);

impl Remote {
    /// Put `pieces` (a shard's chunks) in the bucket's packs under the
    /// push lock `lock`: those this remote knows are there stay where
    /// they are, the rest go into new packs; returns where they all lie.
    /// Nothing is asked of the bucket per chunk: its collection mark says
    /// whether what this remote knows still holds, and a lock that lapsed
    /// (a collection may have run) has the packs relied on checked.
    pub(crate) fn pack_pieces(&self, pieces: &[(Hash, &[u8])], lock: &mut Lock) -> Result<Packed> {
        let mark = self.collection_mark()?;
        let mut uploaded = 0;
        loop {
            let (new, placed) = {
                let mut known = self.known()?;
                place_pieces(pieces, known.under(&mark), self.pack_bytes)
            };
            self.upload_packs(new, &mut |n| {
                uploaded += n;
                self.refresh(lock)
            })?;
            let indexed = {
                let mut guard = self.known()?;
                let known = guard.under(&mark);
                known.extend(placed);
                index_of(pieces.iter().map(|(h, _)| *h), |h| known.get(h).copied())
            };
            let (packs, index) =
                indexed.ok_or_else(|| Error::corrupt(None, "a chunk placed in no pack"))?;
            if !self.reassert(lock)? {
                return Ok((packs, index, uploaded));
            }
            let named: Vec<Hash> = packs.iter().filter_map(|p| parse_hex(&p.hash)).collect();
            let gone = self.missing_packs(&named)?;
            if gone.is_empty() {
                return Ok((packs, index, uploaded));
            }
            self.known()?.forget(&gone);
        }
    }

    /// What this remote knows of its bucket's packs.
    pub(crate) fn known(&self) -> Result<std::sync::MutexGuard<'_, Known>> {
        self.known
            .lock()
            .map_err(|_| Error::corrupt(None, "a thread panicked while it held the pack memory"))
    }

    /// Learn where the chunks of `manifests` (of a complete step just
    /// opened, while the bucket's collection mark was `mark`) lie: a save
    /// after a load deduplicates against what it loaded.
    pub(crate) fn learn(&self, manifests: &[RemoteManifest], mark: &[u8]) -> Result<()> {
        let mut known = self.known()?;
        let known = known.under(mark);
        for m in manifests {
            known.extend(m.locations());
        }
        Ok(())
    }

    /// Upload `packs`, a few at a time, calling `landed` with each one's
    /// bytes as it lands.
    pub(crate) fn upload_packs(
        &self,
        packs: Vec<NewPack<'_>>,
        landed: &mut dyn FnMut(u64) -> Result<()>,
    ) -> Result<()> {
        use futures::{StreamExt, TryStreamExt};
        use object_store::{ObjectStoreExt, PutPayload};
        let (store, layout, url) = (&self.store, &self.layout, &self.url);
        let mut uploads = futures::stream::iter(packs)
            .map(|pack| async move {
                let key = layout.pack(&pack.name);
                let len: u64 = pack.parts.iter().map(|b| b.len() as u64).sum();
                // Copied only now: the packs in flight are in memory, not
                // the shard.
                let payload: PutPayload =
                    pack.parts.into_iter().map(Bytes::copy_from_slice).collect();
                store.put(&key, payload).await.map_err(|e| {
                    crate::remote::remote_error(url, &layout.url_of(url, &key), "uploading", e)
                })?;
                Ok::<u64, crate::Error>(len)
            })
            .buffer_unordered(PACKS_IN_FLIGHT);
        while let Some(len) = self.run(uploads.try_next())?? {
            landed(len)?;
        }
        Ok(())
    }

    /// Which of `packs` are missing from the bucket (a HEAD each).
    pub(crate) fn missing_packs(&self, packs: &[Hash]) -> Result<Vec<Hash>> {
        use futures::{StreamExt, TryStreamExt};
        use object_store::ObjectStoreExt;
        let (store, layout, url) = (&self.store, &self.layout, &self.url);
        self.run(async {
            futures::stream::iter(packs.iter().copied())
                .map(|pack| async move {
                    let key = layout.pack(&pack);
                    match store.head(&key).await {
                        Ok(_) => Ok(None),
                        Err(object_store::Error::NotFound { .. }) => Ok(Some(pack)),
                        Err(e) => Err(crate::remote::remote_error(
                            url,
                            &layout.url_of(url, &key),
                            "looking for",
                            e,
                        )),
                    }
                })
                .buffer_unordered(PACKS_IN_FLIGHT * 4)
                .try_filter_map(|gone| async move { Ok(gone) })
                .try_collect()
                .await
        })?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_fill_packs_to_the_target_and_known_chunks_stay_put() {
        let a = [1u8; 40];
        let b = [2u8; 40];
        let c = [3u8; 40];
        let h = |x: u8| [x; 32];
        let mut known = HashMap::new();
        let old = Location {
            pack: [9; 32],
            pack_len: 500,
            at: 100,
        };
        known.insert(h(2), old);
        let pieces = [
            (h(1), &a[..]),
            (h(2), &b[..]),
            (h(3), &c[..]),
            (h(1), &a[..]),
        ];
        let (packs, placed) = place_pieces(&pieces, &known, 64);
        // 1 and 3 are new; 40 + 40 > 64: a pack each.
        assert_eq!(packs.len(), 2);
        assert!(!placed.contains_key(&h(2)));
        assert_eq!(placed[&h(1)].pack, packs[0].name);
        assert_eq!((placed[&h(3)].pack, placed[&h(3)].at), (packs[1].name, 0));
        let (_, two) = place_pieces(&pieces, &known, 100);
        assert_eq!((two[&h(3)].pack, two[&h(3)].at), (two[&h(1)].pack, 40));
        known.extend(placed);
        let locate = |h: &Hash| known.get(h).copied();
        let (list, index) = index_of([h(1), h(2), h(3)].into_iter(), locate).expect("all known");
        assert_eq!(list.len(), 3);
        assert_eq!(index[&hex(&h(2))], (1, 100));
        assert!(index_of([h(4)].into_iter(), locate).is_none());
        // The name is the chunk list's: the same chunks, the same pack.
        assert_eq!(pack_name(&[(h(1), 40)]), packs[0].name);
        assert_ne!(pack_name(&[(h(1), 41)]), packs[0].name);
    }
}
