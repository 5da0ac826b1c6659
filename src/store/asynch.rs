//! Asynchronous commits: a background writer with a bounded queue.

use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::commit::{put, Caller};
use super::CheckpointStore;
use crate::db::Db;
use crate::engine::plan::Borrowed;
use crate::{CommitInfo, Error, GradientCheckpoint, Result};

/// The error of a handle whose writer stopped before reporting.
fn writer_stopped(step: u64, why: &str) -> Error {
    Error::AsyncCommitFailed {
        steps: vec![step],
        source: Box::new(Error::WriterStopped {
            detail: why.to_owned(),
        }),
    }
}

/// Lock `m`; a panic that poisoned it (in this crate's writer thread) is
/// reported, not ignored.
fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> Result<MutexGuard<'a, T>> {
    m.lock()
        .map_err(|_| writer_stopped(0, &format!("the background writer panicked ({what})")))
}

/// The outcome of one [`CheckpointStore::commit_async`], to wait for.
///
/// Dropping a handle does not cancel the commit; its outcome is then
/// reported only by [`CheckpointStore::flush`] (if it failed). A failure
/// is delivered once, to whichever asks first: the handle
/// ([`wait`](Self::wait), [`try_wait`](Self::try_wait)), whose error is the
/// commit's own, or `flush`, after which the handle's error says that
/// `flush` reported it.
#[must_use = "a commit's failure is reported through its handle or flush()"]
pub struct CommitHandle {
    step: u64,
    /// Which job: its failure, once delivered here, leaves `flush`'s list.
    job: u64,
    progress: Arc<(Mutex<Progress>, Condvar)>,
    reply: Receiver<Reply>,
}

/// What a handle hears from the writer: the commit's info, or that it
/// failed (the error waits in the writer's list, to be taken once: by the
/// handle, or by `flush` if the handle never asks).
enum Reply {
    Done(CommitInfo),
    Failed,
}

impl std::fmt::Debug for CommitHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommitHandle")
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

impl CommitHandle {
    /// The step being committed.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Block until the commit is done: `Ok` once the step is durable (with
    /// the store's durability) and visible to readers.
    pub fn wait(self) -> Result<CommitInfo> {
        let reply = self.reply.recv();
        self.delivered(reply.ok())
    }

    /// What `reply` says, for the caller: a failure is taken out of the
    /// writer's list (`flush` does not report it again); one `flush`
    /// already reported says so.
    fn delivered(&self, reply: Option<Reply>) -> Result<CommitInfo> {
        let stopped =
            || writer_stopped(self.step, "the background writer stopped before reporting");
        match reply {
            Some(Reply::Done(info)) => Ok(info),
            Some(Reply::Failed) => {
                let mut p = lock(&self.progress.0, "reporting a failure")?;
                match p.failed.iter().position(|f| f.job == self.job) {
                    Some(i) => Err(p.failed.remove(i).error),
                    None => Err(writer_stopped(
                        self.step,
                        "the commit failed; flush() reported the failure",
                    )),
                }
            }
            None => Err(stopped()),
        }
    }

    /// The outcome if the commit is done, without blocking; otherwise the
    /// handle back.
    pub fn try_wait(self) -> std::result::Result<Result<CommitInfo>, CommitHandle> {
        match self.reply.try_recv() {
            Ok(reply) => Ok(self.delivered(Some(reply))),
            Err(mpsc::TryRecvError::Empty) => Err(self),
            Err(mpsc::TryRecvError::Disconnected) => Ok(self.delivered(None)),
        }
    }
}

struct Job {
    /// Numbers the job, for its handle.
    id: u64,
    ckpt: GradientCheckpoint,
    /// Keep the checkpoint's buffers for the next
    /// [`commit_async_copy`](CheckpointStore::commit_async_copy).
    recycle: bool,
    reply: SyncSender<Reply>,
}

/// Commits queued or running, and failures not yet reported by `flush`
/// or their handle.
#[derive(Default)]
struct Progress {
    in_flight: usize,
    /// The id the next job gets.
    next_job: u64,
    failed: Vec<Failure>,
}

/// A background commit that failed.
struct Failure {
    job: u64,
    step: u64,
    error: Error,
}

/// Commit one job, then count it done and report its outcome.
fn commit_job(
    db: &Db,
    job: Job,
    progress: &(Mutex<Progress>, Condvar),
    spare: &Mutex<Option<GradientCheckpoint>>,
) {
    let step = job.ckpt.step;
    let done = Done {
        progress,
        job: job.id,
        step,
    };
    let outcome = put(db, &job.ckpt, &Borrowed::new(), false, Caller::Background);
    if job.recycle {
        // One spare at most: a burst of copies does not leave a pile of
        // idle buffers behind.
        if let Ok(mut slot) = spare.lock() {
            slot.get_or_insert(job.ckpt);
        }
    } else {
        drop(job.ckpt); // free the blobs before reporting
    }
    let reply = match outcome {
        Ok(info) => Reply::Done(info),
        Err(error) => {
            // Kept for whoever asks first: the handle, or flush.
            if let Ok(mut p) = progress.0.lock() {
                p.failed.push(Failure {
                    job: job.id,
                    step,
                    error,
                });
            }
            Reply::Failed
        }
    };
    drop(done);
    // The caller may have dropped its handle: fine.
    let _ = job.reply.send(reply);
}

