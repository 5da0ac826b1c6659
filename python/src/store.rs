//! The store, as Python sees it: `RawStore`, wrapped by `ckptstore.Store`.

use std::collections::BTreeMap;

use ckptstore::{CheckpointStore, GradientCheckpoint, Remote, StoreOptions, TensorMut};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::borrow_disjoint_mut;
use crate::convert::{borrowed, ckpt_dict, dtype, given, owned, policy, step_of, PyTensor};
use crate::handle::Handle;
use crate::pieces::{for_python, ChunkSlice, Range};
use crate::results;
use crate::{py_err, CkptError};

/// A failure of the last flush before a store closes: a replication
/// failure says what becomes of the steps not uploaded (nothing retries
/// once the store is closed).
fn closing_error(e: ckptstore::Error) -> PyErr {
    match e {
        ckptstore::Error::Bucket(ckptstore::BucketError::ReplicationFailed {
            url,
            steps,
            source,
        }) => CkptError::new_err(format!(
            "replication to {url} failed and the store is closing: steps {steps:?} are not \
             in the bucket; the next store opened with replicate_to on this file uploads \
             them (or run `ckpt push`): {source}"
        )),
        e => py_err(e),
    }
}

/// (ok, steps_ok, bytes_checked, damaged steps)
/// An open store.
#[pyclass(module = "ckptstore._ckptstore", name = "RawStore")]
pub(crate) struct RawStore {
    store: Option<CheckpointStore>,
}

impl RawStore {
    pub(crate) fn get(&self) -> PyResult<&CheckpointStore> {
        self.store
            .as_ref()
            .ok_or_else(|| CkptError::new_err("the store is closed"))
    }
}

