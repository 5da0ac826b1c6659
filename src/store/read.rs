//! Reading: get, latest, listing, info, summaries, stats.

use std::ops::RangeBounds;

use super::CheckpointStore;
use crate::checkpoint::Incoming;
use crate::engine::{StepData, View};
#[cfg(doc)]
use crate::Error;
use crate::{
    ContentDigest, Goal, GradientCheckpoint, Result, Retention, StepInfo, StepSummary, StoreStats,
    Tensor, TensorMut,
};

impl CheckpointStore {
    /// The checkpoint stored under `step`, or `None`.
    ///
    /// Every chunk's hash and the manifest's hash are checked: damaged data
    /// is an [`Error::Corrupt`] naming the step, never a wrong checkpoint.
    pub fn get(&self, step: u64) -> Result<Option<GradientCheckpoint>> {
        let what = || format!("reading step {step}");
        self.db.read_retrying(&what, |view| {
            view.manifest(step)?.map(|m| view.assemble(m)).transpose()
        })
    }

    /// Step `step` (the latest if `None`) with its tensors read straight
    /// into the caller's buffers: each of `targets` whose dtype and shape
    /// are the stored tensor's is filled in place (no allocation, no second
    /// copy; see [`TensorMut::filled`]) and left out of the checkpoint
    /// returned, which holds everything else. `None` (nothing filled) if the
    /// step is not stored.
    ///
    /// Every chunk is hash-checked before it is copied into a buffer. On an
    /// error a buffer may hold some of the step's bytes and some of its
    /// own, never bytes that failed a check.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, Dtype, GradientCheckpoint, Tensor, TensorMut};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 7);
    /// c.set_tensor("w", Tensor::new(Dtype::F32, vec![2], vec![1; 8])?);
    /// c.set_tensor("b", Tensor::new(Dtype::F32, vec![1], vec![2; 4])?);
    /// store.commit(&c)?;
    /// let (mut w, mut b) = ([0u8; 8], [0u8; 8]);
    /// let mut targets = [
    ///     TensorMut::new("w", Dtype::F32, vec![2], &mut w)?,
    ///     TensorMut::new("b", Dtype::F32, vec![2], &mut b)?, // not the stored shape
    /// ];
    /// let rest = store.get_into(Some(7), &mut targets)?.expect("stored");
    /// assert!(targets[0].filled() && !targets[1].filled());
    /// assert_eq!(rest.tensors.keys().collect::<Vec<_>>(), ["b"]);
    /// assert_eq!(w, [1; 8]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn get_into(
        &self,
        step: Option<u64>,
        targets: &mut [TensorMut<'_>],
    ) -> Result<Option<GradientCheckpoint>> {
        let what = || match step {
            Some(step) => format!("reading step {step}"),
            None => "reading the latest step".to_owned(),
        };
        self.db.read_retrying(&what, |view| {
            // Each attempt starts clean (a read runs again if a pack file
            // goes under it).
            for t in targets.iter_mut() {
                t.filled = false;
            }
            let manifest = match step {
                Some(step) => view.manifest(step)?,
                None => view.latest_manifest()?,
            };
            manifest.map(|m| view.assemble_into(m, targets)).transpose()
        })
    }

