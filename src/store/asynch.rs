//! Asynchronous commits: a background writer with a bounded queue.

use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use super::CheckpointStore;
use crate::{CommitInfo, Error, GradientCheckpoint, Result};

/// The outcome of one [`CheckpointStore::commit_async`], to wait for.
///
/// Dropping a handle does not cancel the commit; its outcome is then
/// reported only by [`CheckpointStore::flush`] (if it failed).
#[derive(Debug)]
#[must_use = "a commit's failure is reported through its handle or flush()"]
pub struct CommitHandle {
    step: u64,
    reply: Receiver<Result<CommitInfo>>,
}

impl CommitHandle {
    /// The step being committed.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Block until the commit is done: `Ok` once the step is durable (with
    /// the store's durability) and visible to readers.
    pub fn wait(self) -> Result<CommitInfo> {
        self.reply.recv().unwrap_or_else(|_| {
            Err(Error::AsyncCommitFailed {
                steps: vec![self.step],
                reason: "the background writer stopped before reporting".into(),
            })
        })
    }

    /// The outcome if the commit is done, without blocking; otherwise the
    /// handle back.
    pub fn try_wait(self) -> std::result::Result<Result<CommitInfo>, CommitHandle> {
        match self.reply.try_recv() {
            Ok(outcome) => Ok(outcome),
            Err(mpsc::TryRecvError::Empty) => Err(self),
            Err(mpsc::TryRecvError::Disconnected) => Ok(Err(Error::AsyncCommitFailed {
                steps: vec![self.step],
                reason: "the background writer stopped before reporting".into(),
            })),
        }
    }
}

struct Job {
    ckpt: GradientCheckpoint,
    reply: SyncSender<Result<CommitInfo>>,
}

/// Commits queued or running, and failures not yet reported by `flush`.
#[derive(Default)]
struct Progress {
    in_flight: usize,
    failed: Vec<(u64, String)>,
}

/// The background writer: one thread committing jobs in queue order.
pub(crate) struct AsyncWriter {
    queue: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<()>>,
    progress: Arc<(Mutex<Progress>, Condvar)>,
}

impl AsyncWriter {
    fn start(store: CheckpointStore, depth: usize) -> Result<Self> {
        let (queue, jobs) = mpsc::sync_channel::<Job>(depth);
        let progress: Arc<(Mutex<Progress>, Condvar)> = Arc::default();
        let shared = progress.clone();
        let path = store.path().to_owned();
        let thread = std::thread::Builder::new()
            .name("ckptstore-writer".into())
            .spawn(move || {
                for job in jobs {
                    let step = job.ckpt.step;
                    let outcome = store.commit(&job.ckpt);
                    drop(job.ckpt); // free the blobs before reporting
                    let (lock, cvar) = &*shared;
                    let mut p = lock.lock().unwrap_or_else(PoisonError::into_inner);
                    if let Err(e) = &outcome {
                        p.failed.push((step, e.to_string()));
                    }
                    p.in_flight -= 1;
                    cvar.notify_all();
                    drop(p);
                    // The caller may have dropped its handle: fine.
                    let _ = job.reply.send(outcome);
                }
            })
            .map_err(|e| Error::io("start the background writer of", path, e))?;
        Ok(AsyncWriter {
            queue: Some(queue),
            thread: Some(thread),
            progress,
        })
    }

    fn submit(&self, ckpt: GradientCheckpoint) -> Result<CommitHandle> {
        let step = ckpt.step;
        let (reply, outcome) = mpsc::sync_channel(1);
        {
            let (lock, _) = &*self.progress;
            lock.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .in_flight += 1;
        }
        let sent = self
            .queue
            .as_ref()
            .map(|q| q.send(Job { ckpt, reply }).is_ok())
            .unwrap_or(false);
        if !sent {
            let (lock, cvar) = &*self.progress;
            lock.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .in_flight -= 1;
            cvar.notify_all();
            return Err(Error::AsyncCommitFailed {
                steps: vec![step],
                reason: "the background writer has stopped".into(),
            });
        }
        Ok(CommitHandle {
            step,
            reply: outcome,
        })
    }

    fn flush(&self) -> Result<()> {
        let (lock, cvar) = &*self.progress;
        let mut p = lock.lock().unwrap_or_else(PoisonError::into_inner);
        while p.in_flight > 0 {
            p = cvar.wait(p).unwrap_or_else(PoisonError::into_inner);
        }
        if p.failed.is_empty() {
            return Ok(());
        }
        let failed = std::mem::take(&mut p.failed);
        Err(Error::AsyncCommitFailed {
            steps: failed.iter().map(|(s, _)| *s).collect(),
            reason: failed
                .into_iter()
                .next()
                .map(|(_, e)| e)
                .unwrap_or_default(),
        })
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
        if self.is_read_only() {
            return Err(Error::ReadOnly {
                path: self.path().to_owned(),
                op: "commit_async",
            });
        }
        ckpt.validate()?;
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if writer.is_none() {
            let depth = self.core.options.async_queue_depth;
            *writer = Some(AsyncWriter::start(self.worker_handle(), depth)?);
        }
        let writer = writer.as_ref().ok_or_else(|| Error::AsyncCommitFailed {
            steps: vec![ckpt.step],
            reason: "the background writer did not start".into(),
        })?;
        writer.submit(ckpt)
    }

    /// Wait until every queued [`commit_async`](Self::commit_async) is done.
    ///
    /// # Errors
    /// [`Error::AsyncCommitFailed`] naming every background commit that
    /// failed since the last `flush` (whether or not its handle reported
    /// it). The store keeps working.
    pub fn flush(&self) -> Result<()> {
        let writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        match writer.as_ref() {
            Some(w) => w.flush(),
            None => Ok(()),
        }
    }
}
