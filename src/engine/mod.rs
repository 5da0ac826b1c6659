//! The engine: every operation on the store's tables, inside one redb
//! transaction, with no knowledge of handles, options or threads.
//!
//! [`Engine`] owns a write transaction's tables and carries the operations
//! that change them; [`View`] reads a read transaction's. The layer above
//! (`db`) decides when transactions begin and commit.

mod chunks;
pub(crate) mod hashing;
pub(crate) mod packs;
pub(crate) mod plan;
mod read;
mod replica;
pub(crate) mod slices;
mod verify;

use std::collections::BTreeSet;
use std::ops::RangeBounds;
use std::path::PathBuf;

use redb::{ReadableTable, Table, WriteTransaction};

use crate::error::StorageContext;
use crate::format::layout::split;
use crate::format::manifest::{decode_manifest, encode_manifest, Hash};
use crate::format::packs::pack_owner;
use crate::format::summary;
#[cfg(feature = "remote")]
use crate::format::tables::META_STORE_ID;
use crate::format::tables::{
    meta_format, meta_u64, META, META_FORMAT, META_NEXT_CHUNK, META_NEXT_PACK, META_PACK_OWNER,
    META_STAGING, META_STORED_BYTES, META_STORED_CHUNKS, PACKED, PACK_FORMAT, PINS, RECORD_FORMAT,
    STEPS, SUMMARIES, TENSOR_FORMAT,
};
use crate::{CommitInfo, Error, Result, Retention, StepSummary};
use chunks::{ChunkTables, Freed};
use packs::PackWriter;
use plan::Plan;

#[cfg(feature = "remote")]
pub(crate) use read::ChunkPlace;
pub(crate) use read::{Placing, StepData, View};
#[cfg(feature = "remote")]
pub(crate) use replica::{Pushed, Remembered};
pub(crate) use verify::Checked;

/// The tables of one write transaction, and the operations on them.
pub(crate) struct Engine<'txn> {
    txn: &'txn WriteTransaction,
    /// Whether the store has the `replica_*` tables, once looked up.
    replica_tables: Option<bool>,
    meta: Table<'txn, &'static str, &'static [u8]>,
    steps: Table<'txn, u64, &'static [u8]>,
    summaries: Table<'txn, u64, &'static [u8]>,
    pins: Table<'txn, u64, ()>,
    packed: Table<'txn, (u64, u32), &'static [u8]>,
    chunks: ChunkTables<'txn>,
    /// Changes to the stored-bytes and stored-chunks counters.
    bytes_delta: i128,
    chunks_delta: i128,
    first_id: u64,
}

impl<'txn> Engine<'txn> {
    /// Open the tables of `txn`, of a store whose pack files are in
    /// `pack_dir` (`None` for a store with no path).
    pub(crate) fn open(
        txn: &'txn WriteTransaction,
        pack_dir: Option<packs::PackDir>,
    ) -> Result<Self> {
        let ctx = || "opening the store's tables".to_owned();
        let meta = txn.open_table(META).context(ctx)?;
        let first_id = meta_u64(&meta, META_NEXT_CHUNK)?;
        let owner = pack_owner(&meta)?;
        Ok(Engine {
            txn,
            replica_tables: None,
            meta,
            steps: txn.open_table(STEPS).context(ctx)?,
            summaries: txn.open_table(SUMMARIES).context(ctx)?,
            pins: txn.open_table(PINS).context(ctx)?,
            packed: txn.open_table(PACKED).context(ctx)?,
            chunks: ChunkTables::open(txn, first_id, pack_dir, owner)?,
            bytes_delta: 0,
            chunks_delta: 0,
            first_id,
        })
    }

    /// Put the new chunks of this transaction in a pack file of their own
    /// rather than in `chunk_data` (a store with no path keeps them in
    /// `chunk_data`).
    pub(crate) fn pack_new_chunks(&mut self) -> Result<()> {
        let Some(dir) = self.chunks.packs.dir.clone() else {
            return Ok(());
        };
        let next = meta_u64(&self.meta, META_NEXT_PACK)?;
        let id = u32::try_from(next)
            .map_err(|_| Error::corrupt(None, format!("pack file id {next} is out of range")))?;
        let owner = self.chunks.packs.owner;
        self.chunks.packs.writer = Some(PackWriter::new(&dir, id, owner));
        Ok(())
    }

