//! A bucket, as Python sees it: `RawRemote`, wrapped by `ckptstore.Remote`.

use std::collections::BTreeMap;
use std::time::Duration;

use ckptstore::{Remote, ShardHash, ShardSource, ShardWrite};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::Buffer;
use crate::global_step::RawGlobalStep;
use crate::pieces::{for_python, ChunkSlice, Piece};
use crate::py_err;
use crate::results;
use crate::shard::{shard_hash, ShardId, ShardUpload, ShardValues, StoreStep};

use crate::convert::{borrowed, ckpt_dict, policy, step_dict, step_of, Given};
use crate::store::RawStore;

/// A bucket (`s3://BUCKET/PREFIX` or `file:///DIR`).
#[pyclass(module = "ckptstore._ckptstore", name = "RawRemote")]
pub(crate) struct RawRemote {
    pub(crate) remote: Remote,
}

impl RawRemote {
    /// Upload rank `rank`'s shard from Python's arrays, hashed and
    /// uploaded from their own memory, as far as `how` says.
    fn shard_call(
        &self,
        py: Python<'_>,
        shard: (u64, u32, u32),
        tensors: &[Given<'_>],
        values: ckptstore::Step,
        how: ckptstore::ShardUpload,
        announce: Option<&Py<PyAny>>,
    ) -> PyResult<results::ShardInfo> {
        let borrowed = borrowed(tensors)?;
        let source = ShardSource::Borrowed(&values, &borrowed);
        self.write_announced(py, ShardWrite::new(shard, source, how), announce)
    }

    /// `write` uploaded (`Remote::write_shard`), or, with `announce` (a
    /// callable given the shard's name, answering every rank's or None),
    /// announced under its lock (`Remote::write_shard_announced`). An
    /// exception `announce` raises is raised here once the lock is given
    /// back.
    fn write_announced(
        &self,
        py: Python<'_>,
        write: ShardWrite<'_>,
        announce: Option<&Py<PyAny>>,
    ) -> PyResult<results::ShardInfo> {
        let step = write.step;
        let Some(announce) = announce else {
            let info = py
                .detach(|| self.remote.write_shard(write))
                .map_err(py_err)?;
            return Ok((&info).into());
        };
        let mut raised: Option<PyErr> = None;
        let mut tell = |name: ShardHash| -> Option<Vec<ShardHash>> {
            let told = Python::attach(|py| -> PyResult<Option<Vec<ShardHash>>> {
                let names: Option<Vec<String>> =
                    announce.call1(py, (name.to_string(),))?.extract(py)?;
                let decode = |(rank, n): (u32, &String)| shard_hash(step, rank, n).map_err(py_err);
                names
                    .map(|n| (0u32..).zip(&n).map(decode).collect())
                    .transpose()
            });
            told.unwrap_or_else(|e| {
                raised = Some(e);
                None
            })
        };
        let info = py.detach(|| self.remote.write_shard_announced(write, &mut tell));
        if let Some(e) = raised {
            return Err(e);
        }
        Ok((&info.map_err(py_err)?).into())
    }

    /// `step`, or the latest complete step.
    fn step_or_latest(&self, step: Option<u64>) -> ckptstore::Result<Option<u64>> {
        match step {
            Some(s) => Ok(Some(s)),
            None => self.remote.latest_step(),
        }
    }
}

#[pymethods]
impl RawRemote {
    #[new]
    #[pyo3(signature = (url, grace_period=None, compress=None))]
    fn new(url: &str, grace_period: Option<f64>, compress: Option<bool>) -> PyResult<Self> {
        let mut remote = Remote::open(url).map_err(py_err)?;
        if let Some(on) = compress {
            remote = remote.with_compression(on);
        }
        if let Some(secs) = grace_period {
            let grace = Duration::try_from_secs_f64(secs)
                .map_err(|e| PyValueError::new_err(format!("grace_period {secs}: {e}")))?;
            remote = remote.with_grace_period(grace);
        }
        Ok(RawRemote { remote })
    }

    fn compression(&self) -> bool {
        self.remote.compression()
    }

    /// This bucket, storing new chunks compressed or not, sharing what
    /// this remote knows of where chunks lie (`Remote::compressing`).
    fn compressing(&self, on: bool) -> PyResult<RawRemote> {
        let remote = self.remote.compressing(on).map_err(py_err)?;
        Ok(RawRemote { remote })
    }

    fn url(&self) -> String {
        self.remote.url().to_owned()
    }

    /// The id of the store whose run the prefix holds, or None.
    fn owner(&self, py: Python<'_>) -> PyResult<Option<String>> {
        py.detach(|| self.remote.owner()).map_err(py_err)
    }