/// Counts a job done when dropped, also if the commit panicked (a bug in
/// this crate: the failure is recorded, so `flush` reports it instead of
/// waiting for ever).
struct Done<'a> {
    progress: &'a (Mutex<Progress>, Condvar),
    job: u64,
    step: u64,
}

impl Drop for Done<'_> {
    fn drop(&mut self) {
        let (mutex, cvar) = self.progress;
        // Only a counter and a list are kept under this lock: a panic
        // elsewhere leaves them consistent.
        let mut p = mutex
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if std::thread::panicking() {
            let e = Error::WriterStopped {
                detail: "the background writer panicked".into(),
            };
            p.failed.push(Failure {
                job: self.job,
                step: self.step,
                error: e,
            });
        }
        p.in_flight = p.in_flight.saturating_sub(1);
        cvar.notify_all();
    }
}

/// The background writer: one thread committing jobs in queue order.
pub(crate) struct AsyncWriter {
    queue: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<()>>,
    progress: Arc<(Mutex<Progress>, Condvar)>,
    /// A committed checkpoint whose buffers the next copy fills.
    spare: Arc<Mutex<Option<GradientCheckpoint>>>,
}

impl AsyncWriter {
    fn start(db: Arc<Db>, depth: usize) -> Result<Self> {
        let (queue, jobs) = mpsc::sync_channel::<Job>(depth);
        let progress: Arc<(Mutex<Progress>, Condvar)> = Arc::default();
        let shared = progress.clone();
        let spare: Arc<Mutex<Option<GradientCheckpoint>>> = Arc::default();
        let spare_slot = spare.clone();
        let path = db.path().to_owned();
        let thread = std::thread::Builder::new()
            .name("ckptstore-writer".into())
            .spawn(move || {
                for job in jobs {
                    commit_job(&db, job, &shared, &spare_slot);
                }
            })
            .map_err(|e| Error::io("start the background writer of", path, e))?;
        Ok(AsyncWriter {
            queue: Some(queue),
            thread: Some(thread),
            progress,
            spare,
        })
    }

    /// A copy of `ckpt` in the spare checkpoint's buffers (allocated and
    /// paged in by an earlier copy), or in new ones.
    fn copy(&self, ckpt: &GradientCheckpoint) -> GradientCheckpoint {
        let spare = self.spare.lock().ok().and_then(|mut s| s.take());
        let Some(mut out) = spare else {
            return ckpt.clone();
        };
        out.step = ckpt.step;
        out.timestamp = ckpt.timestamp;
        out.loss_cid.clone_from(&ckpt.loss_cid);
        out.metrics.clone_from(&ckpt.metrics);
        out.graph.clone_from(&ckpt.graph);
        out.tensors
            .retain(|name, _| ckpt.tensors.contains_key(name));
        for (name, t) in &ckpt.tensors {
            match out.tensors.get_mut(name) {
                Some(mine) => mine.clone_from(t),
                None => {
                    out.tensors.insert(name.clone(), t.clone());
                }
            }
        }
        let state = &mut out.optimizer_state;
        state.retain(|name, _| ckpt.optimizer_state.contains_key(name));
        for (name, blob) in &ckpt.optimizer_state {
            match state.get_mut(name) {
                // Vec::clone_from keeps the allocation when it is big enough.
                Some(buf) => buf.clone_from(blob),
                None => {
                    state.insert(name.clone(), blob.clone());
                }
            }
        }
        out
    }

    fn submit(&self, ckpt: GradientCheckpoint, recycle: bool) -> Result<CommitHandle> {
        let step = ckpt.step;
        let (reply, outcome) = mpsc::sync_channel(1);
        let job = {
            let mut p = lock(&self.progress.0, "counting commits")?;
            p.in_flight += 1;
            p.next_job += 1;
            p.next_job
        };
        let sent = self.queue.as_ref().is_some_and(|q| {
            q.send(Job {
                id: job,
                ckpt,
                recycle,
                reply,
            })
            .is_ok()
        });
        if !sent {
            lock(&self.progress.0, "counting commits")?.in_flight -= 1;
            self.progress.1.notify_all();
            return Err(writer_stopped(step, "the background writer has stopped"));
        }
        Ok(CommitHandle {
            step,
            job,
            progress: self.progress.clone(),
            reply: outcome,
        })
    }

    fn flush(&self) -> Result<()> {
        let (mutex, cvar) = &*self.progress;
        let mut p = lock(mutex, "waiting for commits")?;
        while p.in_flight > 0 {
            p = cvar
                .wait(p)
                .map_err(|_| writer_stopped(0, "the background writer panicked"))?;
        }
        let failed = std::mem::take(&mut p.failed);
        let steps: Vec<u64> = failed.iter().map(|f| f.step).collect();
        match failed.into_iter().next() {
            None => Ok(()),
            Some(first) => Err(Error::AsyncCommitFailed {
                steps,
                source: Box::new(first.error),
            }),
        }
    }
}

