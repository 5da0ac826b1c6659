//! The frozen classes results cross the boundary as (re-exported by the
//! `ckptstore` package under the same names). Each also reads by key,
//! `report["steps_pushed"]`, as the dicts of 0.3 did.

use std::collections::BTreeMap;

use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

/// A frozen class of read-only fields with a repr and `obj["field"]`.
macro_rules! result_class {
    ($(#[$meta:meta])* $name:ident { $($(#[$fmeta:meta])* $field:ident: $ty:ty),* $(,)? }) => {
        $(#[$meta])*
        #[pyclass(frozen, get_all, eq, module = "ckptstore")]
        #[derive(Clone, Debug, PartialEq)]
        pub(crate) struct $name {
            $($(#[$fmeta])* pub(crate) $field: $ty,)*
        }

        #[pymethods]
        impl $name {
            fn __repr__(&self) -> String {
                let fields: Vec<String> =
                    vec![$(format!("{}={:?}", stringify!($field), self.$field)),*];
                format!("{}({})", stringify!($name), fields.join(", "))
            }

            /// The field named `key`.
            fn __getitem__(&self, py: Python<'_>, key: &str) -> PyResult<Py<PyAny>> {
                match key {
                    $(stringify!($field) => self.$field.clone().into_py_any(py),)*
                    _ => Err(PyKeyError::new_err(key.to_owned())),
                }
            }
        }
    };
}

result_class! {
    /// What a save did.
    CommitInfo {
        step: u64,
        bytes_written: u64,
        bytes_reused: u64,
        logical_bytes: u64,
        removed: Vec<u64>,
        seconds: f64,
    }
}

impl From<&ckptstore::CommitInfo> for CommitInfo {
    fn from(i: &ckptstore::CommitInfo) -> Self {
        CommitInfo {
            step: i.step,
            bytes_written: i.bytes_written,
            bytes_reused: i.bytes_reused,
            logical_bytes: i.logical_bytes,
            removed: i.removed.clone(),
            seconds: i.duration.as_secs_f64(),
        }
    }
}

result_class! {
    /// What a verification found: `ok` when nothing is damaged.
    VerifyReport {
        ok: bool,
        steps_ok: u64,
        bytes_checked: u64,
        /// The damaged steps.
        damaged: Vec<u64>,
        /// Steps a writer removed while the verification ran (not checked,
        /// not damage).
        steps_gone: Vec<u64>,
        /// Why `ok` is false, one line each: every damaged step with its
        /// error, then every accounting problem (empty when `ok`).
        problems: Vec<String>,
        /// Disagreements between reference counts, chunks and manifests.
        accounting: Vec<String>,
        /// Chunks staged by a large commit under way or interrupted.
        staged_chunks: u64,
        /// Pack files the store records.
        pack_files: u64,
        /// Unrecorded pack files no commit under way can have written
        /// (not damage).
        stray_pack_files: u64,
        /// Pack files of commits under way (or killed before committing)
        /// when the verification began (not damage).
        in_flight_pack_files: u64,
    }
}

impl From<&ckptstore::VerifyReport> for VerifyReport {
    fn from(r: &ckptstore::VerifyReport) -> Self {
        VerifyReport {
            ok: r.is_ok(),
            steps_ok: r.steps_ok,
            bytes_checked: r.bytes_checked,
            damaged: r.damaged.iter().map(|(s, _)| *s).collect(),
            steps_gone: r.steps_gone.clone(),
            problems: r.problems(),
            accounting: r.accounting.clone(),
            staged_chunks: r.staged_chunks,
            pack_files: r.pack_files,
            stray_pack_files: r.stray_pack_files,
            in_flight_pack_files: r.in_flight_pack_files,
        }
    }
}

result_class! {
    /// What a store holds.
    StoreStats {
        steps: u64,
        logical_bytes: u64,
        stored_bytes: u64,
        chunks: u64,
        file_bytes: u64,
        allocated_bytes: u64,
        pack_files: u64,
        pack_bytes: u64,
        dedup_ratio: f64,
    }
}

impl From<&ckptstore::StoreStats> for StoreStats {
    fn from(s: &ckptstore::StoreStats) -> Self {
        StoreStats {
            steps: s.steps,
            logical_bytes: s.logical_bytes,
            stored_bytes: s.stored_bytes,
            chunks: s.chunks,
            file_bytes: s.file_bytes,
            allocated_bytes: s.allocated_bytes,
            pack_files: s.pack_files,
            pack_bytes: s.pack_bytes,
            dedup_ratio: s.dedup_ratio(),
        }
    }
}

result_class! {
    /// A stored step's metadata, read without its data: its metrics, each
    /// untyped blob's length, each tensor's dtype, shape and length
    /// (`EntryInfo`) and how the step was saved.
    StepInfo {
        step: u64,
        timestamp: u64,
        metrics: BTreeMap<String, f64>,
        blobs: BTreeMap<String, u64>,
        tensors: BTreeMap<String, EntryInfo>,
        save_record: crate::record::SaveRecord,
    }
}

impl From<ckptstore::StepInfo> for StepInfo {
    fn from(i: ckptstore::StepInfo) -> Self {
        StepInfo {
            step: i.step,
            timestamp: i.timestamp,
            metrics: i.metrics,
            blobs: i.blobs,
            tensors: i
                .tensors
                .into_iter()
                .map(|(name, t)| {
                    let info = EntryInfo {
                        dtype: Some(t.dtype.to_string()),
                        shape: Some(t.shape),
                        len: t.bytes,
                    };
                    (name, info)
                })
                .collect(),
            save_record: crate::record::SaveRecord(i.save_record),
        }
    }
}

result_class! {
    /// What a push did.
    PushReport {
        steps_pushed: Vec<u64>,
        steps_present: u64,
        bytes_uploaded: u64,
        raw_bytes_uploaded: u64,
        bytes_skipped: u64,
    }
}

impl From<&ckptstore::PushReport> for PushReport {
    fn from(r: &ckptstore::PushReport) -> Self {
        PushReport {
            steps_pushed: r.steps_pushed.clone(),
            steps_present: r.steps_present,
            bytes_uploaded: r.bytes_uploaded,
            raw_bytes_uploaded: r.raw_bytes_uploaded,
            bytes_skipped: r.bytes_skipped,
        }
    }
}

result_class! {
    /// What a Hugging Face export wrote.
    HfExport {
        shards: Vec<String>,
        weight_map: BTreeMap<String, String>,
        total_size: u64,
    }
}

impl From<ckptstore::HfExport> for HfExport {
    fn from(e: ckptstore::HfExport) -> Self {
        HfExport {
            shards: e.shards,
            weight_map: e.weight_map,
            total_size: e.total_size,
        }
    }
}

/// The dtype an export casts floating tensors to: `bf16`, `f16`, `f32`
/// (or `torch.bfloat16`, ... by their names), or none.
pub(crate) fn cast(name: Option<&str>) -> PyResult<Option<ckptstore::Dtype>> {
    let Some(name) = name else { return Ok(None) };
    let bare = name.strip_prefix("torch.").unwrap_or(name);
    ckptstore::cast_dtype(bare).map(Some).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "dtype {name:?}: an export casts to bf16, f16 or f32"
        ))
    })
}