#[pymethods]
impl RawStore {
    #[new]
    #[pyo3(signature = (path, read_only=false, cache_size=None, replicate_to=None, threads=None, background_threads=None, pack_files=true))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        read_only: bool,
        cache_size: Option<usize>,
        replicate_to: Option<String>,
        threads: Option<usize>,
        background_threads: Option<usize>,
        pack_files: bool,
    ) -> PyResult<Self> {
        let mut options = StoreOptions::new().pack_files(pack_files);
        if let Some(bytes) = cache_size {
            options = options.cache_size(bytes);
        }
        if let Some(n) = threads {
            options = options.threads(n);
        }
        if let Some(n) = background_threads {
            options = options.background_threads(n);
        }
        if let Some(url) = replicate_to {
            options = options.replicate_to(Remote::open(&url).map_err(py_err)?);
        }
        let store = py
            .detach(|| {
                if read_only {
                    options.open_read_only(&path)
                } else {
                    options.open(&path)
                }
            })
            .map_err(py_err)?;
        Ok(RawStore { store: Some(store) })
    }

    /// Commit a step from the arrays' own memory; durable when it returns.
    /// With `replace`, a stored step of that number is replaced in the
    /// same transaction.
    #[pyo3(signature = (step, tensors, blobs, metrics, replace = false, record = None))]
    #[allow(clippy::too_many_arguments)] // Python's keywords
    fn save<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        tensors: BTreeMap<String, Py<PyTensor>>,
        blobs: BTreeMap<String, Vec<u8>>,
        metrics: BTreeMap<String, f64>,
        replace: bool,
        record: Option<PyRef<'py, crate::record::SaveRecord>>,
    ) -> PyResult<results::CommitInfo> {
        let ckpt = GradientCheckpoint::from(step_of(step, blobs, metrics, record.as_deref()));
        let tensors = given(py, &tensors);
        let borrowed = borrowed(&tensors)?;
        let store = self.get()?;
        let info = py
            .detach(|| {
                if replace {
                    store.replace_borrowed(&ckpt, &borrowed)
                } else {
                    store.commit_borrowed(&ckpt, &borrowed)
                }
            })
            .map_err(py_err)?;
        Ok((&info).into())
    }

    /// Copy the arrays now (a snapshot), then commit in the background.
    #[pyo3(signature = (step, tensors, blobs, metrics, record = None))]
    fn save_async(
        &self,
        py: Python<'_>,
        step: u64,
        tensors: BTreeMap<String, Py<PyTensor>>,
        blobs: BTreeMap<String, Vec<u8>>,
        metrics: BTreeMap<String, f64>,
        record: Option<PyRef<'_, crate::record::SaveRecord>>,
    ) -> PyResult<Handle> {
        let ckpt = GradientCheckpoint::from(owned(
            step,
            &given(py, &tensors),
            blobs,
            metrics,
            record.as_deref(),
        )?);
        let handle = self.get()?.commit_async(ckpt).map_err(py_err)?;
        Ok(Handle::new(handle))
    }

    /// Wait for every background save.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.get()?;
        py.detach(|| store.flush()).map_err(py_err)
    }

    /// A step as a dict (step, timestamp, loss_cid, metrics, tensors: name
    /// -> (dtype, shape, Buffer), blobs: name -> Buffer), or None: the
    /// latest if `step` is None.
    #[pyo3(signature = (step=None))]
    fn load<'py>(
        &self,
        py: Python<'py>,
        step: Option<u64>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let store = self.get()?;
        let ckpt = py
            .detach(|| match step {
                Some(s) => store.get(s),
                None => store.latest(),
            })
            .map_err(py_err)?;
        ckpt.map(|c| ckpt_dict(py, c)).transpose()
    }

    /// Like `load`, with each of `targets` whose dtype and shape are the
    /// stored tensor's read straight into its array: the dict without
    /// those, its "filled" the names filled; or None.
    fn load_into<'py>(
        &self,
        py: Python<'py>,
        step: Option<u64>,
        targets: BTreeMap<String, Py<PyTensor>>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let targets = given(py, &targets);
        let arrays: Vec<&Bound<'py, PyAny>> = targets.iter().map(|t| &t.data).collect();
        let buffers = borrow_disjoint_mut(&arrays)?;
        let mut into = Vec::with_capacity(targets.len());
        for (t, data) in targets.iter().zip(buffers) {
            let dt = dtype(&t.name, &t.dtype)?;
            let t = TensorMut::new(t.name.clone(), dt, t.shape.clone(), data)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
            into.push(t);
        }
        let store = self.get()?;
        let ckpt = py
            .detach(|| store.get_into(step, &mut into))
            .map_err(py_err)?;
        let filled: Vec<String> = into
            .iter()
            .filter(|t| t.filled())
            .map(|t| t.name().to_owned())
            .collect();
        let Some(c) = ckpt else {
            return Ok(None);
        };
        let d = ckpt_dict(py, c)?;
        d.set_item("filled", filled)?;
        Ok(Some(d))
    }

    /// The store's UUID: it names the store's run in a bucket.
    fn store_id(&self, py: Python<'_>) -> PyResult<String> {
        let store = self.get()?;
        py.detach(|| store.store_id()).map_err(py_err)
    }

    fn steps(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        let store = self.get()?;
        py.detach(|| store.steps()).map_err(py_err)
    }

    fn latest_step(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        let store = self.get()?;
        py.detach(|| store.latest_step()).map_err(py_err)
    }

    fn contains(&self, py: Python<'_>, step: u64) -> PyResult<bool> {
        let store = self.get()?;
        py.detach(|| store.info(step).map(|i| i.is_some()))
            .map_err(py_err)
    }

    fn info(&self, py: Python<'_>, step: u64) -> PyResult<Option<results::StepInfo>> {
        let store = self.get()?;
        let info = py.detach(|| store.info(step)).map_err(py_err)?;
        Ok(info.map(Into::into))
    }

    /// The identity of step `step`'s content (hex), from its manifest.
    fn content_digest(&self, py: Python<'_>, step: u64) -> PyResult<Option<String>> {
        let store = self.get()?;
        let digest = py.detach(|| store.content_digest(step)).map_err(py_err)?;
        Ok(digest.map(|d| d.to_string()))
    }

    /// The bytes of blob `name` of step `step` (hash-checked), without
    /// reading the step's other entries; None if either is not stored.
    fn get_blob<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        name: &str,
    ) -> PyResult<Option<Bound<'py, pyo3::types::PyBytes>>> {
        let store = self.get()?;
        let got = py.detach(|| store.get_blob(step, name)).map_err(py_err)?;
        Ok(got.map(|b| pyo3::types::PyBytes::new(py, &b)))
    }

    /// Fill each of `arrays` with the bytes of step `step` from the start
    /// of its range of `ranges` (entry, offset; as many bytes as the array
    /// holds; only the chunks holding them read, each hash-checked first);
    /// False (nothing filled) if the step is not stored or, `digest`
    /// given, is another save of it.
    fn read_ranges<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        digest: Option<&str>,
        ranges: Vec<PyRef<'py, Range>>,
        arrays: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<bool> {
        let proved = self.read_ranges_proving(py, step, digest, ranges, arrays, Vec::new())?;
        Ok(proved.is_some())
    }

    /// Where the bytes of each of `ranges` of step `step` lie in the
    /// store's chunks: its slices, in order; None as `read_ranges` gives
    /// False.
    fn slices(
        &self,
        py: Python<'_>,
        step: u64,
        digest: Option<&str>,
        ranges: Vec<PyRef<'_, Range>>,
    ) -> PyResult<Option<Vec<Vec<ChunkSlice>>>> {
        let digest = content_digest(digest)?;
        let ranges = range_refs(&ranges);
        let store = self.get()?;
        let got = py
            .detach(|| store.slices(step, digest.as_ref(), &ranges))
            .map_err(py_err)?;
        Ok(got.map(for_python))
    }

    /// The chunk map of step `step` as bytes to send to a rank that does
    /// not hold it (`ChunkMap`); None as `read_ranges` gives False.
    fn chunk_map<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        digest: Option<&str>,
    ) -> PyResult<Option<Bound<'py, pyo3::types::PyBytes>>> {
        let digest = content_digest(digest)?;
        let store = self.get()?;
        let map = py
            .detach(|| store.chunk_map(step, digest.as_ref()))
            .map_err(py_err)?;
        Ok(map.map(|m| pyo3::types::PyBytes::new(py, &m)))
    }

    /// Like `read_ranges`, and the proofs of the slices of each of
    /// `proved`, back to back; None as `read_ranges` gives False.
    fn read_ranges_proving<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        digest: Option<&str>,
        ranges: Vec<PyRef<'py, Range>>,
        arrays: Vec<Bound<'py, PyAny>>,
        proved: Vec<PyRef<'py, Range>>,
    ) -> PyResult<Option<Vec<Bound<'py, pyo3::types::PyBytes>>>> {
        if ranges.len() != arrays.len() {
            return Err(PyValueError::new_err(format!(
                "{} ranges and {} arrays: one array a range",
                ranges.len(),
                arrays.len()
            )));
        }
        let digest = content_digest(digest)?;
        let arrays: Vec<&Bound<'py, PyAny>> = arrays.iter().collect();
        let buffers = borrow_disjoint_mut(&arrays)?;
        let sizes = ranges.iter().map(|r| r.as_crate()).zip(&buffers);
        if let Some(((name, at, len), out)) =
            sizes.into_iter().find(|(r, out)| r.2 != out.len() as u64)
        {
            return Err(PyValueError::new_err(format!(
                "the range of {len} bytes at {at} of {name:?} has an array of {} bytes",
                out.len()
            )));
        }
        let mut ranges: Vec<(&str, u64, &mut [u8])> = ranges
            .iter()
            .zip(buffers)
            .map(|(r, out)| (r.name(), r.offset(), out))
            .collect();
        let proved = range_refs(&proved);
        let store = self.get()?;
        let proofs = py
            .detach(|| store.read_ranges_proving(step, digest.as_ref(), &mut ranges, &proved))
            .map_err(py_err)?;
        Ok(proofs.map(|ps| {
            ps.iter()
                .map(|p| pyo3::types::PyBytes::new(py, p))
                .collect()
        }))
    }

    /// Commit directory `path` as step `step` (a step of files).
    fn save_dir(
        &self,
        py: Python<'_>,
        step: u64,
        path: std::path::PathBuf,
    ) -> PyResult<results::CommitInfo> {
        let store = self.get()?;
        let info = py.detach(|| store.save_dir(step, &path)).map_err(py_err)?;
        Ok((&info).into())
    }

    /// Write step `step`'s files into directory `path`: the paths written.
    fn load_dir(
        &self,
        py: Python<'_>,
        step: u64,
        path: std::path::PathBuf,
    ) -> PyResult<Vec<String>> {
        let store = self.get()?;
        py.detach(|| store.load_dir(step, &path)).map_err(py_err)
    }

    fn remove(&self, py: Python<'_>, step: u64) -> PyResult<bool> {
        let store = self.get()?;
        py.detach(|| store.remove(step)).map_err(py_err)
    }

    /// Apply a retention policy now; the steps removed.
    #[pyo3(signature = (keep_last=None, keep_every=None, allow_deleting_all=false))]
    fn gc(
        &self,
        py: Python<'_>,
        keep_last: Option<usize>,
        keep_every: Option<u64>,
        allow_deleting_all: bool,
    ) -> PyResult<Vec<u64>> {
        let policy = policy(keep_last, keep_every, allow_deleting_all)?;
        let store = self.get()?;
        py.detach(|| store.apply_retention(&policy)).map_err(py_err)
    }

    /// Delete the store at `path` with its pack files; false if there is
    /// none.
    #[staticmethod]
    fn remove_store(py: Python<'_>, path: std::path::PathBuf) -> PyResult<bool> {
        py.detach(|| CheckpointStore::remove_store(&path))
            .map_err(py_err)
    }

    /// Copy every step and pin into a new store at `path` (its pack files
    /// with it); the steps copied.
    fn copy_to(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<Vec<u64>> {
        let store = self.get()?;
        py.detach(|| store.copy_to(&path, StoreOptions::new()))
            .map_err(py_err)
    }

    /// Write step `step`, saved by ckptstore.dcp, to `path` as one
    /// safetensors file of whole tensors (under `prefix`, stripped); the
    /// names written.
    #[pyo3(signature = (step, path, prefix=None))]
    fn consolidate(
        &self,
        py: Python<'_>,
        step: u64,
        path: std::path::PathBuf,
        prefix: Option<String>,
    ) -> PyResult<Vec<String>> {
        let store = self.get()?;
        py.detach(|| store.consolidate(step, &path, prefix.as_deref()))
            .map_err(py_err)
    }

    /// Write step `step` into `directory` as a Hugging Face checkpoint
    /// (its DCP tensors whole for a step ckptstore.dcp saved, else its
    /// typed tensors); (shard files, weight map, total size).
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
        let store = self.get()?;
        let cast = crate::results::cast(dtype.as_deref())?;
        let done = py
            .detach(|| store.export_hf(step, &directory, max_shard_bytes, prefix.as_deref(), cast));
        Ok(done.map_err(py_err)?.into())
    }

    /// (ok, steps_ok, bytes_checked, damaged steps)
    fn verify(&self, py: Python<'_>) -> PyResult<results::VerifyReport> {
        let store = self.get()?;
        let report = py.detach(|| store.verify()).map_err(py_err)?;
        Ok((&report).into())
    }

    /// Where background replication stands, or None.
    fn replication_status(&self, py: Python<'_>) -> PyResult<Option<results::ReplicationStatus>> {
        let store = self.get()?;
        let status = py.detach(|| store.replication_status()).map_err(py_err)?;
        Ok(status.map(Into::into))
    }

    fn stats(&self, py: Python<'_>) -> PyResult<results::StoreStats> {
        let store = self.get()?;
        let s = py.detach(|| store.stats()).map_err(py_err)?;
        Ok((&s).into())
    }

    /// Finish background saves and close the store.
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        let result = match &self.store {
            Some(store) => py.detach(|| store.flush()).map_err(closing_error),
            None => Ok(()),
        };
        if let Some(store) = self.store.take() {
            py.detach(move || drop(store));
        }
        result
    }
}

/// A content digest as Python passes it (hex), decoded.
fn content_digest(digest: Option<&str>) -> PyResult<Option<ckptstore::ContentDigest>> {
    digest
        .map(|d| {
            ckptstore::ContentDigest::from_hex(d)
                .ok_or_else(|| PyValueError::new_err(format!("{d:?} is not a content digest")))
        })
        .transpose()
}

/// Ranges `(name, start, len)` as Python passes them, as the library
/// takes them.
fn range_refs<'a>(ranges: &'a [PyRef<'_, Range>]) -> Vec<(&'a str, u64, u64)> {
    ranges.iter().map(|r| r.as_crate()).collect()
}
