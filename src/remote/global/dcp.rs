//! Steps saved through `torch.distributed.checkpoint` by `ckptstore.dcp`:
//! their index (the codec is [`exchange::dcp`](crate::exchange::dcp)) and
//! consolidation into one safetensors file of whole tensors, without
//! Python.

use std::path::Path;

use crate::exchange::dcp::{BoxSource, DcpIndex, DcpTensor, Places, DCP_METADATA};
use crate::exchange::hf::Source;
use crate::exchange::write::write_whole;
use crate::remote::read::pieces::GlobalStep;
use crate::remote::Remote;
use crate::{Error, Result};

impl Remote {
    /// The index of step `step` if `ckptstore.dcp` saved it: its tensors
    /// with their global shapes and stored boxes; `None` for a step that is
    /// not complete or was not saved through DCP.
    ///
    /// # Errors
    /// [`Error::Corrupt`] when the metadata is damaged; [`BucketError::Request`](crate::BucketError::Request)
    /// when the bucket fails.
    pub fn dcp_index(&self, step: u64) -> Result<Option<DcpIndex>> {
        Ok(self.dcp_open(step)?.map(|(_, index, _)| index))
    }

    fn dcp_open(&self, step: u64) -> Result<Option<(GlobalStep, DcpIndex, Places)>> {
        let Some(global) = self.open_global(step)? else {
            return Ok(None);
        };
        let Some(bytes) = self.dcp_metadata(&global)? else {
            return Ok(None);
        };
        let (index, places) = DcpIndex::decode(step, global.world_size(), &bytes)?;
        Ok(Some((global, index, places)))
    }

    /// The DCP metadata document of an opened global step (the bytes of
    /// [`DCP_METADATA`]), `None` if `ckptstore.dcp` did not save it. The
    /// coordinator's shard holds it: rank 0's, unless the save's
    /// coordinator had another rank; a rank's shard manifest is read
    /// (and checked) only until it is found.
    ///
    /// # Errors
    /// [`Error::Corrupt`] for a damaged manifest or chunk;
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket fails.
    pub fn dcp_metadata(&self, global: &GlobalStep) -> Result<Option<Vec<u8>>> {
        for rank in 0..global.world_size() {
            if let Some(e) = self.entries(global, rank)?.get(DCP_METADATA) {
                let mut got = self.read_pieces(global, &[(rank, DCP_METADATA, 0, e.len)])?;
                return Ok(Some(got.pop().unwrap_or_default()));
            }
        }
        Ok(None)
    }

    /// Write DCP step `step` to `path` as one safetensors file of whole
    /// tensors under their fully qualified names (with `prefix`, only the
    /// names under it, the prefix stripped: `"model."` gives a file an
    /// unsharded model's `load_state_dict` takes). One tensor is in memory
    /// at a time, read in windows of 32 MiB; every chunk is hash-checked;
    /// the file is written durably, or not at all. The names written.
    ///
    /// # Errors
    /// [`Error::StepNotFound`] when the step is not a complete DCP step;
    /// [`Error::InvalidCheckpoint`] naming a chosen tensor whose dtype
    /// safetensors cannot hold ([`DcpDtype::Torch`](crate::DcpDtype::Torch): leave it out with a
    /// prefix, or load it through `ckptstore.dcp`);
    /// [`Error::Corrupt`] for damaged data or metadata (a box not stored,
    /// boxes that do not cover a tensor); I/O errors naming `path`.
    pub fn consolidate(&self, step: u64, path: &Path, prefix: Option<&str>) -> Result<Vec<String>> {
        let (global, index, places) = self.dcp_open(step)?.ok_or(Error::StepNotFound { step })?;
        let sources = self.whole_tensors(&global, &index, &places, step, prefix)?;
        write_whole(path, step, sources)
    }

    /// Write DCP step `step` into directory `dir` as a Hugging Face
    /// checkpoint: safetensors shards of at most `max_shard` bytes
    /// (`model-00001-of-0000N.safetensors`, or `model.safetensors` alone)
    /// and `model.safetensors.index.json`, tensors whole under their
    /// names (with `prefix`, only those under it, stripped), floating
    /// tensors cast to `cast` if given (lossy when it narrows). One tensor
    /// is in memory at a time, read in windows of 32 MiB, every chunk
    /// hash-checked; an index already in `dir` is removed first and the
    /// new one written last, each shard durably under a temporary name
    /// first, so a killed export leaves no index naming a shard that is
    /// not whole.
    ///
    /// # Errors
    /// As [`consolidate`](Self::consolidate); I/O errors naming the file.
    pub fn export_hf(
        &self,
        step: u64,
        dir: &Path,
        max_shard: u64,
        prefix: Option<&str>,
        cast: Option<crate::Dtype>,
    ) -> Result<crate::HfExport> {
        let (global, index, places) = self.dcp_open(step)?.ok_or(Error::StepNotFound { step })?;
        let sources = self.whole_tensors(&global, &index, &places, step, prefix)?;
        crate::exchange::hf::export(step, dir, sources, max_shard, cast)
    }

    /// The tensors of `index` under `prefix` (stripped), each filled whole
    /// from its stored boxes.
    fn whole_tensors<'a>(
        &'a self,
        global: &'a GlobalStep,
        index: &'a DcpIndex,
        places: &'a Places,
        step: u64,
        prefix: Option<&str>,
    ) -> Result<Vec<Source<'a>>> {
        let mut sources = Vec::new();
        for (name, fqn, t) in index.chosen(prefix) {
            let dtype = t.storable(step, fqn)?;
            sources.push(Source {
                name,
                dtype,
                shape: t.shape.clone(),
                fill: Box::new(move |out| self.whole_tensor(global, places, fqn, t, out)),
            });
        }
        Ok(sources)
    }

    /// Tensor `fqn`, whole, from its stored boxes, into `out` (of its
    /// length).
    fn whole_tensor(
        &self,
        global: &GlobalStep,
        places: &Places,
        fqn: &str,
        t: &DcpTensor,
        out: &mut [u8],
    ) -> Result<()> {
        let mut shards = Shards {
            remote: self,
            global,
        };
        t.assemble(global.step(), fqn, places, &mut shards, out)
    }
}

/// A global step's shards as the source of its boxes.
struct Shards<'a> {
    remote: &'a Remote,
    global: &'a GlobalStep,
}

impl BoxSource for Shards<'_> {
    fn read(&mut self, rank: u32, entry: &str, at: u64, len: u64) -> Result<Vec<u8>> {
        let mut got = self
            .remote
            .read_pieces(self.global, &[(rank, entry, at, len)])?;
        Ok(got.pop().unwrap_or_default())
    }

    fn read_into(&mut self, rank: u32, entry: &str, out: &mut [u8]) -> Result<()> {
        let len = out.len() as u64;
        self.remote
            .read_pieces_into(self.global, &[(rank, entry, 0, len)], &mut [out])
    }
}
