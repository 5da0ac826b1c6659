//! Bucket format 3: a shard's new chunks travel in pack objects of a target
//! size ([`DEFAULT_PACK_BYTES`](crate::DEFAULT_PACK_BYTES)), not one object per
//! chunk. A pack is its chunks' bytes back to back; it is named by the BLAKE3
//! hash of its chunk list ([`pack_name`]), so the name is a function of the
//! bytes and a rewrite puts the same bytes back. The shard's manifest (format
//! 3) lists the packs it needs and an index (chunk -> pack, offset); every
//! chunk is still checked against its own hash when read.
//!
//! Deduplication asks the bucket nothing per chunk: a [`Remote`](crate::Remote)
//! remembers where the chunks it wrote or read lie
//! ([`Known`](crate::remote::coordination::known::Known)), with the bucket's
//! collection mark at the time. A garbage collection writes a new mark before
//! it deletes anything, so a memory whose mark is still the bucket's (read
//! under the push lock, which no collection overlaps) names only packs that no
//! collection deleted. A pack can still be lost another way (deleted by hand,
//! a lifecycle rule, a damaged bucket), so a save relies only on packs this
//! remote uploaded or confirmed present and whole itself: any other pack it
//! would deduplicate against is checked once (a HEAD per pack, never per
//! chunk), and the chunks of one that is missing or of another length are
//! uploaded again from the caller's bytes.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;

use crate::format::manifest::Hash;
use crate::remote::coordination::locks::Lock;
use crate::remote::format::hash::HexHash;
use crate::remote::format::pack_format::{pack_name, Location, PackIndex, RemotePack};
use crate::remote::write::Writer;
use crate::{Error, Result};

/// Packs uploaded at once, each held in memory while it goes.
const PACKS_IN_FLIGHT: usize = 4;

/// A pack to upload: its name and its chunks, by their number in the
/// pieces it was placed from (read when it is uploaded).
pub(crate) struct NewPack {
    pub(crate) name: Hash,
    pub(crate) members: Vec<usize>,
}

/// Where each of `pieces` (hash, length) new to `known` will lie: in the
/// new packs returned (filled to `target` bytes, in order), at the
/// locations returned (for `known` to learn once they landed).
pub(crate) fn place_pieces(
    pieces: &[(Hash, u64)],
    known: &HashMap<Hash, Location>,
    target: u64,
) -> (Vec<NewPack>, HashMap<Hash, Location>) {
    let (mut packs, mut placed) = (Vec::new(), HashMap::new());
    let mut open: Vec<usize> = Vec::new();
    let mut queued = std::collections::HashSet::new();
    let mut size = 0u64;
    for (i, &(hash, len)) in pieces.iter().enumerate() {
        if known.contains_key(&hash) || !queued.insert(hash) {
            continue;
        }
        if size > 0 && size + len > target {
            packs.push(close(pieces, &mut open, &mut placed));
            size = 0;
        }
        size += len;
        open.push(i);
    }
    if !open.is_empty() {
        packs.push(close(pieces, &mut open, &mut placed));
    }
    (packs, placed)
}

/// The pack of the pieces numbered `open` (emptied), whose locations
/// `placed` learns.
fn close(
    pieces: &[(Hash, u64)],
    open: &mut Vec<usize>,
    placed: &mut HashMap<Hash, Location>,
) -> NewPack {
    let list: Vec<(Hash, u64)> = open.iter().map(|&i| pieces[i]).collect();
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
    NewPack {
        name,
        members: std::mem::take(open),
    }
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
        .map(|(chunk, l)| (HexHash(*chunk), (number[&l.pack], l.at)))
        .collect();
    Some((packs, index))
}

/// Where a writer's chunks lie: a format 3 manifest's `packs` and
/// `index`, and what was uploaded to get there.
pub(crate) struct Packed {
    pub(crate) packs: Vec<RemotePack>,
    pub(crate) index: PackIndex,
    pub(crate) bytes_uploaded: u64,
    pub(crate) chunks_uploaded: u64,
}

