//! Reading in one read transaction: manifests, listings, and blobs, with
//! every hash checked.

use std::cell::OnceCell;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeBounds;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use redb::{
    AccessGuard, Key, ReadOnlyTable, ReadTransaction, ReadableTable, TableDefinition, TableHandle,
    Value,
};

mod pieces;

pub(crate) use pieces::Placing;

use super::hashing::fill_parallel;
use super::packs::PackReader;
use crate::error::StorageContext;
use crate::format::layout::{chunk_lengths, packed_slice};
use crate::format::manifest::{
    decode_manifest, hex, BlobRef, Hash, Manifest, PackedRef, Placement,
};
use crate::format::tables::{
    meta_u64, CHUNK_DATA, LEGACY_CHUNKS, META, META_STORED_BYTES, META_STORED_CHUNKS,
    META_STORE_ID, PACKED, PACK_CHUNKS, PACK_FILES, PINS, STEPS, SUMMARIES,
};
use crate::{Error, GradientCheckpoint, Result, StepSummary, Tensor, TensorMut};

/// A read transaction's view of the store.
pub(crate) struct View {
    pub(crate) txn: ReadTransaction,
    /// Threads a read may copy and hash chunks on.
    pub(crate) threads: usize,
    /// The store's pack directory; `None` for a store with no path.
    pub(crate) packs: Option<super::packs::PackDir>,
    /// Set when a pack file fails a check: the damage is in that file,
    /// not in the redb file.
    pub(crate) pack_fault: Arc<AtomicBool>,
}