result_class! {
    /// Where background replication stands.
    ReplicationStatus {
        url: String,
        pending: Vec<u64>,
        running: bool,
        steps_uploaded: u64,
        bytes_uploaded: u64,
        consecutive_failures: u32,
        last_error: Option<String>,
    }
}

impl From<ckptstore::ReplicationStatus> for ReplicationStatus {
    fn from(s: ckptstore::ReplicationStatus) -> Self {
        ReplicationStatus {
            url: s.url,
            pending: s.pending,
            running: s.running,
            steps_uploaded: s.steps_uploaded,
            bytes_uploaded: s.bytes_uploaded,
            consecutive_failures: s.consecutive_failures,
            last_error: s.last_error,
        }
    }
}

result_class! {
    /// What a shard's save did: `complete` once every rank's shard is in.
    ShardInfo {
        step: u64,
        rank: u32,
        world_size: u32,
        bytes_uploaded: u64,
        bytes_skipped: u64,
        complete: bool,
        /// The shard's name (the hash of its manifest).
        shard: String,
    }
}

impl From<&ckptstore::ShardInfo> for ShardInfo {
    fn from(i: &ckptstore::ShardInfo) -> Self {
        ShardInfo {
            step: i.step,
            rank: i.rank,
            world_size: i.world_size,
            bytes_uploaded: i.bytes_uploaded,
            bytes_skipped: i.bytes_skipped,
            complete: i.complete,
            shard: i.shard.to_string(),
        }
    }
}

result_class! {
    /// An entry of a rank's shard: its dtype name and shape (a tensor's;
    /// None for a blob) and its length in bytes.
    EntryInfo {
        dtype: Option<String>,
        shape: Option<Vec<u64>>,
        len: u64,
    }
}

result_class! {
    /// Which ranks of a global step's newest save have landed.
    ShardStatus {
        step: u64,
        world_size: Option<u32>,
        save: Option<String>,
        saves: usize,
        landed: Vec<u32>,
        missing: Vec<u32>,
        complete: bool,
    }
}

impl From<ckptstore::ShardStatus> for ShardStatus {
    fn from(s: ckptstore::ShardStatus) -> Self {
        ShardStatus {
            step: s.step,
            world_size: s.world_size,
            save: s.save.map(|id| id.to_string()),
            saves: s.saves,
            landed: s.landed,
            missing: s.missing,
            complete: s.complete,
        }
    }
}

/// Add the classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CommitInfo>()?;
    m.add_class::<VerifyReport>()?;
    m.add_class::<StoreStats>()?;
    m.add_class::<StepInfo>()?;
    m.add_class::<crate::record::SaveRecord>()?;
    m.add_class::<PushReport>()?;
    m.add_class::<HfExport>()?;
    m.add_class::<ReplicationStatus>()?;
    m.add_class::<ShardInfo>()?;
    m.add_class::<ShardStatus>()?;
    m.add_class::<EntryInfo>()
}
