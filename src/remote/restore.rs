//! Restoring a step's data from the bucket: its chunks fetched in batches
//! (many downloads in flight), hash-checked, and handed out blob by blob:
//! into a checkpoint in memory (`get`), or into a store's streamed commit
//! while the next batch downloads (`pull`), holding at most a batch and a
//! blob in memory.

use std::collections::VecDeque;

use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;

use super::layout::{parse_hex, RemoteBlob, RemoteManifest};
use super::Remote;
use crate::checkpoint::Incoming;
use crate::format::layout::packed_slice;
use crate::format::manifest::{hex, Hash};
use crate::{CheckpointStore, CommitInfo, Dtype, Error, GradientCheckpoint, Result, Tensor};

/// Chunk downloads in flight at once: more than uploads, since a download
/// waits on the server rather than on this process.
const DOWNLOADS_IN_FLIGHT: usize = 16;

/// A batch of downloads ends once it holds this many bytes (or at the end
/// of the blob that crosses it).
const BATCH_BYTES: u64 = 32 << 20;

/// Bytes to fetch from the bucket and check: chunk `object` whole, or
/// (`at`) `len` of its bytes from an offset (a blob's tail in a packed
/// chunk); what arrives must be `len` bytes hashing to `hash`. `what`
/// names them in errors.
#[derive(Clone, Copy, Debug)]
pub(super) struct Want<'a> {
    pub(super) what: &'a str,
    pub(super) object: Hash,
    pub(super) at: Option<u64>,
    pub(super) len: usize,
    pub(super) hash: Hash,
}

impl<'a> Want<'a> {
    /// All of chunk `hash`, of `len` bytes.
    pub(super) fn chunk(what: &'a str, hash: Hash, len: usize) -> Self {
        Want {
            what,
            object: hash,
            at: None,
            len,
            hash,
        }
    }
}

/// A step's blobs, in name order, read batch by batch.
pub(super) struct Blobs<'r> {
    remote: &'r Remote,
    step: u64,
    pending: std::vec::IntoIter<(String, RemoteBlob)>,
    packed: Vec<u8>,
    ready: VecDeque<(String, RemoteBlob, Vec<u8>)>,
}

impl<'r> Blobs<'r> {
    /// The blobs of `m`; its packed chunk is fetched now.
    pub(super) fn of(
        remote: &'r Remote,
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
        Ok(Blobs {
            remote,
            step,
            pending: blobs.into_iter(),
            packed,
            ready: VecDeque::new(),
        })
    }

    /// The next blob with its bytes, checked against its length.
    pub(super) fn next_blob(
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
            bytes += blob.chunks.as_ref().map_or(0, |_| blob.len);
            batch.push((name, blob));
            if bytes >= BATCH_BYTES {
                break;
            }
        }
        let mut wanted: Vec<Want<'_>> = Vec::new();
        for (name, blob) in &batch {
            wanted.extend(blob_chunks(step, name, blob)?);
        }
        let mut pieces = self.remote.fetch(step, &wanted, progress)?.into_iter();
        drop(wanted);
        for (name, blob) in batch {
            let data = match (&blob.chunks, blob.offset) {
                (Some(hashes), None) => {
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
                (None, Some(offset)) => packed_slice(&self.packed, offset, blob.len)
                    .ok_or_else(|| corrupt(format!("blob {name:?} is outside the packed bytes")))?
                    .to_vec(),
                _ => return Err(corrupt(format!("blob {name:?} has no place"))),
            };
            if data.len() as u64 != blob.len {
                return Err(corrupt(format!("blob {name:?} has the wrong length")));
            }
            self.ready.push_back((name, blob, data));
        }
        Ok(())
    }
}