    /// Rewrite the pack files at least half dead: their live chunks move to
    /// this transaction's pack file; returns the files and bytes freed
    /// (their files are deleted once the transaction commits).
    pub(crate) fn compact_packs(&mut self) -> Result<(u64, u64)> {
        self.pack_new_chunks()?;
        self.chunks.packs.compact()
    }

    /// Whether a pack file read in this transaction failed its check.
    pub(crate) fn pack_faulted(&self) -> bool {
        self.chunks.packs.faulted
    }

    /// Write the counters this transaction changed and make its pack file
    /// durable; the last call before the transaction commits. Returns the
    /// pack files to delete once it has committed.
    pub(crate) fn finish(mut self) -> Result<Vec<PathBuf>> {
        let ctx = || "writing table meta".to_owned();
        if let Some(id) = self.chunks.packs.finish()? {
            self.require_format(PACK_FORMAT)?;
            let next = (u64::from(id) + 1).to_le_bytes();
            self.meta
                .insert(META_NEXT_PACK, next.as_slice())
                .context(ctx)?;
            if self.meta.get(META_PACK_OWNER).context(ctx)?.is_none() {
                let owner = self.chunks.packs.owner;
                self.meta
                    .insert(META_PACK_OWNER, owner.as_slice())
                    .context(ctx)?;
            }
        }
        for (key, delta) in [
            (META_STORED_BYTES, self.bytes_delta),
            (META_STORED_CHUNKS, self.chunks_delta),
        ] {
            if delta != 0 {
                let old = meta_u64(&self.meta, key)?;
                let new = u64::try_from((i128::from(old) + delta).max(0)).unwrap_or(u64::MAX);
                self.meta
                    .insert(key, new.to_le_bytes().as_slice())
                    .context(ctx)?;
            }
        }
        if self.chunks.next_id != self.first_id {
            let next = self.chunks.next_id.to_le_bytes();
            self.meta
                .insert(META_NEXT_CHUNK, next.as_slice())
                .context(ctx)?;
        }
        Ok(std::mem::take(&mut self.chunks.packs.dead))
    }

    /// Give the store the UUID `id` (a store joining a run in a bucket).
    #[cfg(feature = "remote")]
    pub(crate) fn set_store_id(&mut self, id: &str) -> Result<()> {
        self.meta
            .insert(META_STORE_ID, id.as_bytes())
            .context(|| "writing the store id to table meta".to_owned())?;
        Ok(())
    }

    /// Store the step `plan` describes, its chunk hashes from `hashes`;
    /// replace a stored step of that number only if `replace`. Then apply
    /// `policy` (which may be empty).
    pub(crate) fn put(
        &mut self,
        plan: &Plan<'_>,
        hashes: &mut dyn Iterator<Item = Hash>,
        replace: bool,
        policy: &Retention,
    ) -> Result<CommitInfo> {
        let step = plan.step();
        let old = self.manifest_bytes(step)?;
        if old.is_some() && !replace {
            return Err(Error::StepExists { step });
        }
        if !plan.typed.is_empty() {
            self.require_format(TENSOR_FORMAT)?;
        }
        if !plan.source.save_record().is_empty() {
            self.require_format(RECORD_FORMAT)?;
        }
        // Add before releasing, so chunks shared with the replaced version
        // are never deleted and written again.
        let mut added = self.chunks.add(&plan.pieces, hashes)?;
        let mut streamed = Vec::with_capacity(plan.streamed.len());
        for s in plan.streamed {
            streamed.push(self.chunks.add_staged(s.len, &s.hashes, &mut added)?);
        }
        let placements = plan.placements_with(&added.refs, streamed);
        let manifest = encode_manifest(
            plan.source,
            &plan.typed,
            &placements,
            plan.packed_ref().as_ref(),
        )?;
        let mut freed = match old {
            Some(old) => self.forget(step, &old)?,
            None => Freed::default(),
        };
        self.steps
            .insert(step, manifest.as_slice())
            .context(|| format!("writing step {step} to table steps"))?;
        self.put_packed(step, &plan.packed)?;
        let bytes_written = added.bytes_written + plan.packed.len() as u64;
        self.put_summary(&plan.summary(bytes_written))?;
        // A healed chunk was stored before: written again, not added.
        let chunks_added = added.chunks_written - added.chunks_healed;
        self.count(
            bytes_written - added.bytes_healed,
            chunks_added,
            Freed::default(),
        );
        let mut removed = Vec::new();
        if !policy.is_empty() {
            let doomed = self.retention_doomed(policy)?;
            let (gone, also) = self.remove_steps(&doomed)?;
            removed = gone;
            freed.bytes += also.bytes;
        }
        Ok(CommitInfo {
            step,
            logical_bytes: plan.logical_bytes(),
            bytes_written,
            bytes_reused: added.bytes_reused,
            chunks_written: added.chunks_written,
            chunks_reused: added.chunks_reused,
            chunks_healed: added.chunks_healed,
            manifest_bytes: manifest.len() as u64,
            bytes_freed: freed.bytes,
            removed,
            duration: std::time::Duration::ZERO,
        })
    }