    /// Make the prefix hold `store`'s run from now on.
    fn adopt(&self, py: Python<'_>, store: PyRef<'_, RawStore>) -> PyResult<()> {
        let store = store.get()?;
        py.detach(|| self.remote.adopt(store)).map_err(py_err)
    }

    /// Commit directory `path` as step `step` of the bucket (a step of files).
    fn save_dir(
        &self,
        py: Python<'_>,
        step: u64,
        path: std::path::PathBuf,
    ) -> PyResult<results::ShardInfo> {
        let info = py
            .detach(|| self.remote.save_dir(step, &path))
            .map_err(py_err)?;
        Ok((&info).into())
    }

    /// Write step `step`'s files into directory `path`: the paths written.
    fn load_dir(
        &self,
        py: Python<'_>,
        step: u64,
        path: std::path::PathBuf,
    ) -> PyResult<Vec<String>> {
        py.detach(|| self.remote.load_dir(step, &path))
            .map_err(py_err)
    }

    fn steps(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        py.detach(|| self.remote.steps()).map_err(py_err)
    }

    fn latest_step(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        py.detach(|| self.remote.latest_step()).map_err(py_err)
    }

    /// A complete step's metadata, or None; a global step of several ranks
    /// is refused (each rank's shard has its own).
    fn info(&self, py: Python<'_>, step: u64) -> PyResult<Option<results::StepInfo>> {
        let info = py.detach(|| self.remote.info(step)).map_err(py_err)?;
        Ok(info.map(Into::into))
    }

    /// A step as `RawStore.load` gives it (the latest if `step` is None).
    #[pyo3(signature = (step=None))]
    fn load<'py>(
        &self,
        py: Python<'py>,
        step: Option<u64>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let ckpt = py
            .detach(|| match self.step_or_latest(step)? {
                Some(s) => self.remote.get(s),
                None => Ok(None),
            })
            .map_err(py_err)?;
        ckpt.map(|c| ckpt_dict(py, c)).transpose()
    }