    /// The checkpoint with the highest step, or `None` for an empty store.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// assert_eq!(store.latest()?, None);
    /// for step in [10_000, 9_000] {
    ///     store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), step))?;
    /// }
    /// assert_eq!(store.latest()?.map(|c| c.step), Some(10_000));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn latest(&self) -> Result<Option<GradientCheckpoint>> {
        let what = || "reading the latest step".to_owned();
        self.db.read_retrying(&what, |view| {
            view.latest_manifest()?
                .map(|m| view.assemble(m))
                .transpose()
        })
    }

    /// The highest stored step, or `None` for an empty store. Reads no blob.
    pub fn latest_step(&self) -> Result<Option<u64>> {
        let what = || "reading the latest step number".to_owned();
        self.db.read_retrying(&what, View::latest_step)
    }

    /// The store's UUID, given when it was created (or taken from the
    /// bucket it was pulled from): it names the store's run in a bucket.
    pub fn store_id(&self) -> Result<String> {
        let what = || "reading the store id".to_owned();
        self.db.read_retrying(&what, View::store_id)
    }

    /// Every stored step, ascending.
    pub fn steps(&self) -> Result<Vec<u64>> {
        self.steps_in(..)
    }

    /// The stored steps within `range`, ascending.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for step in [5, 10, 15, 20] {
    ///     store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), step))?;
    /// }
    /// assert_eq!(store.steps_in(10..20)?, vec![10, 15]);
    /// assert_eq!(store.steps_in(..=10)?, vec![5, 10]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn steps_in(&self, range: impl RangeBounds<u64>) -> Result<Vec<u64>> {
        let what = || "listing steps".to_owned();
        let range = (range.start_bound().cloned(), range.end_bound().cloned());
        self.db.read_retrying(&what, |view| view.steps_in(range))
    }

    /// The metadata of `step` (graph size, loss CID, metrics, blob lengths)
    /// without reading its blobs.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 3);
    /// ckpt.set_optimizer_state("adam_v", vec![0; 1000]);
    /// store.commit(&ckpt)?;
    /// let info = store.info(3)?.expect("step 3 is stored");
    /// assert_eq!(info.blobs["adam_v"], 1000);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn info(&self, step: u64) -> Result<Option<StepInfo>> {
        self.with_step(step, |_, info, _| Ok(info))
    }

    /// The identity of step `step`'s content (its entries' names, dtypes,
    /// shapes and the hashes of their bytes), read from its manifest alone;
    /// `None` if the step is not stored. Two stores holding the same entries
    /// with the same bytes give the same digest, whatever the step's time or
    /// metrics: a copy of a step kept elsewhere is told from a stale one by
    /// it.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// let a = CheckpointStore::open(dir.path().join("a.ckpt"))?;
    /// let b = CheckpointStore::open(dir.path().join("b.ckpt"))?;
    /// let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 3);
    /// ckpt.set_optimizer_state("adam_v", vec![7; 3_000_000]);
    /// a.commit(&ckpt)?;
    /// b.commit(&ckpt.clone().with_metric("loss", 0.5))?;
    /// assert_eq!(a.content_digest(3)?, b.content_digest(3)?);
    /// assert_eq!(a.content_digest(4)?, None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn content_digest(&self, step: u64) -> Result<Option<ContentDigest>> {
        let what = || format!("reading the manifest of step {step}");
        self.db.read_retrying(&what, |view| {
            Ok(view
                .manifest(step)?
                .map(|m| ContentDigest(m.content_digest())))
        })
    }

    /// Run `f` on step `step`: its checkpoint without blob or tensor data,
    /// its metadata, and a reader of its blobs and tensors one at a time,
    /// all from one read transaction. `None` if the step is not stored.
    /// `f` runs again if a writer deletes a pack file under it: it must
    /// have no effect that a second run would get wrong
    /// ([`with_step_once`](Self::with_step_once) otherwise).
    pub(crate) fn with_step<T>(
        &self,
        step: u64,
        mut f: impl FnMut(GradientCheckpoint, StepInfo, &StepData<'_>) -> Result<T>,
    ) -> Result<Option<T>> {
        let what = || format!("reading step {step}");
        self.db
            .read_retrying(&what, |view| Self::on_step(view, step, &mut f))
    }

    /// [`with_step`](Self::with_step), run once: a pack file deleted under
    /// it is [`Error::ReadInterrupted`](crate::Error::ReadInterrupted).
    /// For an `f` whose effects outlive an attempt (a push records the
    /// chunks it is about to upload).
    #[cfg(feature = "remote")]
    pub(crate) fn with_step_once<T>(
        &self,
        step: u64,
        mut f: impl FnMut(GradientCheckpoint, StepInfo, &StepData<'_>) -> Result<T>,
    ) -> Result<Option<T>> {
        let what = || format!("reading step {step}");
        self.db
            .read(&what, |view| Self::on_step(view, step, &mut f))
    }

    /// One run of `f` on step `step` in `view`.
    fn on_step<T>(
        view: &crate::engine::View,
        step: u64,
        f: &mut impl FnMut(GradientCheckpoint, StepInfo, &StepData<'_>) -> Result<T>,
    ) -> Result<Option<T>> {
        let Some(manifest) = view.manifest(step)? else {
            return Ok(None);
        };
        let packed = manifest.packed.clone();
        let (ckpt, blobs, typed) = manifest.into_parts();
        let entries = blobs.iter().map(|(name, blob)| Incoming {
            name: name.clone(),
            len: blob.len,
            tensor: typed.get(name).cloned(),
        });
        let info = StepInfo::of(&ckpt, entries);
        let data = view.step_data(step, packed, blobs)?;
        f(ckpt, info, &data).map(Some)
    }

    /// The summaries (time, loss CID, metrics, sizes) of the steps in
    /// `range`, ascending, without reading manifests or blobs.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for (step, loss) in [(1, 0.9), (2, 0.4), (3, 0.6)] {
    ///     let c = GradientCheckpoint::new(ComputationGraphStore::new(), step).with_metric("loss", loss);
    ///     store.commit(&c)?;
    /// }
    /// let all = store.summaries(..)?;
    /// assert_eq!(all.len(), 3);
    /// assert_eq!(all[1].metrics["loss"], 0.4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn summaries(&self, range: impl RangeBounds<u64>) -> Result<Vec<StepSummary>> {
        let what = || "listing step summaries".to_owned();
        let range = (range.start_bound().cloned(), range.end_bound().cloned());
        self.db.read_retrying(&what, |view| view.summaries(range))
    }

    /// The step with the best value of `metric`, or `None` if no step has
    /// it. Ties go to the newer step.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Goal};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for (step, loss) in [(1, 0.9), (2, 0.4), (3, 0.6)] {
    ///     let c = GradientCheckpoint::new(ComputationGraphStore::new(), step).with_metric("loss", loss);
    ///     store.commit(&c)?;
    /// }
    /// assert_eq!(store.best_step("loss", Goal::Minimize)?, Some(2));
    /// assert_eq!(store.best_step("loss", Goal::Maximize)?, Some(1));
    /// assert_eq!(store.best_step("accuracy", Goal::Maximize)?, None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn best_step(&self, metric: &str, goal: Goal) -> Result<Option<u64>> {
        let best = self
            .summaries(..)?
            .into_iter()
            .filter_map(|s| s.metrics.get(metric).map(|&v| (v, s.step)))
            .max_by(|a, b| {
                let by_value = match goal {
                    Goal::Minimize => b.0.total_cmp(&a.0),
                    Goal::Maximize => a.0.total_cmp(&b.0),
                };
                by_value.then(a.1.cmp(&b.1))
            });
        Ok(best.map(|(_, step)| step))
    }

    /// One optimizer blob of `step`, read and hash-checked without the
    /// others. `None` if the step or the blob is not stored.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
    /// c.set_optimizer_state("adam_m", vec![1; 10]);
    /// c.set_optimizer_state("adam_v", vec![2; 10]);
    /// store.commit(&c)?;
    /// assert_eq!(store.get_blob(1, "adam_v")?, Some(vec![2; 10]));
    /// assert_eq!(store.get_blob(1, "nope")?, None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn get_blob(&self, step: u64, name: &str) -> Result<Option<Vec<u8>>> {
        let read = self.with_step(step, |_, info, data| {
            if info.blobs.contains_key(name) {
                data.read(name)
            } else {
                Ok(None)
            }
        })?;
        Ok(read.flatten())
    }

    /// One tensor of `step`, read and hash-checked without the rest. `None`
    /// if the step or the tensor is not stored.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, Dtype, GradientCheckpoint, Tensor};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
    /// c.set_tensor("w", Tensor::new(Dtype::BF16, vec![2, 2], vec![1; 8])?);
    /// store.commit(&c)?;
    /// let w = store.get_tensor(1, "w")?.expect("stored");
    /// assert_eq!((w.dtype, w.shape), (Dtype::BF16, vec![2, 2]));
    /// assert_eq!(store.get_tensor(1, "nope")?, None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn get_tensor(&self, step: u64, name: &str) -> Result<Option<Tensor>> {
        let read = self.with_step(step, |_, mut info, data| {
            let Some(t) = info.tensors.remove(name) else {
                return Ok(None);
            };
            // The length was checked against dtype and shape on decoding.
            Ok(data.read(name)?.map(|bytes| Tensor {
                dtype: t.dtype,
                shape: t.shape,
                data: bytes,
            }))
        })?;
        Ok(read.flatten())
    }

    /// The steps [`apply_retention`](Self::apply_retention) would delete
    /// now, without deleting them.
    pub fn retention_preview(&self, policy: &Retention) -> Result<Vec<u64>> {
        let what = || "previewing a retention policy".to_owned();
        self.db.read_retrying(&what, |view| {
            Ok(policy.doomed(&view.summaries(..)?, &view.pinned()?))
        })
    }

    /// The pinned steps, ascending.
    pub fn pinned(&self) -> Result<Vec<u64>> {
        let what = || "listing pinned steps".to_owned();
        self.db
            .read_retrying(&what, |view| Ok(view.pinned()?.into_iter().collect()))
    }

    /// Space and deduplication figures for the whole store.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// for step in 0..4 {
    ///     let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    ///     c.set_optimizer_state("frozen", vec![7; 100_000]);
    ///     store.commit(&c)?;
    /// }
    /// let stats = store.stats()?;
    /// assert_eq!(stats.steps, 4);
    /// assert_eq!(stats.logical_bytes, 400_000);
    /// assert_eq!(stats.stored_bytes, 100_000);
    /// assert_eq!(stats.dedup_ratio(), 4.0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn stats(&self) -> Result<StoreStats> {
        let what = || "reading store statistics".to_owned();
        let (summaries, (stored_bytes, chunks), (pack_files, pack_bytes)) =
            self.db.read_retrying(&what, |view| {
                Ok((view.summaries(..)?, view.counters()?, view.pack_totals()?))
            })?;
        Ok(StoreStats {
            allocated_bytes: self.db.allocated_bytes()?,
            steps: summaries.len() as u64,
            logical_bytes: summaries.iter().map(|s| s.logical_bytes).sum(),
            stored_bytes,
            chunks,
            file_bytes: std::fs::metadata(self.path()).map_or(0, |m| m.len()),
            pack_files,
            pack_bytes,
        })
    }

    /// Write step `step` to `path` as a safetensors file that every ML
    /// framework reads: typed tensors with their dtype and shape, untyped
    /// optimizer blobs as 1-D `U8` tensors, and the rest of the step in
    /// the file's metadata, so that
    /// [`import_safetensors`](Self::import_safetensors) gives the same
    /// checkpoint back. One tensor is in memory at a time; the file is
    /// written durably (temporary file, fsync, rename, fsync of the
    /// directory), and a failure leaves no file.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, Dtype, GradientCheckpoint, Tensor};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), 7).with_metric("loss", 0.5);
    /// c.set_tensor("w", Tensor::new(Dtype::F32, vec![2], vec![0; 8])?);
    /// c.set_optimizer_state("rng", vec![1, 2, 3]);
    /// store.commit(&c)?;
    /// let file = dir.path().join("step7.safetensors");
    /// store.export_safetensors(7, &file)?;
    /// store.remove(7)?;
    /// store.import_safetensors(&file, 7)?;
    /// assert_eq!(store.get(7)?, Some(c));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn export_safetensors(&self, step: u64, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        self.with_step(step, |skeleton, info, data| {
            crate::exchange::write::write(step, path, &skeleton, &info, data)
        })?
        .ok_or(crate::Error::StepNotFound { step })
    }

    /// Commit the safetensors file at `path` as step `step`: its tensors
    /// with their dtypes and shapes, and, for a file
    /// [`export_safetensors`](Self::export_safetensors) wrote, the rest of
    /// that step (blobs, metrics, graph, time).
    ///
    /// The header is read and checked before the store is touched; then
    /// the data is read front to back, a part of tensors in memory at a
    /// time (3/8 of the page cache, or the largest tensor): each part's
    /// chunks are hashed on every core and staged (as a large
    /// [`commit`](Self::commit) stages them), and the step appears
    /// with the last transaction. A failure part way deletes what was
    /// staged, so the store is as it was.
    ///
    /// # Errors
    /// [`Error::InvalidSafetensors`](crate::Error::InvalidSafetensors)
    /// naming the file and the problem (a header longer than the file or
    /// than 100 MB, invalid JSON or UTF-8, overlapping or gapped offsets,
    /// sizes not matching dtype x shape, unknown dtypes, duplicate names);
    /// then as [`commit`](Self::commit).
    pub fn import_safetensors(
        &self,
        path: impl AsRef<std::path::Path>,
        step: u64,
    ) -> Result<crate::CommitInfo> {
        let path = path.as_ref();
        let crate::exchange::read::Source { header, mut input } =
            crate::exchange::read::open(path, step)?;
        let mut read = |entry: &crate::checkpoint::Incoming| {
            crate::exchange::read::read_entry(&mut input, entry)
                .map_err(|e| crate::exchange::read::in_file(path, e))
        };
        super::commit::put_streamed(&self.db, header.skeleton, &header.entries, &mut read)
    }
}
