//! Pack objects (bucket formats 3 and 4): a shard's or a push's new chunks
//! travel in pack objects of a target size
//! ([`DEFAULT_PACK_BYTES`](crate::DEFAULT_PACK_BYTES)), not one object per
//! chunk. A pack is its chunks' stored forms back to back (raw, or
//! compressed where that pays: format 4); it is named by the BLAKE3 hash of
//! its chunk list
//! ([`pack_name`](crate::remote::format::pack_format::pack_name)), so the
//! name is a function of the bytes and a rewrite puts the same bytes back.
//! The shard's manifest lists the packs it needs and an index (chunk ->
//! pack, offset, stored form); every chunk is still checked against its
//! own hash when read.
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
//!
//! Roles: `place` (which chunks go into which new pack, and a manifest's
//! pack list and index from where chunks lie: pure), `build` (a pack's
//! bytes from its chunks' stored forms, compressed on every core), and the
//! writer's upload and checks here.

mod build;
mod place;
#[cfg(test)]
mod tests;

use std::collections::HashMap;

use bytes::Bytes;

use crate::format::manifest::Hash;
use crate::remote::coordination::locks::Lock;
use crate::remote::format::manifest::{ManifestFormat, RemoteManifest};
use crate::remote::format::pack_format::{Location, PackIndex, RemotePack};
use crate::remote::format::stored::{Stored, Width};
use crate::remote::write::Writer;
use crate::{Error, Result};
use build::{build, compress_all};
pub(crate) use place::{format_of, index_of, place_pieces, NewPack};

/// Packs uploaded at once, each held in memory while it goes.
const PACKS_IN_FLIGHT: usize = 4;

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