impl View {
    pub(crate) fn steps_table(&self) -> Result<ReadOnlyTable<u64, &'static [u8]>> {
        self.txn
            .open_table(STEPS)
            .context(|| "opening table steps".to_owned())
    }

    /// The decoded, hash-checked manifest of `step`, if stored.
    pub(crate) fn manifest(&self, step: u64) -> Result<Option<Manifest>> {
        self.stored_manifest(step, |bytes| decode_manifest(step, bytes))
    }

    /// The encoded manifest of `step` as stored (decoded and checked
    /// once, so that what it gives decodes).
    pub(crate) fn manifest_bytes(&self, step: u64) -> Result<Option<(Manifest, Vec<u8>)>> {
        self.stored_manifest(step, |bytes| {
            Ok((decode_manifest(step, bytes)?, bytes.to_vec()))
        })
    }

    /// `f` of the stored bytes of `step`'s manifest, if stored.
    fn stored_manifest<T>(
        &self,
        step: u64,
        f: impl FnOnce(&[u8]) -> Result<T>,
    ) -> Result<Option<T>> {
        let steps = self.steps_table()?;
        let Some(bytes) = steps
            .get(step)
            .context(|| format!("reading step {step} from table steps"))?
        else {
            return Ok(None);
        };
        f(bytes.value()).map(Some)
    }

    /// The manifest of the highest step, if any.
    pub(crate) fn latest_manifest(&self) -> Result<Option<Manifest>> {
        let steps = self.steps_table()?;
        let last = steps.last().context(|| "reading table steps".to_owned())?;
        last.map(|(k, v)| decode_manifest(k.value(), v.value()))
            .transpose()
    }

    /// The highest stored step.
    pub(crate) fn latest_step(&self) -> Result<Option<u64>> {
        let steps = self.steps_table()?;
        let last = steps.last().context(|| "reading table steps".to_owned())?;
        Ok(last.map(|(k, _)| k.value()))
    }

    pub(crate) fn steps_in(&self, range: impl RangeBounds<u64>) -> Result<Vec<u64>> {
        super::step_keys(&self.steps_table()?, range)
    }

    pub(crate) fn summaries(&self, range: impl RangeBounds<u64>) -> Result<Vec<StepSummary>> {
        let table = self
            .txn
            .open_table(SUMMARIES)
            .context(|| "opening table summaries".to_owned())?;
        super::summaries(&table, range)
    }

    pub(crate) fn pinned(&self) -> Result<BTreeSet<u64>> {
        let table = self
            .txn
            .open_table(PINS)
            .context(|| "opening table pins".to_owned())?;
        super::pins(&table)
    }

    /// The stored-bytes and stored-chunks counters.
    pub(crate) fn counters(&self) -> Result<(u64, u64)> {
        let meta = self
            .txn
            .open_table(META)
            .context(|| "opening table meta".to_owned())?;
        Ok((
            meta_u64(&meta, META_STORED_BYTES)?,
            meta_u64(&meta, META_STORED_CHUNKS)?,
        ))
    }

    /// The number of pack files the store records, and their bytes.
    pub(crate) fn pack_totals(&self) -> Result<(u64, u64)> {
        let Some(files) = self.optional(PACK_FILES)? else {
            return Ok((0, 0));
        };
        let ctx = || "reading table pack_files".to_owned();
        let (mut count, mut bytes) = (0, 0);
        for entry in files.range::<u32>(..).context(ctx)? {
            let (_, value) = entry.context(ctx)?;
            count += 1;
            bytes += value.value().0;
        }
        Ok((count, bytes))
    }

    /// The store's UUID, which names its run in a bucket.
    pub(crate) fn store_id(&self) -> Result<String> {
        let meta = self
            .txn
            .open_table(META)
            .context(|| "opening table meta".to_owned())?;
        let id = meta
            .get(META_STORE_ID)
            .context(|| "reading the store id from table meta".to_owned())?;
        let id = id.map(|v| String::from_utf8_lossy(v.value()).into_owned());
        id.ok_or_else(|| Error::corrupt(None, "table meta has no store id"))
    }

    /// A table that may not exist: a format 1 store opened read-only has
    /// no format 2 chunk tables, a format 2 store no format 1 ones.
    pub(crate) fn optional<K: Key + 'static, V: Value + 'static>(
        &self,
        table: TableDefinition<K, V>,
    ) -> Result<Option<ReadOnlyTable<K, V>>> {
        match self.txn.open_table(table) {
            Ok(t) => Ok(Some(t)),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
            Err(e) => Err(e).context(|| format!("opening table {}", table.name())),
        }
    }

    /// Read a manifest's blobs into a checkpoint, checking every hash.
    pub(crate) fn assemble(&self, manifest: Manifest) -> Result<GradientCheckpoint> {
        self.assemble_into(manifest, &mut [])
    }

    /// Read a manifest's blobs, checking every hash: each tensor that one
    /// of `targets` fits is read straight into it (and marked filled), the
    /// rest into the checkpoint returned.
    pub(crate) fn assemble_into(
        &self,
        manifest: Manifest,
        targets: &mut [TensorMut<'_>],
    ) -> Result<GradientCheckpoint> {
        let (step, packed) = (manifest.step, manifest.packed.clone());
        let (mut ckpt, blobs, mut typed) = manifest.into_parts();
        let data = self.step_data(step, packed, blobs)?;
        for target in targets.iter_mut() {
            target.filled = false;
            let fits = typed
                .get(target.name())
                .is_some_and(|(dtype, shape)| target.fits(*dtype, shape));
            if fits && data.read_into(&target.name, target.data)? {
                typed.remove(target.name());
                target.filled = true;
            }
        }
        let filled: BTreeSet<&str> = targets
            .iter()
            .filter(|t| t.filled)
            .map(TensorMut::name)
            .collect();
        for name in data.names() {
            if filled.contains(name.as_str()) {
                continue;
            }
            let bytes = data.read(&name)?.unwrap_or_default();
            match typed.remove(&name) {
                // Lengths were checked against dtype and shape when the
                // manifest was decoded.
                Some((dtype, shape)) => {
                    ckpt.tensors.insert(
                        name,
                        Tensor {
                            dtype,
                            shape,
                            data: bytes,
                        },
                    );
                }
                None => {
                    ckpt.optimizer_state.insert(name, bytes);
                }
            }
        }
        Ok(ckpt)
    }

    /// A reader of `blobs` of `step`, one at a time.
    pub(crate) fn step_data(
        &self,
        step: u64,
        packed: Option<PackedRef>,
        blobs: BTreeMap<String, BlobRef>,
    ) -> Result<StepData<'_>> {
        Ok(StepData {
            view: self,
            step,
            chunks: ChunkSource {
                data: self.optional(CHUNK_DATA)?,
                legacy: self.optional(LEGACY_CHUNKS)?,
                packs: match (&self.packs, self.optional(PACK_CHUNKS)?) {
                    (Some(dir), Some(table)) => {
                        Some(PackReader::new(dir.clone(), table, self.pack_fault.clone()))
                    }
                    _ => None,
                },
            },
            packed_ref: packed,
            packed: OnceCell::new(),
            blobs,
        })
    }

    /// A step's packed small blobs, checked against their length and hash.
    fn read_packed(&self, step: u64, packed: &PackedRef) -> Result<Vec<u8>> {
        let ctx = || format!("reading the packed blobs of step {step}");
        let table = self.txn.open_table(PACKED).context(ctx)?;
        let corrupt = |what: &str| Error::corrupt(Some(step), format!("packed blobs {what}"));
        let len = usize::try_from(packed.len).map_err(|_| corrupt("are too long to load"))?;
        let mut expected = chunk_lengths(len);
        let mut data = Vec::new();
        data.try_reserve_exact(len)
            .map_err(|_| corrupt("cannot be allocated"))?;
        for entry in table.range((step, 0)..=(step, u32::MAX)).context(ctx)? {
            let (_, piece) = entry.context(ctx)?;
            let piece = piece.value();
            if expected.next() != Some(piece.len()) {
                return Err(corrupt("have the wrong layout"));
            }
            data.extend_from_slice(piece);
        }
        if expected.next().is_some() || data.len() != len {
            return Err(corrupt("are incomplete"));
        }
        if blake3::hash(&data).as_bytes() != &packed.hash {
            return Err(corrupt("fail their hash check"));
        }
        Ok(data)
    }
}

