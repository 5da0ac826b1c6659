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
use crate::remote::format::manifest::{ManifestFormat, RemoteManifest};
use crate::remote::format::pack_format::{pack_name, IndexEntry, Location, PackIndex, RemotePack};
use crate::remote::format::stored::{self, Stored, Width};
use crate::remote::write::Writer;
use crate::{Error, Result};

/// Packs uploaded at once, each held in memory while it goes.
const PACKS_IN_FLIGHT: usize = 4;

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

/// A pack built from its chunks' stored forms: its name, its bytes (in
/// parts) and where each chunk lies in it.
struct Built {
    name: Hash,
    parts: Vec<Bytes>,
    placed: Vec<(Hash, Location)>,
}

/// The pack of `chunks` (hash, raw length) stored as `stored` says.
fn build(chunks: &[(Hash, u64)], stored: Vec<(Bytes, Stored)>) -> Built {
    let list: Vec<(Hash, u64, Stored)> = chunks
        .iter()
        .zip(&stored)
        .map(|(&(hash, len), (_, form))| (hash, len, *form))
        .collect();
    let name = pack_name(&list);
    let pack_len = stored.iter().map(|(b, _)| b.len() as u64).sum();
    let mut at = 0;
    let mut placed = Vec::with_capacity(list.len());
    for (hash, len, form) in list {
        placed.push((
            hash,
            Location {
                pack: name,
                pack_len,
                at,
                stored: form,
            },
        ));
        at += form.len(len);
    }
    Built {
        name,
        parts: stored.into_iter().map(|(b, _)| b).collect(),
        placed,
    }
}

/// Each of `parts` in its stored form: compressed at its width where it
/// has one and that saves enough (`stored::compress`), else raw. Runs on
/// every core.
fn compress_all(parts: Vec<Bytes>, widths: &[Option<Width>]) -> Vec<(Bytes, Stored)> {
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut out: Vec<Option<(Bytes, Stored)>> = vec![None; parts.len()];
    let done = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads.min(parts.len()) {
            scope.spawn(|| {
                let Ok(mut zstd) = zstd::bulk::Compressor::new(stored::LEVEL) else {
                    return;
                };
                let mut mine = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(raw) = parts.get(i) else { break };
                    let Some(width) = widths.get(i).copied().flatten() else {
                        continue;
                    };
                    if let Some(small) = stored::compress(raw, width, &mut zstd) {
                        let len = small.len() as u64;
                        mine.push((i, Bytes::from(small), Stored::Zstd { len, width }));
                    }
                }
                if let Ok(mut done) = done.lock() {
                    done.extend(mine);
                }
            });
        }
    });
    for (i, small, form) in done.into_inner().unwrap_or_default() {
        out[i] = Some((small, form));
    }
    // A chunk no thread compressed (or that did not shrink) goes raw.
    out.into_iter()
        .zip(parts)
        .map(|(small, raw)| small.unwrap_or((raw, Stored::Raw)))
        .collect()
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