impl Remote {
    /// The packed chunk of `m` (checked), empty if it has none.
    pub(super) fn fetch_packed(
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
    pub(super) fn fetch(
        &self,
        step: u64,
        wanted: &[Want<'_>],
        progress: &mut dyn FnMut(u64),
    ) -> Result<Vec<bytes::Bytes>> {
        let mut pieces = Vec::with_capacity(wanted.len());
        self.fetch_each(step, wanted, &mut |_, piece| {
            progress(piece.len() as u64);
            pieces.push(piece);
            Ok(())
        })?;
        Ok(pieces)
    }

    /// [`fetch`](Self::fetch), handing each checked chunk to `each` (with
    /// its index in `wanted`) as it arrives, in order, so that the caller
    /// can place it and let it go: at most the downloads in flight are in
    /// memory.
    pub(super) fn fetch_each(
        &self,
        step: u64,
        wanted: &[Want<'_>],
        each: &mut dyn FnMut(usize, bytes::Bytes) -> Result<()>,
    ) -> Result<()> {
        let (store, layout, url) = (&self.store, &self.layout, &self.url);
        let corrupt = |detail: String| Error::corrupt(Some(step), detail);
        let mut fetches = futures::stream::iter(wanted)
            .map(|want| async move {
                let (what, object, n) = (want.what, want.object, want.len);
                let damaged = || {
                    corrupt(format!(
                        "{what}: chunk {} in {url} fails its hash check",
                        hex(&object)
                    ))
                };
                let got = match get_wanted(store.as_ref(), &layout.chunk(&object), want).await {
                    Ok(None) => return Err(damaged()),
                    Ok(Some(bytes)) => Ok(bytes),
                    Err(e) => Err(e),
                };
                let piece = got.map_err(|e| match e {
                    object_store::Error::NotFound { .. } => corrupt(format!(
                        "{what}: chunk {} is missing from {url}",
                        hex(&object)
                    )),
                    e => super::remote_error(
                        &layout.url_of(url, &layout.chunk(&object)),
                        "reading",
                        e,
                    ),
                })?;
                // Hashed on the blocking pool: the downloads in flight are
                // checked on every core, not on the runtime's one thread.
                let want = want.hash;
                let checked = tokio::task::spawn_blocking(move || {
                    let whole = piece.len() == n && *blake3::hash(&piece).as_bytes() == want;
                    whole.then_some(piece)
                })
                .await
                .map_err(|e| {
                    corrupt(format!(
                        "{what}: checking chunk {} failed: {e}",
                        hex(&object)
                    ))
                })?;
                checked.ok_or_else(damaged)
            })
            .buffered(DOWNLOADS_IN_FLIGHT);
        // `each` runs outside the runtime, free to block.
        let mut i = 0;
        while let Some(piece) = self.run(fetches.try_next())?? {
            each(i, piece)?;
            i += 1;
        }
        Ok(())
    }

    /// Fetch every chunk `m` names and build the step in memory.
    pub(super) fn assemble(
        &self,
        m: RemoteManifest,
        progress: &mut dyn FnMut(u64),
    ) -> Result<GradientCheckpoint> {
        let mut blobs = Blobs::of(self, &m, progress)?;
        let mut ckpt = skeleton(m)?;
        while let Some((name, blob, data)) = blobs.next_blob(progress)? {
            match incoming(ckpt.step, name, &blob)? {
                Incoming {
                    name,
                    tensor: Some((dtype, shape)),
                    ..
                } => ckpt.set_tensor(name, Tensor::new(dtype, shape, data)?),
                Incoming { name, .. } => ckpt.set_optimizer_state(name, data),
            }
        }
        Ok(ckpt)
    }

    /// Copy `m`'s step into `store`: one streamed commit there, fed blob by
    /// blob while a second thread downloads the next batch.
    pub(super) fn restore_into(
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
        let mut blobs = Blobs::of(self, &m, progress)?;
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

/// The bytes `want` names from the object at `path`, unchecked; `None` when
/// the object cannot hold them (damage): a chunk of another length, a
/// packed chunk too short for a tail. Refused before a body is read.
async fn get_wanted(
    store: &dyn object_store::ObjectStore,
    path: &object_store::path::Path,
    want: &Want<'_>,
) -> object_store::Result<Option<bytes::Bytes>> {
    let Some(at) = want.at else {
        let got = store.get(path).await?;
        if usize::try_from(got.meta.size).ok() != Some(want.len) {
            return Ok(None);
        }
        return got.bytes().await.map(Some);
    };
    let range = at..at + want.len as u64;
    match store.get_range(path, range.clone()).await {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e @ object_store::Error::NotFound { .. }) => Err(e),
        // A range the object does not hold is damage; else the bucket failed.
        Err(e) => match store.head(path).await {
            Ok(meta) if meta.size < range.end => Ok(None),
            _ => Err(e),
        },
    }
}

/// The checkpoint `m` describes, without its blobs and tensors.
pub(super) fn skeleton(m: RemoteManifest) -> Result<GradientCheckpoint> {
    let graph = serde_json::from_value(m.graph).map_err(|e| Error::Json {
        path: None,
        source: Box::new(e),
    })?;
    let mut ckpt = GradientCheckpoint::new(graph, m.step);
    ckpt.timestamp = m.timestamp;
    ckpt.loss_cid = m.loss_cid;
    ckpt.metrics = m.metrics;
    Ok(ckpt)
}

/// Blob `name` as a commit takes it: its length, dtype and shape.
pub(super) fn incoming(step: u64, name: String, blob: &RemoteBlob) -> Result<Incoming> {
    let tensor = match (&blob.dtype, &blob.shape) {
        (Some(dtype), Some(shape)) => {
            let dtype = Dtype::from_name(dtype).ok_or_else(|| {
                Error::corrupt(
                    Some(step),
                    format!("tensor {name:?}: unknown dtype {dtype}"),
                )
            })?;
            Some((dtype, shape.clone()))
        }
        _ => None,
    };
    Ok(Incoming {
        name,
        len: blob.len,
        tensor,
    })
}

/// The chunks of a chunked blob (checked by `RemoteManifest::check`), each
/// named by the blob's name.
pub(super) fn blob_chunks<'a>(
    step: u64,
    name: &'a str,
    blob: &RemoteBlob,
) -> Result<Vec<Want<'a>>> {
    let Some(hashes) = &blob.chunks else {
        return Ok(Vec::new());
    };
    hashes
        .iter()
        .zip(blob.chunk_lengths())
        .map(|(h, n)| Ok(Want::chunk(name, parse(step, name, h)?, n)))
        .collect()
}

/// Blob `name`'s tail in `packed` (format 2), checked against its hash;
/// empty for a blob without one.
pub(super) fn tail<'p>(
    step: u64,
    name: &str,
    blob: &RemoteBlob,
    packed: &'p [u8],
) -> Result<&'p [u8]> {
    let (Some((at, len)), Some(t)) = (blob.tail_bytes(), &blob.tail) else {
        return Ok(&[]);
    };
    let want = parse(step, name, &t.hash)?;
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
pub(super) fn packed_want(m: &RemoteManifest) -> Result<Option<Want<'static>>> {
    let Some(p) = &m.packed else {
        return Ok(None);
    };
    let hash = parse(m.step, "packed blobs", &p.hash)?;
    let len = usize::try_from(p.len).unwrap_or(usize::MAX);
    Ok(Some(Want::chunk("packed blobs", hash, len)))
}

fn parse(step: u64, what: &str, h: &str) -> Result<Hash> {
    parse_hex(h).ok_or_else(|| Error::corrupt(Some(step), format!("{what}: bad chunk name {h:?}")))
}