    /// Copy step `step` into `store`.
    fn pull<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        store: PyRef<'py, RawStore>,
    ) -> PyResult<results::CommitInfo> {
        let store = store.get()?;
        let info = py
            .detach(|| self.remote.pull(step, store))
            .map_err(py_err)?;
        Ok((&info).into())
    }

    /// Write shard `id` as far as `upload` says, its bytes from `source`:
    /// a `ShardValues` (Python's arrays hashed and uploaded from their own
    /// memory) or a `StoreStep` (a store's step, read and hashed in Rust).
    #[pyo3(signature = (id, upload, source, announce=None))]
    fn write_shard(
        &self,
        py: Python<'_>,
        id: PyRef<'_, ShardId>,
        upload: PyRef<'_, ShardUpload>,
        source: &Bound<'_, PyAny>,
        announce: Option<Py<PyAny>>,
    ) -> PyResult<results::ShardInfo> {
        let id: ShardId = *id;
        let then = upload.to_crate(id).map_err(py_err)?;
        if let Ok(values) = source.cast::<ShardValues>() {
            let values = values.get();
            let record = values.record.as_ref().map(|r| r.bind(py).get().clone());
            let step = step_of(
                id.step(),
                values.blobs.clone(),
                values.metrics.clone(),
                record.as_ref(),
            );
            return self.shard_call(
                py,
                id.triple(),
                &values.saved(py),
                step,
                then,
                announce.as_ref(),
            );
        }
        let Ok(from) = source.cast::<StoreStep>() else {
            return Err(PyTypeError::new_err(format!(
                "write_shard: the source is a ShardValues or a StoreStep, not {}",
                source.get_type().name()?
            )));
        };
        let from = from.get();
        let store = from.store.bind(py).borrow();
        let store = store.get()?;
        let source = ShardSource::StoreEdited {
            store,
            drop: &from.drop,
            add: &from.add,
        };
        self.write_announced(
            py,
            ShardWrite::new(id.triple(), source, then),
            announce.as_ref(),
        )
    }

    /// Upload every step of `store` the bucket lacks (with this remote's
    /// settings, such as its grace period).
    fn push<'py>(
        &self,
        py: Python<'py>,
        store: PyRef<'py, RawStore>,
    ) -> PyResult<results::PushReport> {
        let store = store.get()?;
        let r = py.detach(|| self.remote.push(store)).map_err(py_err)?;
        Ok((&r).into())
    }

    /// Complete global step `step` with exactly these shards, by rank
    /// (each checked there and whole; `reported`: trusted, as each rank
    /// reported it once its upload returned, and not read).
    #[pyo3(signature = (step, shards, reported=false))]
    fn commit_global(
        &self,
        py: Python<'_>,
        step: u64,
        shards: Vec<String>,
        reported: bool,
    ) -> PyResult<()> {
        let shards = ranks(&shards)
            .map(|(rank, name)| shard_hash(step, rank, name))
            .collect::<ckptstore::Result<Vec<_>>>()
            .map_err(py_err)?;
        py.detach(|| {
            if reported {
                self.remote.commit_reported(step, &shards)
            } else {
                self.remote.commit_global(step, &shards)
            }
        })
        .map_err(py_err)
    }

    /// Complete each step whose newest save has every rank's shard there
    /// but no commit (`Remote::complete_landed`): the steps completed.
    fn complete_landed(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        py.detach(|| self.remote.complete_landed()).map_err(py_err)
    }

    /// Step `step` opened for reading parts of it (its newest commit that
    /// checks out, or exactly `commit`); the newest complete step if
    /// `step` is None (one listing); or None.
    #[pyo3(signature = (step=None, commit=None))]
    fn open_global(
        &self,
        py: Python<'_>,
        step: Option<u64>,
        commit: Option<String>,
    ) -> PyResult<Option<RawGlobalStep>> {
        if step.is_none() && commit.is_some() {
            return Err(PyValueError::new_err(
                "open_global: a commit names a save of a step; give the step",
            ));
        }
        let global = py
            .detach(|| match (step, &commit) {
                (Some(step), Some(c)) => self.remote.open_global_commit(step, c),
                (Some(step), None) => self.remote.open_global(step),
                _ => self.remote.open_latest_global(),
            })
            .map_err(py_err)?;
        Ok(global.map(|inner| RawGlobalStep { inner }))
    }

    /// Rank `rank`'s entries of `opened` by name; its shard's manifest is
    /// read the first time.
    fn entries(
        &self,
        py: Python<'_>,
        opened: PyRef<'_, RawGlobalStep>,
        rank: u32,
    ) -> PyResult<BTreeMap<String, results::EntryInfo>> {
        let inner = &opened.inner;
        let entries = py
            .detach(|| self.remote.entries(inner, rank))
            .map_err(py_err)?;
        Ok(entries
            .into_iter()
            .map(|(name, e)| {
                let (dtype, shape) = e.tensor.map_or((None, None), |(d, s)| (Some(d), Some(s)));
                let len = e.len;
                (name, results::EntryInfo { dtype, shape, len })
            })
            .collect())
    }

    /// The DCP metadata document of `opened` (from the coordinator's
    /// shard), or None if ckptstore.dcp did not save it.
    fn dcp_metadata<'py>(
        &self,
        py: Python<'py>,
        opened: PyRef<'py, RawGlobalStep>,
    ) -> PyResult<Option<Bound<'py, pyo3::types::PyBytes>>> {
        let inner = &opened.inner;
        let got = py
            .detach(|| self.remote.dcp_metadata(inner))
            .map_err(py_err)?;
        Ok(got.map(|b| pyo3::types::PyBytes::new(py, &b)))
    }

    /// The bytes of each piece of `opened`, fetching only the chunks they
    /// overlap, each hash-checked.
    fn read_pieces(
        &self,
        py: Python<'_>,
        opened: PyRef<'_, RawGlobalStep>,
        pieces: Vec<PyRef<'_, Piece>>,
    ) -> PyResult<Vec<Buffer>> {
        let refs = piece_refs(&pieces);
        let inner = &opened.inner;
        let got = py
            .detach(|| self.remote.read_pieces(inner, &refs))
            .map_err(py_err)?;
        Ok(got.into_iter().map(Buffer::new).collect())
    }

    /// Like `read_pieces`, into `arrays` (writable, C-contiguous, one per
    /// piece and of its length; none sharing memory), each chunk's bytes
    /// copied straight into place once checked.
    fn read_pieces_into<'py>(
        &self,
        py: Python<'py>,
        opened: PyRef<'py, RawGlobalStep>,
        pieces: Vec<PyRef<'py, Piece>>,
        arrays: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        self.read_pieces_proving(py, opened, pieces, arrays, Vec::new())
            .map(drop)
    }

    /// Where the bytes of each piece of `opened` lie in the bucket's
    /// chunks: for each, its slices, in order.
    fn slices(
        &self,
        py: Python<'_>,
        opened: PyRef<'_, RawGlobalStep>,
        pieces: Vec<PyRef<'_, Piece>>,
    ) -> PyResult<Vec<Vec<ChunkSlice>>> {
        let refs = piece_refs(&pieces);
        let inner = &opened.inner;
        let got = py
            .detach(|| {
                refs.iter()
                    .map(|p| self.remote.slices(inner, p))
                    .collect::<ckptstore::Result<Vec<_>>>()
            })
            .map_err(py_err)?;
        Ok(for_python(got))
    }

    /// Like `read_pieces_into`, and the proofs of the slices of each of
    /// `proved` (ranges within the pieces), back to back.
    fn read_pieces_proving<'py>(
        &self,
        py: Python<'py>,
        opened: PyRef<'py, RawGlobalStep>,
        pieces: Vec<PyRef<'py, Piece>>,
        arrays: Vec<Bound<'py, PyAny>>,
        proved: Vec<PyRef<'py, Piece>>,
    ) -> PyResult<Vec<Bound<'py, pyo3::types::PyBytes>>> {
        let refs = piece_refs(&pieces);
        let proved = piece_refs(&proved);
        let arrays: Vec<&Bound<'py, PyAny>> = arrays.iter().collect();
        let mut outs = crate::arrays::borrow_disjoint_mut(&arrays)?;
        let inner = &opened.inner;
        let proofs = py
            .detach(|| {
                self.remote
                    .read_pieces_proving(inner, &refs, &mut outs, &proved)
            })
            .map_err(py_err)?;
        Ok(proofs
            .iter()
            .map(|p| pyo3::types::PyBytes::new(py, p))
            .collect())
    }

    /// Write DCP step `step` as one safetensors file of whole tensors (with
    /// `prefix`, only those under it, stripped); the names written.
    #[pyo3(signature = (step, path, prefix=None))]
    fn consolidate(
        &self,
        py: Python<'_>,
        step: u64,
        path: std::path::PathBuf,
        prefix: Option<String>,
    ) -> PyResult<Vec<String>> {
        py.detach(|| self.remote.consolidate(step, &path, prefix.as_deref()))
            .map_err(py_err)
    }

    /// Write DCP step `step` into `directory` as a Hugging Face checkpoint
    /// (shards of at most `max_shard_bytes`, the index); (shard files,
    /// weight map, total size).
    #[pyo3(signature = (step, directory, max_shard_bytes, prefix=None, dtype=None))]
    fn export_hf(
        &self,
        py: Python<'_>,
        step: u64,
        directory: std::path::PathBuf,
        max_shard_bytes: u64,
        prefix: Option<String>,
        dtype: Option<String>,
    ) -> PyResult<crate::results::HfExport> {
        let cast = crate::results::cast(dtype.as_deref())?;
        let done = py.detach(|| {
            self.remote
                .export_hf(step, &directory, max_shard_bytes, prefix.as_deref(), cast)
        });
        Ok(done.map_err(py_err)?.into())
    }

    /// Rank `rank`'s shard of `step` (the latest complete step if None).
    #[pyo3(signature = (rank, step=None))]
    fn load_shard<'py>(
        &self,
        py: Python<'py>,
        rank: u32,
        step: Option<u64>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let ckpt = py
            .detach(|| match self.step_or_latest(step)? {
                Some(s) => self.remote.get_shard(s, rank),
                None => Ok(None),
            })
            .map_err(py_err)?;
        ckpt.map(|s| step_dict(py, s, None)).transpose()
    }

    /// Which ranks of `step` have landed.
    fn shards(&self, py: Python<'_>, step: u64) -> PyResult<results::ShardStatus> {
        let s = py.detach(|| self.remote.shards(step)).map_err(py_err)?;
        Ok(s.into())
    }

    /// Verify every step in the bucket.
    fn verify(&self, py: Python<'_>) -> PyResult<results::VerifyReport> {
        let report = py.detach(|| self.remote.verify()).map_err(py_err)?;
        Ok((&report).into())
    }

    /// Apply a retention policy in the bucket; the steps removed.
    #[pyo3(signature = (keep_last=None, keep_every=None, allow_deleting_all=false))]
    fn gc(
        &self,
        py: Python<'_>,
        keep_last: Option<usize>,
        keep_every: Option<u64>,
        allow_deleting_all: bool,
    ) -> PyResult<Vec<u64>> {
        let policy = policy(keep_last, keep_every, allow_deleting_all)?;
        py.detach(|| self.remote.apply_retention(&policy))
            .map_err(py_err)
    }
}

/// The shard names of a global step as Python gives them (by rank), each
/// with its rank.
fn ranks(names: &[String]) -> impl Iterator<Item = (u32, &String)> {
    (0u32..).zip(names)
}

/// Pieces as Python passes them, as the library takes them.
fn piece_refs<'a>(pieces: &'a [PyRef<'_, Piece>]) -> Vec<ckptstore::Piece<'a>> {
    pieces.iter().map(|p| p.as_crate()).collect()
}
