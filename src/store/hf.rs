//! A stored step out as a Hugging Face checkpoint directory
//! ([`exchange::hf`](crate::exchange::hf)): a plain step's typed tensors,
//! or, for a step `ckptstore.dcp` saved into the store, its DCP tensors
//! whole, assembled from their stored boxes; and such a step as one
//! safetensors file of whole tensors.

use std::path::Path;

use crate::engine::StepData;
use crate::exchange::dcp::{BoxSource, DcpIndex, DCP_METADATA};
use crate::exchange::hf::{export, Source};
use crate::exchange::write::write_whole;
use crate::{CheckpointStore, Dtype, Error, HfExport, Result, StepInfo};

/// The largest DCP metadata document read.
const MAX_METADATA_BYTES: u64 = 64 << 20;

impl CheckpointStore {
    /// Write step `step` into directory `dir` as a Hugging Face
    /// checkpoint: safetensors shards of at most `max_shard` bytes and
    /// `model.safetensors.index.json` (one shard: `model.safetensors`, no
    /// index). A step saved through `ckptstore.dcp` gives its tensors
    /// whole under their names; any other step its typed tensors
    /// (untyped blobs are left out). With `prefix`, only the tensors under
    /// it, the prefix stripped; floating tensors cast to `cast` if given
    /// (lossy when it narrows). One tensor is in memory at a time (and a
    /// box of a DCP tensor saved in several); an index already in `dir`
    /// is removed first and the new one written last, each shard durably
    /// under a temporary name first.
    ///
    /// # Errors
    /// [`Error::StepNotFound`]; [`Error::Corrupt`] for damaged data or DCP
    /// metadata; [`Error::InvalidCheckpoint`] for a DCP tensor of a dtype
    /// safetensors cannot hold; I/O errors naming the file.
    pub fn export_hf(
        &self,
        step: u64,
        dir: impl AsRef<Path>,
        max_shard: u64,
        prefix: Option<&str>,
        cast: Option<Dtype>,
    ) -> Result<HfExport> {
        let dir = dir.as_ref();
        self.with_step(step, |_, info, data| {
            if info.blobs.contains_key(DCP_METADATA) {
                return export_dcp(step, dir, &info, data, (max_shard, prefix, cast));
            }
            let mut sources = Vec::new();
            for (name, t) in &info.tensors {
                let Some(out_name) = prefix.map_or(Some(name.as_str()), |p| name.strip_prefix(p))
                else {
                    continue;
                };
                sources.push(Source {
                    name: out_name.to_owned(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    fill: Box::new(move |out| read_entry(step, data, name, out)),
                });
            }
            export(step, dir, sources, max_shard, cast)
        })?
        .ok_or(Error::StepNotFound { step })
    }

    /// Write step `step`, saved into the store by `ckptstore.dcp`, to
    /// `path` as one safetensors file of whole tensors under their fully
    /// qualified names (with `prefix`, only the names under it, the prefix
    /// stripped), as [`Remote::consolidate`](crate::Remote::consolidate)
    /// does for a bucket: one tensor in memory at a time, every chunk
    /// hash-checked, the file written durably or not at all. The names
    /// written.
    ///
    /// # Errors
    /// [`Error::StepNotFound`]; [`Error::InvalidCheckpoint`] for a step
    /// not saved through `ckptstore.dcp`, or naming a chosen tensor whose
    /// dtype safetensors cannot hold; [`Error::Corrupt`] for damaged data
    /// or metadata; I/O errors naming `path`.
    pub fn consolidate(
        &self,
        step: u64,
        path: impl AsRef<Path>,
        prefix: Option<&str>,
    ) -> Result<Vec<String>> {
        let path = path.as_ref();
        self.with_step(step, |_, info, data| {
            if !info.blobs.contains_key(DCP_METADATA) {
                return Err(Error::InvalidCheckpoint {
                    step,
                    reason: "it was not saved by ckptstore.dcp".to_owned(),
                });
            }
            with_dcp_sources(step, &info, data, prefix, |sources| {
                write_whole(path, step, sources)
            })
        })?
        .ok_or(Error::StepNotFound { step })
    }
}

/// A DCP step of the store (one rank's, as `ckptstore.dcp` saves into a
/// store) out with whole tensors.
fn export_dcp(
    step: u64,
    dir: &Path,
    info: &StepInfo,
    data: &StepData<'_>,
    (max_shard, prefix, cast): (u64, Option<&str>, Option<Dtype>),
) -> Result<HfExport> {
    with_dcp_sources(step, info, data, prefix, |sources| {
        export(step, dir, sources, max_shard, cast)
    })
}

/// `use_them` given the tensors (under `prefix`, stripped) of a DCP step
/// of the store, each filled whole from its stored boxes.
fn with_dcp_sources<R>(
    step: u64,
    info: &StepInfo,
    data: &StepData<'_>,
    prefix: Option<&str>,
    use_them: impl FnOnce(Vec<Source<'_>>) -> Result<R>,
) -> Result<R> {
    let len = info.blobs[DCP_METADATA];
    // The same bound as a bucket's manifests: the document is read whole.
    if len > MAX_METADATA_BYTES {
        return Err(Error::corrupt(
            Some(step),
            format!("{DCP_METADATA} is {len} bytes (at most {MAX_METADATA_BYTES} are read)"),
        ));
    }
    let mut metadata = vec![0u8; usize::try_from(len).unwrap_or(0)];
    read_entry(step, data, DCP_METADATA, &mut metadata)?;
    let (index, places) = DcpIndex::decode(step, 1, &metadata)?;
    let places = &places;
    let mut sources = Vec::new();
    for (name, fqn, t) in index.chosen(prefix) {
        let dtype = t.storable(step, fqn)?;
        let mut boxes = StoredBoxes {
            step,
            info,
            data,
            cached: None,
        };
        sources.push(Source {
            name,
            dtype,
            shape: t.shape.clone(),
            fill: Box::new(move |out| t.assemble(step, fqn, places, &mut boxes, out)),
        });
    }
    use_them(sources)
}

/// Entry `name` of the step into `out`, of its length.
fn read_entry(step: u64, data: &StepData<'_>, name: &str, out: &mut [u8]) -> Result<()> {
    if data.read_into(name, out)? {
        Ok(())
    } else {
        Err(Error::corrupt(
            Some(step),
            format!("its data has no {name:?}"),
        ))
    }
}

/// A stored step's entries as the boxes of its one rank.
struct StoredBoxes<'a, 'd> {
    step: u64,
    info: &'a StepInfo,
    data: &'a StepData<'d>,
    /// The last entry read by windows, whole.
    cached: Option<(String, Vec<u8>)>,
}

impl BoxSource for StoredBoxes<'_, '_> {
    fn read(&mut self, rank: u32, entry: &str, at: u64, len: u64) -> Result<Vec<u8>> {
        let whole = self.entry_len(rank, entry)?;
        if self.cached.as_ref().is_none_or(|(name, _)| name != entry) {
            let mut bytes = vec![0u8; usize::try_from(whole).unwrap_or(usize::MAX)];
            read_entry(self.step, self.data, entry, &mut bytes)?;
            self.cached = Some((entry.to_owned(), bytes));
        }
        let bytes = self.cached.as_ref().map_or(&[][..], |(_, b)| b.as_slice());
        let (from, to) = (usize::try_from(at), usize::try_from(at + len));
        match (from, to) {
            (Ok(from), Ok(to)) if to <= bytes.len() => Ok(bytes[from..to].to_vec()),
            _ => Err(Error::corrupt(
                Some(self.step),
                format!("entry {entry:?} is shorter than its box"),
            )),
        }
    }

    fn read_into(&mut self, rank: u32, entry: &str, out: &mut [u8]) -> Result<()> {
        self.entry_len(rank, entry)?;
        read_entry(self.step, self.data, entry, out)
    }
}

impl StoredBoxes<'_, '_> {
    /// The length of `entry`, which only rank 0 (the store's one process)
    /// may hold.
    fn entry_len(&self, rank: u32, entry: &str) -> Result<u64> {
        let len = self
            .info
            .tensors
            .get(entry)
            .map(|t| t.bytes)
            .or_else(|| self.info.blobs.get(entry).copied());
        match (rank, len) {
            (0, Some(len)) => Ok(len),
            _ => Err(Error::corrupt(
                Some(self.step),
                format!("the DCP metadata names entry {entry:?} of rank {rank}, not stored"),
            )),
        }
    }
}