/// Where a writer's chunks lie: a manifest's `format` (3, or 4 where a
/// chunk it names is stored compressed), `packs` and `index`, and what was
/// uploaded to get there (`bytes_uploaded` as sent, `raw_bytes_uploaded`
/// as the chunks' own lengths).
pub(crate) struct Packed {
    pub(crate) format: ManifestFormat,
    pub(crate) packs: Vec<RemotePack>,
    pub(crate) index: PackIndex,
    pub(crate) bytes_uploaded: u64,
    pub(crate) raw_bytes_uploaded: u64,
    pub(crate) chunks_uploaded: u64,
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

/// Reads piece number `i` of what is being packed.
pub(crate) type ReadPiece<'r> = dyn FnMut(usize) -> Result<Bytes> + 'r;

/// The width of the elements of each chunk that is part of a tensor
/// (`RemoteManifest::chunk_widths`), by which it is split into byte planes
/// where it is compressed; any other chunk is cut as bytes.
pub(crate) type Widths = HashMap<Hash, Width>;

fn width_of(widths: &Widths, hash: &Hash) -> Width {
    widths.get(hash).copied().unwrap_or(Width::One)
}

impl Writer<'_> {
    /// The element widths of the chunks of `manifests`' tensors where this
    /// writer compresses (none where it does not: nothing reads them).
    pub(crate) fn widths<'m>(
        &self,
        manifests: impl IntoIterator<Item = &'m RemoteManifest>,
    ) -> Widths {
        if !self.compress {
            return Widths::new();
        }
        manifests
            .into_iter()
            .flat_map(RemoteManifest::chunk_widths)
            .collect()
    }

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
        widths: &Widths,
        read: &mut ReadPiece<'_>,
        mark: &[u8],
        lock: &mut Lock,
        landed: &mut dyn FnMut(u64) -> Result<()>,
    ) -> Result<Packed> {
        let (mut bytes_uploaded, mut raw_bytes_uploaded, mut chunks_uploaded) = (0, 0, 0);
        self.confirm_packs(pieces, mark)?;
        loop {
            let new = {
                let mut known = self.known()?;
                let known = known.under(mark);
                // A writer that does not compress keeps its steps readable
                // by 0.4 (format 3): it relies on raw chunks only, and
                // uploads raw a chunk it knows only compressed.
                let usable = |h: &Hash| {
                    known
                        .get(h)
                        .is_some_and(|l| self.compress || l.stored == Stored::Raw)
                };
                place_pieces(pieces, usable, self.pack_bytes)
            };
            let form = |h: &Hash| self.compress.then(|| width_of(widths, h));
            let placed = self.upload_packs(pieces, new, &form, read, &mut |n| {
                bytes_uploaded += n;
                landed(n)?;
                self.refresh(lock)
            })?;
            chunks_uploaded += placed.len() as u64;
            raw_bytes_uploaded += placed.iter().map(|(_, n, _)| n).sum::<u64>();
            let indexed = {
                let mut guard = self.known()?;
                guard.confirm(mark, placed.iter().map(|(_, _, l)| l.pack));
                let known = guard.under(mark);
                known.extend(placed.into_iter().map(|(h, _, l)| (h, l)));
                index_of(pieces.iter().map(|(h, _)| *h), |h| known.get(h).copied())
            };
            let (packs, index) =
                indexed.ok_or_else(|| Error::corrupt(None, "a chunk placed in no pack"))?;
            let packed = |packs, index| Packed {
                format: format_of(&index),
                packs,
                index,
                bytes_uploaded,
                raw_bytes_uploaded,
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

    /// Upload `packs` (of `pieces`: hash, raw length), a few at a time,
    /// each one's pieces read by `read` when an upload slot frees up (so
    /// the packs in flight are in memory, not what is packed) and the
    /// chunks `form` gives a width compressed at it on the blocking pool
    /// (on every core, beside the uploads; the others raw), calling
    /// `landed` with each pack's bytes as it lands; each chunk uploaded,
    /// with its raw length and where it lies now.
    pub(crate) fn upload_packs(
        &self,
        pieces: &[(Hash, u64)],
        packs: Vec<NewPack>,
        form: &dyn Fn(&Hash) -> Option<Width>,
        read: &mut ReadPiece<'_>,
        landed: &mut dyn FnMut(u64) -> Result<()>,
    ) -> Result<Vec<(Hash, u64, Location)>> {
        use futures::{StreamExt, TryStreamExt};
        use object_store::PutPayload;
        let bucket = &self.bucket;
        let loaded = packs.into_iter().map(|pack| -> Result<_> {
            let chunks: Vec<(Hash, u64)> = pack.members.iter().map(|&i| pieces[i]).collect();
            let widths: Vec<Option<Width>> = chunks.iter().map(|(h, _)| form(h)).collect();
            let parts = pack.members.iter().map(|&i| read(i));
            Ok((chunks, widths, parts.collect::<Result<Vec<Bytes>>>()?))
        });
        let mut uploads = futures::stream::iter(loaded)
            .map(|loaded| async move {
                let (chunks, w, parts) = loaded?;
                let stored = if w.iter().any(Option::is_some) {
                    tokio::task::spawn_blocking(move || compress_all(parts, &w))
                        .await
                        .map_err(|e| {
                            Error::corrupt(None, format!("compressing a pack failed: {e}"))
                        })?
                } else {
                    parts.into_iter().map(|b| (b, Stored::Raw)).collect()
                };
                let built = build(&chunks, stored);
                let key = bucket.layout.pack(&built.name);
                let len: u64 = built.parts.iter().map(|b| b.len() as u64).sum();
                let payload: PutPayload = built.parts.iter().cloned().collect();
                bucket.put_async(&key, payload, "uploading").await?;
                let raw: HashMap<Hash, u64> = chunks.into_iter().collect();
                let placed: Vec<(Hash, u64, Location)> = built
                    .placed
                    .into_iter()
                    .map(|(h, l)| (h, raw[&h], l))
                    .collect();
                Ok::<_, crate::Error>((len, placed))
            })
            .buffer_unordered(PACKS_IN_FLIGHT);
        let mut all = Vec::new();
        while let Some((len, placed)) = self.bucket.run(uploads.try_next())?? {
            landed(len)?;
            all.extend(placed);
        }
        Ok(all)
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
}