/// Reads piece number `i` of what is being packed.
pub(crate) type ReadPiece<'r> = dyn FnMut(usize) -> Result<Bytes> + 'r;

impl Writer<'_> {
    /// Put `pieces` (chunks: hash, length) in the bucket's packs under the push
    /// lock `lock`, the bucket's collection mark `mark` read under it: those
    /// this remote knows are there stay where they are, the rest go into new
    /// packs, each piece read by `read` when its pack is uploaded; returns
    /// where they all lie. `landed` gets the bytes of each pack as it lands
    /// (and may stop the upload). Nothing is asked of the bucket per chunk: its
    /// collection mark says whether what this remote knows still holds, and a
    /// lock that lapsed (a collection may have run) has the packs relied on
    /// checked, and the gone ones uploaded again.
    pub(crate) fn pack(
        &self,
        pieces: &[(Hash, u64)],
        read: &mut ReadPiece<'_>,
        mark: &[u8],
        lock: &mut Lock,
        landed: &mut dyn FnMut(u64) -> Result<()>,
    ) -> Result<Packed> {
        let (mut bytes_uploaded, mut chunks_uploaded) = (0, 0);
        self.confirm_packs(pieces, mark)?;
        loop {
            let (new, placed) = {
                let mut known = self.known()?;
                place_pieces(pieces, known.under(mark), self.pack_bytes)
            };
            chunks_uploaded += placed.len() as u64;
            let uploaded: Vec<Hash> = new.iter().map(|p| p.name).collect();
            self.upload_packs(new, read, &mut |n| {
                bytes_uploaded += n;
                landed(n)?;
                self.refresh(lock)
            })?;
            let indexed = {
                let mut guard = self.known()?;
                guard.confirm(mark, uploaded.into_iter());
                let known = guard.under(mark);
                known.extend(placed);
                index_of(pieces.iter().map(|(h, _)| *h), |h| known.get(h).copied())
            };
            let (packs, index) =
                indexed.ok_or_else(|| Error::corrupt(None, "a chunk placed in no pack"))?;
            let packed = |packs, index| Packed {
                packs,
                index,
                bytes_uploaded,
                chunks_uploaded,
            };
            if !self.reassert(lock)? {
                return Ok(packed(packs, index));
            }
            let named: Vec<(Hash, u64)> = packs.iter().map(|p| (p.hash.0, p.len)).collect();
            let gone = self.missing_packs(&named)?;
            if gone.is_empty() {
                return Ok(packed(packs, index));
            }
            self.known()?.forget(&gone);
        }
    }

    /// Check once (a HEAD each) the packs that chunks among `pieces` lie in
    /// by what this remote knows, but that it has not uploaded or confirmed
    /// itself: those present and whole are confirmed, the others forgotten
    /// (their chunks are then uploaded again).
    fn confirm_packs(&self, pieces: &[(Hash, u64)], mark: &[u8]) -> Result<()> {
        let unconfirmed = self
            .known()?
            .unconfirmed(mark, pieces.iter().map(|(h, _)| *h));
        if unconfirmed.is_empty() {
            return Ok(());
        }
        let gone = self.missing_packs(&unconfirmed)?;
        let mut known = self.known()?;
        if !gone.is_empty() {
            known.forget(&gone);
        }
        let whole = unconfirmed.into_iter().map(|(p, _)| p);
        known.confirm(mark, whole.filter(|p| !gone.contains(p)));
        Ok(())
    }

    /// Upload `packs`, a few at a time, each one's pieces read by `read`
    /// when an upload slot frees up (so the packs in flight are in memory,
    /// not what is packed), calling `landed` with each one's bytes as it
    /// lands.
    pub(crate) fn upload_packs(
        &self,
        packs: Vec<NewPack>,
        read: &mut ReadPiece<'_>,
        landed: &mut dyn FnMut(u64) -> Result<()>,
    ) -> Result<()> {
        use futures::{StreamExt, TryStreamExt};
        use object_store::PutPayload;
        let bucket = &self.bucket;
        let loaded = packs.into_iter().map(|pack| -> Result<(Hash, Vec<Bytes>)> {
            let parts = pack.members.iter().map(|&i| read(i));
            Ok((pack.name, parts.collect::<Result<_>>()?))
        });
        let mut uploads = futures::stream::iter(loaded)
            .map(|loaded| async move {
                let (name, parts) = loaded?;
                let key = bucket.layout.pack(&name);
                let len: u64 = parts.iter().map(|b| b.len() as u64).sum();
                let payload: PutPayload = parts.into_iter().collect();
                bucket.put_async(&key, payload, "uploading").await?;
                Ok::<u64, crate::Error>(len)
            })
            .buffer_unordered(PACKS_IN_FLIGHT);
        while let Some(len) = self.bucket.run(uploads.try_next())?? {
            landed(len)?;
        }
        Ok(())
    }

    /// Which of `packs` (name, length) are missing from the bucket or not
    /// of their length (a HEAD each).
    pub(crate) fn missing_packs(&self, packs: &[(Hash, u64)]) -> Result<Vec<Hash>> {
        use futures::{StreamExt, TryStreamExt};
        let bucket = &self.bucket;
        bucket.run(async {
            futures::stream::iter(packs.iter().copied())
                .map(|(pack, len)| async move {
                    let found = bucket.size_of(&bucket.layout.pack(&pack)).await?;
                    Ok::<_, crate::Error>((found != Some(len)).then_some(pack))
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
    fn pieces_fill_packs_to_the_target_and_known_chunks_stay_put(
    ) -> Result<(), std::num::TryFromIntError> {
        let (a, b, c) = ([1u8; 40], [2u8; 40], [3u8; 40]);
        let h = |x: u8| [x; 32];
        let mut known = HashMap::new();
        let old = Location {
            pack: [9; 32],
            pack_len: 500,
            at: 100,
        };
        known.insert(h(2), old);
        let pieces = [
            (h(1), a.len() as u64),
            (h(2), b.len() as u64),
            (h(3), c.len() as u64),
            (h(1), a.len() as u64),
        ];
        let (packs, placed) = place_pieces(&pieces, &known, 64);
        // 1 and 3 are new; 40 + 40 > 64: a pack each.
        assert_eq!(packs.len(), 2);
        assert_eq!(
            (&packs[0].members[..], &packs[1].members[..]),
            (&[0][..], &[2][..])
        );
        assert!(!placed.contains_key(&h(2)));
        assert_eq!(placed[&h(1)].pack, packs[0].name);
        assert_eq!((placed[&h(3)].pack, placed[&h(3)].at), (packs[1].name, 0));
        let (_, two) = place_pieces(&pieces, &known, 100);
        assert_eq!((two[&h(3)].pack, two[&h(3)].at), (two[&h(1)].pack, 40));
        known.extend(placed);
        let locate = |h: &Hash| known.get(h).copied();
        let (list, index) = index_of([h(1), h(2), h(3)].into_iter(), locate).expect("all known");
        assert_eq!(list.len(), 3);
        // Packs in order of name: the same locations, the same manifest.
        assert!(list.windows(2).all(|w| w[0].hash < w[1].hash));
        let old = list
            .iter()
            .position(|p| p.hash == HexHash([9; 32]))
            .expect("listed");
        assert_eq!(index[&HexHash(h(2))], (u32::try_from(old)?, 100));
        let again = index_of([h(3), h(2), h(1)].into_iter(), locate).expect("all known");
        assert_eq!(again, (list, index));
        assert!(index_of([h(4)].into_iter(), locate).is_none());
        // The name is the chunk list's: the same chunks, the same pack.
        assert_eq!(pack_name(&[(h(1), 40)]), packs[0].name);
        assert_ne!(pack_name(&[(h(1), 41)]), packs[0].name);
        Ok(())
    }
}
