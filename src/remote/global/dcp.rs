//! Steps saved through `torch.distributed.checkpoint` by `ckptstore.dcp`:
//! their index (the codec is [`exchange::dcp`](crate::exchange::dcp)) and
//! consolidation into one safetensors file of whole tensors, without
//! Python.

use std::path::Path;

use crate::exchange::dcp::{
    BoxSource, DcpIndex, DcpTensor, Places, DCP_METADATA, DCP_RANK_METADATA,
};
use crate::exchange::hf::Source;
use crate::exchange::write::write_whole;
use crate::remote::global::Coordinator;
use crate::remote::read::pieces::GlobalStep;
use crate::{Error, Result};

impl Coordinator<'_> {
    /// Does the work of [`Remote::dcp_index`](crate::Remote::dcp_index).
    pub(crate) fn dcp_index(&self, step: u64) -> Result<Option<DcpIndex>> {
        Ok(self.dcp_open(step)?.map(|(_, index, _)| index))
    }

    fn dcp_open(&self, step: u64) -> Result<Option<(GlobalStep, DcpIndex, Places)>> {
        let Some(global) = self.open_global(step)? else {
            return Ok(None);
        };
        let world = global.world_size();
        if let Some(bytes) = self.dcp_metadata(&global)? {
            let (index, places) = DcpIndex::decode(step, world, &bytes)?;
            return Ok(Some((global, index, places)));
        }
        // A rank-local save: each rank's metadata, merged.
        let mut ranks = Vec::new();
        for rank in 0..world {
            let Some(e) = self.entries(&global, rank)?.get(DCP_RANK_METADATA).cloned() else {
                return Ok(None);
            };
            let mut got = self.read_pieces(&global, &[(rank, DCP_RANK_METADATA, 0, e.len)])?;
            ranks.push(DcpIndex::decode(
                step,
                world,
                &got.pop().unwrap_or_default(),
            )?);
        }
        let (index, places) = DcpIndex::merged(step, ranks)?;
        Ok(Some((global, index, places)))
    }

    /// Does the work of [`Remote::dcp_metadata`](crate::Remote::dcp_metadata).
    pub(crate) fn dcp_metadata(&self, global: &GlobalStep) -> Result<Option<Vec<u8>>> {
        for rank in 0..global.world_size() {
            let entries = self.entries(global, rank)?;
            if let Some(e) = entries.get(DCP_METADATA) {
                let mut got = self.read_pieces(global, &[(rank, DCP_METADATA, 0, e.len)])?;
                return Ok(Some(got.pop().unwrap_or_default()));
            }
            if entries.contains_key(DCP_RANK_METADATA) {
                return Ok(None); // a rank-local save: no global document
            }
        }
        Ok(None)
    }

    /// Does the work of [`Remote::consolidate`](crate::Remote::consolidate).
    pub(crate) fn consolidate(
        &self,
        step: u64,
        path: &Path,
        prefix: Option<&str>,
    ) -> Result<Vec<String>> {
        let (global, index, places) = self.dcp_open(step)?.ok_or(Error::StepNotFound { step })?;
        let sources = self.whole_tensors(&global, &index, &places, step, prefix)?;
        write_whole(path, step, sources)
    }

    /// Does the work of [`Remote::export_hf`](crate::Remote::export_hf).
    pub(crate) fn export_hf(
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
    remote: &'a Coordinator<'a>,
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