/// The blobs of one step, read one at a time, each hash-checked: the
/// step's packed small blobs are read once, on first use.
pub(crate) struct StepData<'v> {
    view: &'v View,
    step: u64,
    chunks: ChunkSource,
    packed_ref: Option<PackedRef>,
    packed: OnceCell<Vec<u8>>,
    blobs: BTreeMap<String, BlobRef>,
}

impl StepData<'_> {
    /// The names of the step's blobs, ascending.
    pub(crate) fn names(&self) -> Vec<String> {
        self.blobs.keys().cloned().collect()
    }

    /// The bytes of blob `name`, or `None` if the step has no such blob.
    pub(crate) fn read(&self, name: &str) -> Result<Option<Vec<u8>>> {
        let Some(blob) = self.blobs.get(name) else {
            return Ok(None);
        };
        let mut out = vec![0u8; self.blob_len(name, blob)?];
        self.fill(name, blob, &mut out)?;
        Ok(Some(out))
    }

    /// Read blob `name` into `out`, which must have its length; `false`
    /// (and `out` untouched) if the step has no such blob.
    pub(crate) fn read_into(&self, name: &str, out: &mut [u8]) -> Result<bool> {
        let Some(blob) = self.blobs.get(name) else {
            return Ok(false);
        };
        if self.blob_len(name, blob)? != out.len() {
            return Err(Error::corrupt(
                Some(self.step),
                format!("blob {name:?} does not have the length its tensor needs"),
            ));
        }
        self.fill(name, blob, out)?;
        Ok(true)
    }

    fn blob_len(&self, name: &str, blob: &BlobRef) -> Result<usize> {
        usize::try_from(blob.len).map_err(|_| {
            Error::corrupt(
                Some(self.step),
                format!("blob {name:?} is too long to load"),
            )
        })
    }

    /// The step's packed small blobs, read and checked on first use.
    fn packed(&self) -> Result<&[u8]> {
        if let Some(p) = self.packed.get() {
            return Ok(p);
        }
        let read = match &self.packed_ref {
            Some(p) => self.view.read_packed(self.step, p)?,
            None => Vec::new(),
        };
        Ok(self.packed.get_or_init(|| read))
    }

    /// Fill `out` (of the blob's length) with blob `blob`'s checked bytes.
    fn fill(&self, name: &str, blob: &BlobRef, out: &mut [u8]) -> Result<()> {
        let step = self.step;
        let Placement::Packed { offset } = &blob.at else {
            return fill_blob(&self.chunks, step, name, blob, self.view.threads, out);
        };
        // Bounds were checked when the manifest was decoded.
        let bytes = packed_slice(self.packed()?, *offset, blob.len).ok_or_else(|| {
            Error::corrupt(
                Some(step),
                format!("blob {name:?} is outside the packed bytes"),
            )
        })?;
        out.copy_from_slice(bytes);
        Ok(())
    }
}