    /// Mark the store as at least `format`, so that older builds that
    /// cannot read what this transaction writes refuse the store.
    fn require_format(&mut self, format: u32) -> Result<()> {
        if meta_format(&self.meta)? < format {
            self.meta
                .insert(META_FORMAT, format.to_le_bytes().as_slice())
                .context(|| "writing the format version to table meta".to_owned())?;
        }
        Ok(())
    }

    /// Whether `step` is stored.
    pub(crate) fn has_step(&self, step: u64) -> Result<bool> {
        let found = self
            .steps
            .get(step)
            .context(|| format!("reading step {step} from table steps"))?;
        Ok(found.is_some())
    }

    fn manifest_bytes(&self, step: u64) -> Result<Option<Vec<u8>>> {
        Ok(self
            .steps
            .get(step)
            .context(|| format!("reading step {step} from table steps"))?
            .map(|g| g.value().to_vec()))
    }

    /// Delete what a stored version of `step` holds besides its manifest
    /// entry: its chunk uses and packed bytes. A manifest that no longer
    /// decodes cannot tell which chunks it held; they stay referenced.
    fn forget(&mut self, step: u64, old_manifest: &[u8]) -> Result<Freed> {
        self.forget_replicated(step)?;
        let mut freed = match decode_manifest(step, old_manifest) {
            Ok(m) => self.chunks.release(m.chunk_uses())?,
            Err(_) => Freed::default(),
        };
        freed.bytes += self.remove_packed(step)?;
        self.count(0, 0, freed);
        Ok(freed)
    }

    fn count(&mut self, bytes_added: u64, chunks_added: u64, freed: Freed) {
        self.bytes_delta += i128::from(bytes_added) - i128::from(freed.bytes);
        self.chunks_delta += i128::from(chunks_added) - i128::from(freed.chunks);
    }

    /// Remove the steps of `doomed` that are stored, with their summaries,
    /// pins and packed bytes, releasing their chunks; returns the steps
    /// removed and what was freed.
    pub(crate) fn remove_steps(&mut self, doomed: &[u64]) -> Result<(Vec<u64>, Freed)> {
        let mut removed = Vec::with_capacity(doomed.len());
        let mut total = Freed::default();
        for &step in doomed {
            let ctx = || format!("removing step {step}");
            self.summaries.remove(step).context(ctx)?;
            self.pins.remove(step).context(ctx)?;
            let Some(old) = self
                .steps
                .remove(step)
                .context(ctx)?
                .map(|g| g.value().to_vec())
            else {
                continue;
            };
            let freed = self.forget(step, &old)?;
            total.bytes += freed.bytes;
            total.chunks += freed.chunks;
            removed.push(step);
        }
        Ok((removed, total))
    }

    /// The steps `policy` would delete now.
    pub(crate) fn retention_doomed(&self, policy: &Retention) -> Result<Vec<u64>> {
        Ok(policy.doomed(&summaries(&self.summaries, ..)?, &pins(&self.pins)?))
    }

    /// The pinned steps.
    pub(crate) fn pinned(&self) -> Result<BTreeSet<u64>> {
        pins(&self.pins)
    }

    /// The stored steps in `range`, ascending.
    pub(crate) fn steps_in(&self, range: impl RangeBounds<u64>) -> Result<Vec<u64>> {
        step_keys(&self.steps, range)
    }

    /// Pin (`true`) or unpin `step`; whether that changed anything.
    pub(crate) fn set_pin(&mut self, step: u64, pinned: bool) -> Result<bool> {
        let ctx = || format!("writing table pins for step {step}");
        if pinned {
            if !self.has_step(step)? {
                return Err(Error::StepNotFound { step });
            }
            Ok(self.pins.insert(step, ()).context(ctx)?.is_none())
        } else {
            Ok(self.pins.remove(step).context(ctx)?.is_some())
        }
    }

