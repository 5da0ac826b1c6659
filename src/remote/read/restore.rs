//! Restoring a step's data from the bucket: its chunks fetched in batches
//! (many downloads in flight), hash-checked, and handed out blob by blob:
//! into a checkpoint in memory (`get`), or into a store's streamed commit
//! while the next batch downloads (`pull`), holding at most a batch and a
//! blob in memory.

use std::collections::VecDeque;

use crate::remote::bucket::Fetched;
use crate::remote::read::Reader;
use futures::{StreamExt, TryStreamExt};

use crate::checkpoint::Incoming;
use crate::format::layout::packed_slice;
use crate::format::manifest::{hex, Hash};
use crate::remote::format::manifest::{RemoteBlob, RemoteManifest, RemotePlace, RemoteTensor};
use crate::remote::format::pack_format::Object;
use crate::remote::format::stored::{decompress, Stored};
use crate::{
    CheckpointStore, CommitInfo, Dtype, Entry, Error, GradientCheckpoint, Result, SaveRecord,
    Tensor,
};

/// Chunk downloads in flight at once: more than uploads, since a download
/// waits on the server rather than on this process.
const DOWNLOADS_IN_FLIGHT: usize = 16;

/// A batch of downloads ends once it holds this many bytes (or at the end
/// of the blob that crosses it).
const BATCH_BYTES: u64 = 64 << 20;

/// Chunks next to each other in a pack are fetched with one ranged GET of
/// at most this many bytes (a chunk alone may be larger).
const RANGE_BYTES: usize = 16 << 20;

/// Bytes to fetch from the bucket and check: object `object` whole (a
/// chunk), or (`at`) the bytes of a chunk from an offset (a chunk in a
/// pack, a blob's tail in a packed chunk), `stored` saying what is stored
/// of it there; what they decode to must be `len` bytes hashing to
/// `hash`. `what` names them in errors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Want<'a> {
    pub(crate) what: &'a str,
    pub(crate) object: Object,
    pub(crate) at: Option<u64>,
    pub(crate) len: usize,
    pub(crate) hash: Hash,
    pub(crate) stored: Stored,
}

impl Want<'_> {
    /// The bytes its object holds of it.
    pub(crate) fn stored_len(&self) -> u64 {
        self.stored.len(self.len as u64)
    }

    /// What it is, without its name: what [`decoded`] needs.
    pub(crate) fn identity(&self) -> (Hash, usize, Stored) {
        (self.hash, self.len, self.stored)
    }
}

/// The bytes of chunk `hash` of `len` bytes from what its object holds of
/// them (`bytes`, stored as `stored` says), checked against its length
/// and hash; None if they are not its bytes.
pub(crate) fn decoded(
    (hash, len, stored): (Hash, usize, Stored),
    bytes: bytes::Bytes,
) -> Option<bytes::Bytes> {
    let raw = match stored {
        Stored::Raw => bytes,
        Stored::Zstd { width, .. } => decompress(&bytes, width, len).ok()?.into(),
    };
    let ok = raw.len() == len && *blake3::hash(&raw).as_bytes() == hash;
    ok.then_some(raw)
}

impl<'a> Want<'a> {
    /// Chunk `hash` of `len` bytes, where `m` says it lies.
    pub(crate) fn chunk(what: &'a str, m: &RemoteManifest, hash: Hash, len: usize) -> Result<Self> {
        let (object, at, stored) = m.locate(&hash).ok_or_else(|| {
            Error::corrupt(
                Some(m.step),
                format!("{what}: chunk {} is in no pack of the manifest", hex(&hash)),
            )
        })?;
        Ok(Want {
            what,
            object,
            at,
            len,
            hash,
            stored,
        })
    }
}

/// A step's blobs, in name order, read batch by batch.
pub(crate) struct Blobs<'r> {
    remote: Reader<'r>,
    step: u64,
    /// The manifest's blobs are `pending`; this says where chunks lie.
    locator: RemoteManifest,
    pending: std::vec::IntoIter<(String, RemoteBlob)>,
    packed: Vec<u8>,
    ready: VecDeque<(String, RemoteBlob, Vec<u8>)>,
}