/// One chunk of a step's blob: its hash, where it is, and its length.
#[cfg(feature = "remote")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkPlace {
    pub(crate) hash: Hash,
    pub(crate) len: usize,
    at: ChunkAt,
}

/// What a push reads of a step: places first, then chunks one by one.
#[cfg(feature = "remote")]
impl StepData<'_> {
    /// Each blob's length and place, by name (no data read).
    pub(crate) fn blob_refs(&self) -> &BTreeMap<String, BlobRef> {
        &self.blobs
    }

    /// The length and hash of the step's packed small blobs, if it has any.
    pub(crate) fn packed_ref(&self) -> Option<&PackedRef> {
        self.packed_ref.as_ref()
    }

    /// The step's packed small blobs, hash-checked.
    pub(crate) fn packed_bytes(&self) -> Result<Vec<u8>> {
        match &self.packed_ref {
            Some(p) => self.view.read_packed(self.step, p),
            None => Ok(Vec::new()),
        }
    }

    /// The chunks of blob `name` in order (none for a packed blob).
    pub(crate) fn chunk_places(&self, name: &str) -> Result<Vec<ChunkPlace>> {
        let Some(blob) = self
            .blobs
            .get(name)
            .filter(|b| !matches!(b.at, Placement::Packed { .. }))
        else {
            return Ok(Vec::new());
        };
        let len = self.blob_len(name, blob)?;
        Ok(blob_chunks(self.step, name, blob, len)?
            .into_iter()
            .map(|(hash, at, len)| ChunkPlace { hash, len, at })
            .collect())
    }

    /// The bytes of one chunk, length- and hash-checked.
    pub(crate) fn read_chunk(&self, place: &ChunkPlace) -> Result<Vec<u8>> {
        let step = self.step;
        let fault =
            |what: String| Error::corrupt(Some(step), format!("chunk {} {what}", hex(&place.hash)));
        let mut out = vec![0u8; place.len];
        self.chunks.fill(&place.hash, place.at, &mut out, &fault)?;
        Ok(out)
    }
}

/// Where chunks are read from: by id (from `chunk_data` or a pack file),
/// or (format 1) by hash.
struct ChunkSource {
    data: Option<ReadOnlyTable<u64, &'static [u8]>>,
    legacy: Option<ReadOnlyTable<&'static [u8; 32], &'static [u8]>>,
    packs: Option<PackReader>,
}

/// Where one chunk of a blob is.
#[derive(Clone, Copy, Debug)]
enum ChunkAt {
    Id(u64),
    Hash,
}

impl ChunkSource {
    fn get(&self, hash: &Hash, at: ChunkAt) -> Result<Option<AccessGuard<'_, &'static [u8]>>> {
        let ctx = || format!("reading chunk {}", hex(hash));
        match (at, &self.data, &self.legacy) {
            (ChunkAt::Id(id), Some(data), _) => data.get(id).context(ctx),
            (ChunkAt::Hash, _, Some(legacy)) => legacy.get(hash).context(ctx),
            _ => Ok(None),
        }
    }