    /// Stage the new chunks among `pieces` (see [`ChunkTables::stage`]),
    /// marking the store as staging; returns the chunks healed.
    pub(crate) fn stage(
        &mut self,
        pieces: &[&[u8]],
        hashes: &mut dyn Iterator<Item = Hash>,
        staged: &mut Vec<Hash>,
    ) -> Result<u64> {
        self.meta
            .insert(META_STAGING, [1u8].as_slice())
            .context(|| "writing table meta".to_owned())?;
        self.chunks.stage(pieces, hashes, staged)
    }

    /// Delete the chunks among `staged` that are still unused and mark the
    /// store as not staging.
    pub(crate) fn unstage(&mut self, staged: &[Hash]) -> Result<usize> {
        let deleted = self.chunks.unstage(staged)?;
        self.end_staging()?;
        Ok(deleted)
    }

    /// Mark the store as not staging.
    pub(crate) fn end_staging(&mut self) -> Result<()> {
        self.meta
            .remove(META_STAGING)
            .context(|| "writing table meta".to_owned())?;
        Ok(())
    }

    /// After a crash: delete every staged chunk if a staging was under
    /// way. Returns how many were deleted.
    pub(crate) fn sweep_staged(&mut self) -> Result<usize> {
        let staging = self
            .meta
            .get(META_STAGING)
            .context(|| "reading table meta".to_owned())?
            .is_some();
        if !staging {
            return Ok(0);
        }
        let staged = self.chunks.staged()?;
        self.unstage(&staged)
    }

    fn put_summary(&mut self, s: &StepSummary) -> Result<()> {
        let bytes = summary::encode(s)?;
        self.summaries
            .insert(s.step, bytes.as_slice())
            .context(|| format!("writing step {} to table summaries", s.step))?;
        Ok(())
    }

    /// Store a step's packed small blobs (nothing if empty).
    fn put_packed(&mut self, step: u64, packed: &[u8]) -> Result<()> {
        for (i, piece) in split(packed).enumerate() {
            let i = u32::try_from(i).map_err(|_| Error::InvalidCheckpoint {
                step,
                reason: "too many small blobs to pack".into(),
            })?;
            self.packed
                .insert((step, i), piece)
                .context(|| format!("writing step {step} to table packed"))?;
        }
        Ok(())
    }

    /// Delete a step's packed small blobs; returns the bytes deleted.
    fn remove_packed(&mut self, step: u64) -> Result<u64> {
        let ctx = || format!("removing step {step} from table packed");
        let keys: Vec<(u64, u32)> = self
            .packed
            .range((step, 0)..=(step, u32::MAX))
            .context(ctx)?
            .map(|r| r.map(|(k, _)| k.value()))
            .collect::<Result<_, _>>()
            .context(ctx)?;
        let mut freed = 0;
        for key in keys {
            if let Some(v) = self.packed.remove(key).context(ctx)? {
                freed += v.value().len() as u64;
            }
        }
        Ok(freed)
    }
}

/// Summaries of the steps in `range`, from any readable `summaries` table.
pub(crate) fn summaries(
    table: &impl ReadableTable<u64, &'static [u8]>,
    range: impl RangeBounds<u64>,
) -> Result<Vec<StepSummary>> {
    let ctx = || "reading table summaries".to_owned();
    let mut out = Vec::new();
    for entry in table.range(range).context(ctx)? {
        let (key, value) = entry.context(ctx)?;
        out.push(summary::decode(key.value(), value.value())?);
    }
    Ok(out)
}

/// The pinned steps, from any readable `pins` table.
pub(crate) fn pins(table: &impl ReadableTable<u64, ()>) -> Result<BTreeSet<u64>> {
    let ctx = || "reading table pins".to_owned();
    table
        .range::<u64>(..)
        .context(ctx)?
        .map(|r| r.map(|(k, _)| k.value()))
        .collect::<Result<_, _>>()
        .context(ctx)
}

/// The keys in `range` of any readable `steps` table.
pub(crate) fn step_keys(
    table: &impl ReadableTable<u64, &'static [u8]>,
    range: impl RangeBounds<u64>,
) -> Result<Vec<u64>> {
    let ctx = || "reading table steps".to_owned();
    table
        .range(range)
        .context(ctx)?
        .map(|r| r.map(|(k, _)| k.value()))
        .collect::<Result<_, _>>()
        .context(ctx)
}