impl<'r> Blobs<'r> {
    /// The blobs of `m`; its packed chunk is fetched now.
    pub(crate) fn of(
        remote: Reader<'r>,
        m: &RemoteManifest,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Self> {
        let step = m.step;
        let packed = remote.fetch_packed(m, progress)?;
        let blobs: Vec<(String, RemoteBlob)> = m
            .blobs
            .iter()
            .map(|(n, b)| (n.clone(), b.clone()))
            .collect();
        let locator = m.locator();
        Ok(Blobs {
            remote,
            step,
            locator,
            pending: blobs.into_iter(),
            packed,
            ready: VecDeque::new(),
        })
    }

    /// The next blob with its bytes, checked against its length.
    pub(crate) fn next_blob(
        &mut self,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Option<(String, RemoteBlob, Vec<u8>)>> {
        if self.ready.is_empty() {
            self.fetch_batch(progress)?;
        }
        Ok(self.ready.pop_front())
    }

    /// Fetch the chunks of the next blobs, about [`BATCH_BYTES`] of them.
    fn fetch_batch(&mut self, progress: &mut dyn FnMut(u64)) -> Result<()> {
        let step = self.step;
        let corrupt = |detail: String| Error::corrupt(Some(step), detail);
        let mut batch = Vec::new();
        let mut bytes = 0;
        for (name, blob) in self.pending.by_ref() {
            if let RemotePlace::Chunks { .. } = blob.place {
                bytes += blob.len;
            }
            batch.push((name, blob));
            if bytes >= BATCH_BYTES {
                break;
            }
        }
        let mut wanted: Vec<Want<'_>> = Vec::new();
        for (name, blob) in &batch {
            wanted.extend(blob_chunks(&self.locator, name, blob)?);
        }
        let mut pieces = self.remote.fetch(step, &wanted, progress)?.into_iter();
        drop(wanted);
        for (name, blob) in batch {
            let data = match &blob.place {
                RemotePlace::Chunks { hashes, .. } => {
                    // Sized by what arrived (each piece checked against its
                    // hash and length), not by what the manifest claims.
                    let got: Vec<_> = pieces.by_ref().take(hashes.len()).collect();
                    let mut data = Vec::with_capacity(got.iter().map(bytes::Bytes::len).sum());
                    for piece in got {
                        data.extend_from_slice(&piece);
                    }
                    data.extend_from_slice(tail(step, &name, &blob, &self.packed)?);
                    data
                }
                RemotePlace::Packed { offset } => packed_slice(&self.packed, *offset, blob.len)
                    .ok_or_else(|| corrupt(format!("blob {name:?} is outside the packed bytes")))?
                    .to_vec(),
            };
            if data.len() as u64 != blob.len {
                return Err(corrupt(format!("blob {name:?} has the wrong length")));
            }
            self.ready.push_back((name, blob, data));
        }
        Ok(())
    }
}

impl Reader<'_> {
    /// The packed chunk of `m` (checked), empty if it has none.
    pub(crate) fn fetch_packed(
        &self,
        m: &RemoteManifest,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Vec<u8>> {
        let Some(want) = packed_want(m)? else {
            return Ok(Vec::new());
        };
        let mut got = self.fetch(m.step, &[want], progress)?;
        Ok(got.pop().map(|b| b.to_vec()).unwrap_or_default())
    }

    /// The chunks `wanted` (each with the blob it belongs to, for errors,
    /// and its length), fetched several at a time and checked against
    /// their hash and length, in order; `progress` gets each one's length
    /// as it arrives.
    pub(crate) fn fetch(
        &self,
        step: u64,
        wanted: &[Want<'_>],
        progress: &mut dyn FnMut(u64),
    ) -> Result<Vec<bytes::Bytes>> {
        let mut pieces = vec![bytes::Bytes::new(); wanted.len()];
        self.fetch_each(step, wanted, &mut |i, piece| {
            progress(piece.len() as u64);
            pieces[i] = piece;
            Ok(())
        })?;
        Ok(pieces)
    }

    /// [`fetch`](Self::fetch), handing each checked chunk to `each` (with
    /// its index in `wanted`) as it arrives, so that the caller can place
    /// it and let it go: at most the downloads in flight are in memory.
    /// Chunks that lie together in a pack arrive together, in the pack's
    /// order.
    pub(crate) fn fetch_each(
        &self,
        step: u64,
        wanted: &[Want<'_>],
        each: &mut dyn FnMut(usize, bytes::Bytes) -> Result<()>,
    ) -> Result<()> {
        let mut fetches = futures::stream::iter(coalesce(wanted))
            .map(|group| self.fetch_group(step, wanted, group))
            .buffered(DOWNLOADS_IN_FLIGHT);
        // `each` runs outside the runtime, free to block.
        while let Some(pieces) = self.bucket.run(fetches.try_next())?? {
            for (i, piece) in pieces {
                each(i, piece)?;
            }
        }
        Ok(())
    }

    /// The wants of `wanted` at `group` (one, or neighbours in one pack)
    /// fetched with one request, each checked against its length and
    /// hash: (index, bytes).
    async fn fetch_group(
        &self,
        step: u64,
        wanted: &[Want<'_>],
        group: Vec<usize>,
    ) -> Result<Vec<(usize, bytes::Bytes)>> {
        let first = wanted[group[0]];
        let key = self.bucket.layout.object(&first.object);
        let url = || self.bucket.layout.url_of(&self.bucket.url, &key);
        let corrupt = |detail: String| Error::corrupt(Some(step), detail);
        let end = group.iter().map(|&i| end_of(&wanted[i])).max().unwrap_or(0);
        let from = first.at.unwrap_or(0);
        let span_len = usize::try_from(end - from).unwrap_or(usize::MAX);
        let whole = match self.bucket.get_span(&key, first.at, span_len).await? {
            Fetched::Bytes(bytes) => bytes,
            Fetched::Short { size } => {
                let needed = from + span_len as u64;
                return Err(corrupt(format!(
                    "{}: {} is {} bytes short: it holds {size} bytes, chunk {} needs bytes \
                     {from}..{needed}",
                    first.what,
                    url(),
                    needed.saturating_sub(size),
                    hex(&first.hash)
                )));
            }
            Fetched::Missing => {
                return Err(corrupt(format!(
                    "{}: {} is missing (chunk {})",
                    first.what,
                    url(),
                    hex(&first.hash)
                )))
            }
        };
        let wants: Vec<((Hash, usize, Stored), u64, u64)> = group
            .iter()
            .map(|&i| {
                let w = &wanted[i];
                (w.identity(), w.at.unwrap_or(0) - from, w.stored_len())
            })
            .collect();
        // Decoded and hashed on the blocking pool: the downloads in flight
        // are checked on every core, not on the runtime's one thread.
        let checked = tokio::task::spawn_blocking(move || {
            wants
                .into_iter()
                .map(|(chunk, at, n)| {
                    let at = usize::try_from(at).ok()?;
                    let n = usize::try_from(n).ok()?;
                    // Within the span (`get_span` returns all of it or
                    // `Short`); checked all the same, never a panic.
                    let end = at.checked_add(n)?;
                    let piece = (end <= whole.len()).then(|| whole.slice(at..end))?;
                    Some(decoded(chunk, piece).ok_or(chunk.0))
                })
                .collect::<Option<Vec<_>>>()
        })
        .await
        .map_err(|e| corrupt(format!("{}: checking chunks failed: {e}", first.what)))?
        .ok_or_else(|| corrupt(format!("{}: a chunk outside {}", first.what, url())))?;
        checked
            .into_iter()
            .zip(group)
            .map(|(piece, i)| {
                let piece = piece.map_err(|hash| {
                    corrupt(format!(
                        "{}: chunk {} in {} fails its hash check",
                        wanted[i].what,
                        hex(&hash),
                        url()
                    ))
                })?;
                Ok((i, piece))
            })
            .collect()
    }

    /// Fetch every chunk `m` names and build the step in memory.
    pub(crate) fn assemble(
        &self,
        m: RemoteManifest,
        progress: &mut dyn FnMut(u64),
    ) -> Result<GradientCheckpoint> {
        let mut blobs = Blobs::of(*self, &m, progress)?;
        let mut ckpt = skeleton(m)?;
        while let Some((name, blob, data)) = blobs.next_blob(progress)? {
            match incoming(ckpt.step, name, &blob)? {
                Incoming {
                    name,
                    tensor: Some((dtype, shape)),
                    ..
                } => ckpt.set_entry(name, Entry::Tensor(Tensor::new(dtype, shape, data)?)),
                Incoming { name, .. } => ckpt.set_entry(name, Entry::Blob(data)),
            }
        }
        Ok(ckpt)
    }

    /// Copy `m`'s step into `store`: one streamed commit there, fed blob by
    /// blob while a second thread downloads the next batch.
    pub(crate) fn restore_into(
        &self,
        m: RemoteManifest,
        store: &CheckpointStore,
        progress: &mut dyn FnMut(u64),
    ) -> Result<CommitInfo> {
        let step = m.step;
        let entries: Vec<Incoming> = m
            .blobs
            .iter()
            .map(|(name, blob)| incoming(step, name.clone(), blob))
            .collect::<Result<_>>()?;
        let mut blobs = Blobs::of(*self, &m, progress)?;
        let ckpt = skeleton(m)?;
        std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<Result<(Vec<u8>, u64)>>(1);
            s.spawn(move || {
                let mut landed = 0;
                loop {
                    let next = blobs.next_blob(&mut |n| landed += n);
                    let item = match next {
                        Ok(Some((_, _, data))) => Ok((data, std::mem::take(&mut landed))),
                        Ok(None) => break,
                        Err(e) => Err(e),
                    };
                    let failed = item.is_err();
                    if tx.send(item).is_err() || failed {
                        break;
                    }
                }
            });
            let mut read = |_: &Incoming| -> Result<Vec<u8>> {
                let (data, landed) = rx.recv().map_err(|_| {
                    Error::corrupt(Some(step), "the download ended before the step's last blob")
                })??;
                progress(landed);
                Ok(data)
            };
            let committed = store.commit_streamed(ckpt, &entries, &mut read);
            drop(rx); // the downloader stops at its next send
            committed
        })
    }
}

/// `wanted` (by index) in groups fetched with one request each: wants in
/// one pack whose ranges meet or overlap, in the pack's order, up to
/// [`RANGE_BYTES`] a group; any other want alone.
fn coalesce(wanted: &[Want<'_>]) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..wanted.len()).collect();
    order.sort_by_key(|&i| (wanted[i].object, wanted[i].at));
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut span = (0u64, 0u64);
    for i in order {
        let w = &wanted[i];
        let joins = groups.last().is_some_and(|g| {
            let head = &wanted[g[0]];
            matches!(w.object, Object::Pack(_))
                && w.object == head.object
                && w.at.is_some_and(|at| at <= span.1)
                && end_of(w).max(span.1) - span.0 <= RANGE_BYTES as u64
        });
        if joins {
            span.1 = span.1.max(end_of(w));
            if let Some(g) = groups.last_mut() {
                g.push(i);
            }
        } else {
            span = (w.at.unwrap_or(0), end_of(w));
            groups.push(vec![i]);
        }
    }
    groups
}

/// Where the bytes `w` wants end in its object.
fn end_of(w: &Want<'_>) -> u64 {
    w.at.unwrap_or(0).saturating_add(w.stored_len())
}

/// The checkpoint `m` describes, without its blobs and tensors.
pub(crate) fn skeleton(m: RemoteManifest) -> Result<GradientCheckpoint> {
    let graph = serde_json::from_value(m.graph).map_err(|e| Error::Json {
        path: None,
        source: Box::new(e),
    })?;
    let mut ckpt = GradientCheckpoint::new(graph, m.step);
    ckpt.timestamp = m.timestamp;
    ckpt.loss_cid = m.loss_cid;
    ckpt.metrics = m.metrics;
    ckpt.save_record = if m.save_record.is_empty() {
        SaveRecord::from_legacy_metrics(&mut ckpt.metrics, |n| m.blobs.contains_key(n))
    } else {
        *m.save_record
    };
    Ok(ckpt)
}

/// Blob `name` as a commit takes it: its length, dtype and shape.
pub(crate) fn incoming(step: u64, name: String, blob: &RemoteBlob) -> Result<Incoming> {
    let tensor = match &blob.tensor {
        Some(RemoteTensor { dtype, shape }) => {
            let dtype = Dtype::from_name(dtype).ok_or_else(|| {
                Error::corrupt(
                    Some(step),
                    format!("tensor {name:?}: unknown dtype {dtype}"),
                )
            })?;
            Some((dtype, shape.clone()))
        }
        None => None,
    };
    Ok(Incoming {
        name,
        len: blob.len,
        tensor,
    })
}

/// The chunks of a chunked blob (checked by `RemoteManifest::check`), each
/// named by the blob's name.
pub(crate) fn blob_chunks<'a>(
    m: &RemoteManifest,
    name: &'a str,
    blob: &RemoteBlob,
) -> Result<Vec<Want<'a>>> {
    blob.chunks()
        .iter()
        .zip(blob.chunk_lengths())
        .map(|(h, n)| Want::chunk(name, m, h.0, n))
        .collect()
}

/// Blob `name`'s tail in `packed` (format 2), checked against its hash;
/// empty for a blob without one.
pub(crate) fn tail<'p>(
    step: u64,
    name: &str,
    blob: &RemoteBlob,
    packed: &'p [u8],
) -> Result<&'p [u8]> {
    let (Some((at, len)), Some(t)) = (blob.tail_bytes(), blob.tail()) else {
        return Ok(&[]);
    };
    let want = t.hash.0;
    packed_slice(packed, at, len)
        .filter(|bytes| *blake3::hash(bytes).as_bytes() == want)
        .ok_or_else(|| {
            Error::corrupt(
                Some(step),
                format!("blob {name:?}: its tail in the packed bytes fails its hash check"),
            )
        })
}

/// What to fetch for `m`'s packed chunk (all of it), if it has one.
pub(crate) fn packed_want(m: &RemoteManifest) -> Result<Option<Want<'static>>> {
    let Some(p) = &m.packed else {
        return Ok(None);
    };
    let hash = p.hash.0;
    let len = usize::try_from(p.len).unwrap_or(usize::MAX);
    Want::chunk("packed blobs", m, hash, len).map(Some)
}
