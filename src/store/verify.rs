//! Verification: every hash, every reference count, every counter.

use std::collections::HashMap;

use redb::ReadTransaction;

use super::chunks::hex;
use super::manifest::decode_manifest;
use super::read::{assemble, open_optional, open_steps};
use super::schema::{
    meta_u64, ChunkId, CHUNK_DATA, CHUNK_INDEX, LEGACY_CHUNKS, LEGACY_REFS, META,
    META_STORED_BYTES, META_STORED_CHUNKS, PACKED,
};
use super::{shield, CheckpointStore};
use crate::error::StorageContext;
use crate::{Error, Result};

/// What [`CheckpointStore::verify`] found.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct VerifyReport {
    /// Steps whose manifest and every chunk checked out.
    pub steps_ok: u64,
    /// Blob bytes hashed and found good.
    pub bytes_checked: u64,
    /// Each damaged step with the first problem found in it.
    pub damaged: Vec<(u64, Error)>,
    /// Disagreements between the reference counts, the chunks and the
    /// manifests (checked when no step is damaged).
    pub accounting: Vec<String>,
    /// Chunks staged by a large commit still under way, used by no step
    /// yet (checked with the accounting). A commit that crashes leaves its
    /// staged chunks behind; the next writable open deletes them.
    pub staged_chunks: u64,
}

impl VerifyReport {
    /// True when nothing is damaged.
    pub fn is_ok(&self) -> bool {
        self.damaged.is_empty() && self.accounting.is_empty()
    }
}

impl CheckpointStore {
    /// Read every step and check every hash. Damage is reported per step in
    /// the [`VerifyReport`]; `Err` means the store could not be read at all.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// let report = store.verify()?;
    /// assert!(report.is_ok());
    /// assert_eq!(report.steps_ok, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn verify(&self) -> Result<VerifyReport> {
        self.verify_with(&mut |_, _| {})
    }

    /// [`verify`](Self::verify), calling `progress(step, blob_bytes)` after
    /// each step is checked (for progress bars).
    pub fn verify_with(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<VerifyReport> {
        let what = || "verifying".to_owned();
        self.shielded(None, &what, || {
            let txn = self.begin_read()?;
            let steps = open_steps(&txn)?;
            let mut report = VerifyReport::default();
            let mut expected = Expected::default();
            let ctx = || "reading table steps".to_owned();
            for entry in steps.range::<u64>(..).context(ctx)? {
                let (key, bytes) = match entry {
                    Ok(kv) => kv,
                    Err(e) => {
                        // The table itself is damaged past this point.
                        let err = Err::<(), _>(e).context(ctx).err();
                        if let Some(err) = err {
                            report.damaged.push((u64::MAX, err));
                        }
                        break;
                    }
                };
                let step = key.value();
                let what = || format!("verifying step {step}");
                let checked = shield(Some(step), &what, || {
                    let manifest = decode_manifest(step, bytes.value())?;
                    for (hash, id) in manifest.chunk_refs() {
                        match id {
                            Some(id) => {
                                let e = expected.chunks.entry(*hash).or_insert((id, 0));
                                e.1 += 1;
                                if e.0 != id {
                                    expected.mismatched.push((*hash, e.0, id));
                                }
                            }
                            None => *expected.legacy.entry(*hash).or_insert(0) += 1,
                        }
                    }
                    assemble(&txn, manifest)
                });
                match checked {
                    Ok(ckpt) => {
                        report.steps_ok += 1;
                        report.bytes_checked += ckpt.logical_bytes();
                        progress(step, ckpt.logical_bytes());
                    }
                    Err(e) => {
                        report.damaged.push((step, e));
                        progress(step, 0);
                    }
                }
            }
            if report.damaged.is_empty() {
                (report.accounting, report.staged_chunks) = check_accounting(&txn, expected)?;
            }
            Ok(report)
        })
    }
}

/// What the manifests say the chunk tables hold.
#[derive(Default)]
struct Expected {
    /// Hash -> (id, uses) of format 2 chunks.
    chunks: HashMap<ChunkId, (u64, u64)>,
    /// Hash -> uses of format 1 chunks.
    legacy: HashMap<ChunkId, u64>,
    /// Hashes that manifests give two different ids: (hash, one, other).
    mismatched: Vec<(ChunkId, u64, u64)>,
}