impl Drop for AsyncWriter {
    /// Finish every queued commit, then stop the thread.
    fn drop(&mut self) {
        drop(self.queue.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl CheckpointStore {
    /// Queue `ckpt` for commit on a background thread and return at once,
    /// so training goes on while the checkpoint is written. The checkpoint
    /// is moved, not copied.
    ///
    /// Commits run one at a time in the order they were queued, each with
    /// every guarantee of [`commit`](Self::commit); a step is visible to
    /// readers (`latest_step`, `get`) only once its commit is complete. When
    /// [`StoreOptions::async_queue_depth`](crate::StoreOptions::async_queue_depth)
    /// commits are waiting, this call blocks until one finishes
    /// (backpressure). Dropping the store finishes every queued commit.
    ///
    /// # Errors
    /// Invalid checkpoints and read-only stores are refused here; a failure
    /// of the commit itself is reported by [`CommitHandle::wait`] and by
    /// [`flush`](Self::flush).
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut handles = Vec::new();
    /// for step in 0..4 {
    ///     let mut ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    ///     ckpt.set_optimizer_state("adam_m", vec![step as u8; 1 << 20]);
    ///     handles.push(store.commit_async(ckpt)?); // returns before the write
    ///     // ... the next training step runs here ...
    /// }
    /// for handle in handles {
    ///     handle.wait()?;
    /// }
    /// assert_eq!(store.latest_step()?, Some(3));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn commit_async(&self, ckpt: GradientCheckpoint) -> Result<CommitHandle> {
        self.check_async("commit_async", &ckpt)?;
        self.with_writer(ckpt.step, |w| w.submit(ckpt, false))
    }

    /// Queue a copy of `ckpt` for commit on the background thread, like
    /// [`commit_async`](Self::commit_async), for a caller that goes on
    /// changing its state.
    ///
    /// The copy goes into the buffers of an earlier copy that has been
    /// committed (the store keeps one such spare checkpoint), so a training
    /// loop that checkpoints the same parameters again and again copies
    /// into memory that is already allocated and paged in, instead of
    /// `clone()`-ing into fresh pages every time (bench/README.md,
    /// async section, compares the two). Memory: the copies queued and
    /// running, plus one spare, which the store holds until it is dropped.
    ///
    /// # Errors
    /// As [`commit_async`](Self::commit_async).
    ///
    /// ```
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let mut state = GradientCheckpoint::new(ComputationGraphStore::new(), 0);
    /// state.set_optimizer_state("adam_m", vec![0u8; 1 << 20]);
    /// for step in 1..=3 {
    ///     state.step = step;
    ///     if let Some(m) = state.optimizer_state.get_mut("adam_m") {
    ///         m[0] = step as u8; // training changes the state
    ///     }
    ///     store.commit_async_copy(&state)?; // state stays ours
    /// }
    /// store.flush()?;
    /// assert_eq!(store.get(3)?, Some(state));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn commit_async_copy(&self, ckpt: &GradientCheckpoint) -> Result<CommitHandle> {
        self.check_async("commit_async_copy", ckpt)?;
        self.with_writer(ckpt.step, |w| w.submit(w.copy(ckpt), true))
    }

    /// Refuse at once what the background writer could only fail.
    fn check_async(&self, op: &'static str, ckpt: &GradientCheckpoint) -> Result<()> {
        self.check_process()?;
        if self.is_read_only() {
            return Err(Error::ReadOnly {
                path: self.path().to_owned(),
                op,
            });
        }
        ckpt.validate()
    }

    /// Run `f` with the background writer, started if need be.
    fn with_writer(
        &self,
        step: u64,
        f: impl FnOnce(&AsyncWriter) -> Result<CommitHandle>,
    ) -> Result<CommitHandle> {
        let mut writer = lock(&self.writer, "starting")?;
        if writer.is_none() {
            let depth = self.db.settings().async_queue_depth;
            *writer = Some(AsyncWriter::start(self.db.clone(), depth)?);
        }
        let writer = writer
            .as_ref()
            .ok_or_else(|| writer_stopped(step, "the background writer did not start"))?;
        f(writer)
    }

    /// Wait until every queued [`commit_async`](Self::commit_async) is done
    /// and, for a store that replicates
    /// ([`StoreOptions::replicate_to`](crate::StoreOptions::replicate_to)),
    /// until a push covering every commit so far has finished.
    ///
    /// # Errors
    /// [`Error::AsyncCommitFailed`] naming every background commit that
    /// failed since the last `flush` and whose handle has not reported
    /// it); [`BucketError::ReplicationFailed`](crate::BucketError::ReplicationFailed) when that push failed (it is
    /// retried in the background). The store keeps working.
    pub fn flush(&self) -> Result<()> {
        self.check_process()?;
        let writer = lock(&self.writer, "flushing")?;
        if let Some(w) = writer.as_ref() {
            w.flush()?;
        }
        drop(writer);
        self.flush_replication()
    }
}