    /// Fill `out` with chunk `hash`, stored at `at`, checked against its
    /// length and hash before (redb) or as (pack file) it lands: wrong
    /// bytes never stay in `out`. `fault` words an integrity failure.
    fn fill(
        &self,
        hash: &Hash,
        at: ChunkAt,
        out: &mut [u8],
        fault: &dyn Fn(String) -> Error,
    ) -> Result<()> {
        if let Some(chunk) = self.get(hash, at)? {
            let bytes = chunk.value();
            if bytes.len() != out.len() {
                return Err(fault(format!(
                    "has {} bytes, expected {}",
                    bytes.len(),
                    out.len()
                )));
            }
            if blake3::hash(bytes).as_bytes() != hash {
                return Err(fault("fails its hash check".to_owned()));
            }
            out.copy_from_slice(bytes);
            return Ok(());
        }
        let loc = match (at, &self.packs) {
            (ChunkAt::Id(id), Some(packs)) => packs.loc(id)?,
            _ => None,
        };
        let Some(loc) = loc else {
            return Err(fault("is missing".to_owned()));
        };
        if loc.hash != *hash || loc.len as usize != out.len() {
            return Err(fault(format!(
                "is recorded in pack file {} as {} bytes with hash {}",
                loc.pack,
                loc.len,
                hex(&loc.hash)
            )));
        }
        self.packs
            .as_ref()
            .map_or(Ok(()), |p| p.read_into(&loc, out, fault))
    }
}

/// The chunks of chunked blob `name` (of `len` bytes) in order: where each
/// is, and its length (none for a packed blob).
fn blob_chunks(
    step: u64,
    name: &str,
    blob: &BlobRef,
    len: usize,
) -> Result<Vec<(Hash, ChunkAt, usize)>> {
    let refs: Vec<(Hash, ChunkAt)> = match &blob.at {
        Placement::Chunks(c) => c.iter().map(|c| (c.hash, ChunkAt::Id(c.id))).collect(),
        Placement::Format1Chunks(h) => h.iter().map(|h| (*h, ChunkAt::Hash)).collect(),
        Placement::Packed { .. } => Vec::new(),
    };
    // The manifest's hash was checked and its length bounded by its chunk
    // count when it was decoded.
    let lengths: Vec<usize> = chunk_lengths(len).collect();
    if lengths.len() != refs.len() {
        return Err(Error::corrupt(
            Some(step),
            format!(
                "blob {name:?} lists {} chunks, its length {len} needs {}",
                refs.len(),
                lengths.len()
            ),
        ));
    }
    Ok(refs
        .into_iter()
        .zip(lengths)
        .map(|((hash, at), n)| (hash, at, n))
        .collect())
}

/// Fill `data` (the blob's length, checked by the caller) with one chunked
/// blob: each chunk is hash-checked where redb holds it and only then
/// copied into its place (wrong bytes never reach `data`), chunks spread
/// over up to `threads` threads. Chunk boundaries are a function of the
/// blob's length.
fn fill_blob(
    chunks: &ChunkSource,
    step: u64,
    name: &str,
    blob: &BlobRef,
    threads: usize,
    data: &mut [u8],
) -> Result<()> {
    let refs = blob_chunks(step, name, blob, data.len())?;
    fill_chunks(chunks, step, name, &refs, threads, data)
}

/// Fill `data` with the chunks `refs` (their lengths add up to its
/// length), spread over up to `threads` threads.
fn fill_chunks(
    chunks: &ChunkSource,
    step: u64,
    name: &str,
    refs: &[(Hash, ChunkAt, usize)],
    threads: usize,
    data: &mut [u8],
) -> Result<()> {
    let mut pieces = Vec::with_capacity(refs.len());
    let mut rest = data;
    for &(_, _, n) in refs {
        let (piece, tail) = std::mem::take(&mut rest).split_at_mut(n);
        pieces.push(piece);
        rest = tail;
    }
    fill_parallel(pieces, threads, &|i, piece| {
        let (hash, at, _) = &refs[i];
        let fault = |what: String| {
            Error::corrupt(
                Some(step),
                format!("chunk {} of blob {name:?} {what}", hex(hash)),
            )
        };
        chunks.fill(hash, *at, piece, &fault)
    })
}