/// Compare the chunk index, the chunks and the counters with what the
/// manifests say; returns each discrepancy, and the number of staged chunks.
fn check_accounting(txn: &ReadTransaction, mut expected: Expected) -> Result<(Vec<String>, u64)> {
    let mut problems: Vec<String> = expected
        .mismatched
        .iter()
        .map(|(hash, a, b)| format!("chunk {} has ids {a} and {b} in manifests", hex(hash)))
        .collect();
    let (mut bytes, mut count, mut staged_chunks) = (0u64, 0u64, 0u64);

    let ctx = || "reading table chunk_index".to_owned();
    // Id -> (hash, staged: written by a commit still under way, used by no
    // step and not counted yet).
    let mut indexed: HashMap<u64, (ChunkId, bool)> = HashMap::new();
    if let Some(index) = open_optional(txn, CHUNK_INDEX)? {
        for entry in index.range::<&[u8; 32]>(..).context(ctx)? {
            let (hash, value) = entry.context(ctx)?;
            let (hash, (id, uses)) = (*hash.value(), value.value());
            let staged = uses == 0 && !expected.chunks.contains_key(&hash);
            if let Some((other, _)) = indexed.insert(id, (hash, staged)) {
                problems.push(format!(
                    "chunks {} and {} share id {id}",
                    hex(&other),
                    hex(&hash)
                ));
            }
            if staged {
                staged_chunks += 1;
                continue;
            }
            let want = expected.chunks.remove(&hash);
            if want != Some((id, uses)) {
                let (want_id, want_uses) =
                    want.map_or(("none".to_owned(), 0), |(i, u)| (i.to_string(), u));
                problems.push(format!(
                    "chunk {} is indexed as id {id} with {uses} uses, manifests say id {want_id} with {want_uses}",
                    hex(&hash)
                ));
            }
        }
    }
    for hash in expected.chunks.keys() {
        problems.push(format!("chunk {} is used but not indexed", hex(hash)));
    }
    let ctx = || "reading table chunk_data".to_owned();
    if let Some(data) = open_optional(txn, CHUNK_DATA)? {
        for entry in data.range::<u64>(..).context(ctx)? {
            let (id, value) = entry.context(ctx)?;
            match indexed.remove(&id.value()) {
                Some((_, true)) => {}
                Some((_, false)) => {
                    bytes += value.value().len() as u64;
                    count += 1;
                }
                None => problems.push(format!("chunk id {} is stored but not indexed", id.value())),
            }
        }
    }
    for (id, (hash, _)) in indexed {
        problems.push(format!(
            "chunk {} (id {id}) is indexed but not stored",
            hex(&hash)
        ));
    }

    let ctx = || "reading table refs".to_owned();
    if let Some(refs) = open_optional(txn, LEGACY_REFS)? {
        for entry in refs.range::<&[u8; 32]>(..).context(ctx)? {
            let (id, uses) = entry.context(ctx)?;
            let (id, uses) = (*id.value(), uses.value());
            let want = expected.legacy.remove(&id).unwrap_or(0);
            if want != uses {
                problems.push(format!(
                    "format 1 chunk {} has {uses} references recorded, {want} in manifests",
                    hex(&id)
                ));
            }
        }
        let ctx = || "reading table chunks".to_owned();
        if let Some(chunks) = open_optional(txn, LEGACY_CHUNKS)? {
            for entry in chunks.range::<&[u8; 32]>(..).context(ctx)? {
                let (id, value) = entry.context(ctx)?;
                bytes += value.value().len() as u64;
                count += 1;
                if refs.get(id.value()).context(ctx)?.is_none() {
                    problems.push(format!(
                        "format 1 chunk {} is stored but unreferenced",
                        hex(id.value())
                    ));
                }
            }
        }
    }
    for id in expected.legacy.keys() {
        problems.push(format!(
            "format 1 chunk {} is used but has no reference count",
            hex(id)
        ));
    }

    let ctx = || "reading table packed".to_owned();
    let packed = txn.open_table(PACKED).context(ctx)?;
    for entry in packed.range::<(u64, u32)>(..).context(ctx)? {
        let (_, value) = entry.context(ctx)?;
        bytes += value.value().len() as u64;
    }
    let meta = txn
        .open_table(META)
        .context(|| "opening table meta".to_owned())?;
    for (key, actual) in [(META_STORED_BYTES, bytes), (META_STORED_CHUNKS, count)] {
        let recorded = meta_u64(&meta, key)?;
        if recorded != actual {
            problems.push(format!(
                "meta {key} says {recorded}, the chunks hold {actual}"
            ));
        }
    }
    Ok((problems, staged_chunks))
}
