//! Background replication ([`StoreOptions::replicate_to`]): a thread that
//! pushes the store to its remote after each local commit, retries with
//! backoff, and reports through [`ReplicationStatus`] and `flush`.
//!
//! Every write transaction of the store bumps a request counter; the thread
//! runs one [`Remote::push`] at a time, covering every request made
//! before it started. A push after a restart (the thread starts with one
//! request) uploads whatever the bucket lacks, so nothing committed is lost
//! to a crash between a commit and its upload.
//!
//! [`StoreOptions::replicate_to`]: crate::StoreOptions::replicate_to

use std::collections::BTreeSet;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::remote::BucketError;
use crate::remote::Remote;
use crate::store::{Replica, Replication};
use crate::{CheckpointStore, Error, ReplicationStatus, Result, StoreOptions};

/// The first retry waits this long; each failure doubles it.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

impl StoreOptions {
    /// Replicate every committed step to `remote` in the background: after
    /// each local commit a thread uploads what the bucket lacks
    /// ([`Remote::push`]); a failed upload is
    /// retried with backoff (1 s doubling to 60 s) and reported by
    /// [`flush`](crate::CheckpointStore::flush) (which waits for uploads)
    /// and [`replication_status`](crate::CheckpointStore::replication_status).
    /// Opening the store starts with a push, so uploads cut short by a
    /// crash or a restart resume. Only for stores opened for writing.
    ///
    /// ```
    /// use ckptstore::{ComputationGraphStore, GradientCheckpoint, Remote, StoreOptions};
    /// # let dir = tempfile::tempdir()?;
    /// let remote = Remote::open(&format!("file://{}/bucket", dir.path().display()))?;
    /// let store = StoreOptions::new()
    ///     .replicate_to(remote)
    ///     .open(dir.path().join("run.ckpt"))?;
    /// store.commit(&GradientCheckpoint::new(ComputationGraphStore::new(), 1))?;
    /// store.flush()?; // waits for the upload
    /// let status = store.replication_status()?.expect("replicating");
    /// assert!(status.pending.is_empty());
    /// # let remote = Remote::open(&format!("file://{}/bucket", dir.path().display()))?;
    /// assert_eq!(remote.steps()?, vec![1]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn replicate_to(mut self, remote: Remote) -> Self {
        self.replicate_to = Some(Arc::new(Target(Arc::new(remote))));
        self
    }
}

/// The bucket a store replicates to, as the store's extension point sees it.
#[derive(Debug)]
struct Target(Arc<Remote>);

impl Replication for Target {
    fn start(&self, store: CheckpointStore) -> Result<Box<dyn Replica>> {
        Ok(Box::new(Replicator::start(store, self.0.clone())?))
    }
}

impl Replica for Replicator {
    fn on_write(&self) -> Box<dyn Fn() + Send + Sync> {
        Box::new(Replicator::on_write(self))
    }

    fn status(&self, store: &CheckpointStore) -> Result<ReplicationStatus> {
        Replicator::status(self, store)
    }

    fn flush(&self, store: &CheckpointStore) -> Result<()> {
        Replicator::flush(self, store)
    }
}

/// What the caller's handle and the thread share.
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Bumped by each write and each flush.
    requested: u64,
    /// The `requested` value the last finished attempt covered, and
    /// whether it failed.
    attempted: u64,
    /// Shared with every `flush` that reports it, not copied.
    failed: Option<Arc<Error>>,
    running: bool,
    /// Retry now, whatever the backoff (a flush waits).
    urgent: bool,
    /// Set when the thread is to stop, or has died.
    end: Option<End>,
    failures: u32,
    /// Steps a successful push saw in the store (all in the bucket since).
    confirmed: BTreeSet<u64>,
    steps_uploaded: u64,
    bytes_uploaded: u64,
}

/// Why the thread ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// The store is dropped.
    Stop,
    /// The thread panicked: nothing more is uploaded until the store is
    /// opened again.
    Panicked,
}

/// The replication thread of one store.
pub(crate) struct Replicator {
    shared: Arc<Shared>,
    remote: Arc<Remote>,
    thread: Option<JoinHandle<()>>,
}

impl Replicator {
    /// Start replicating `store` (a handle of its own on the same
    /// database) to `remote`, with one push requested at once.
    pub(crate) fn start(store: CheckpointStore, remote: Arc<Remote>) -> Result<Replicator> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                requested: 1,
                ..State::default()
            }),
            changed: Condvar::new(),
        });
        let thread = {
            let (shared, remote) = (shared.clone(), remote.clone());
            std::thread::Builder::new()
                .name("ckptstore-replicate".into())
                .spawn(move || run(&store, &remote, &shared))
        }
        .map_err(|source| Error::Io {
            op: "start the replication thread for",
            path: remote.url().into(),
            source,
        })?;
        Ok(Replicator {
            shared,
            remote,
            thread: Some(thread),
        })
    }

    /// A hook for the store's writes: each one requests a push.
    pub(crate) fn on_write(&self) -> impl Fn() + Send + Sync + 'static {
        let shared = self.shared.clone();
        move || {
            let mut state = lock(&shared);
            state.requested += 1;
            shared.changed.notify_all();
        }
    }

    /// Wait for a push that covers every write so far; its error if it
    /// failed (replication goes on retrying in the background).
    pub(crate) fn flush(&self, store: &CheckpointStore) -> Result<()> {
        let mut state = lock(&self.shared);
        state.requested += 1;
        state.urgent = true;
        let target = state.requested;
        self.shared.changed.notify_all();
        while state.attempted < target && state.end.is_none() {
            state = self
                .shared
                .changed
                .wait(state)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        let failure = match (&state.failed, state.end == Some(End::Panicked)) {
            (_, true) => Some(Arc::new(Error::WriterStopped {
                detail: "the replication thread panicked; reopen the store to resume".into(),
            })),
            (Some(e), false) => Some(e.clone()),
            (None, false) => None,
        };
        match failure {
            None => Ok(()),
            Some(source) => {
                let confirmed = state.confirmed.clone();
                drop(state);
                let steps = store
                    .steps()?
                    .into_iter()
                    .filter(|s| !confirmed.contains(s))
                    .collect();
                Err(BucketError::ReplicationFailed {
                    url: self.remote.url().to_owned(),
                    steps,
                    source,
                }
                .into())
            }
        }
    }

    pub(crate) fn status(&self, store: &CheckpointStore) -> Result<ReplicationStatus> {
        let state = lock(&self.shared);
        let confirmed = state.confirmed.clone();
        let mut status = ReplicationStatus {
            url: self.remote.url().to_owned(),
            pending: Vec::new(),
            running: state.running,
            steps_uploaded: state.steps_uploaded,
            bytes_uploaded: state.bytes_uploaded,
            consecutive_failures: state.failures,
            last_error: if state.end == Some(End::Panicked) {
                Some("the replication thread panicked; reopen the store to resume".into())
            } else {
                state.failed.as_ref().map(ToString::to_string)
            },
        };
        drop(state);
        status.pending = store
            .steps()?
            .into_iter()
            .filter(|s| !confirmed.contains(s))
            .collect();
        Ok(status)
    }
}

impl Drop for Replicator {
    /// Stop the thread: a push in flight stops after its current chunk;
    /// what it did not upload is uploaded after the next open.
    fn drop(&mut self) {
        lock(&self.shared).end = Some(End::Stop);
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Marks the state when the thread ends by a panic, so that `flush` does
/// not wait for it.
struct Obituary<'a>(&'a Shared);

impl Drop for Obituary<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut state = lock(self.0);
            state.end = Some(End::Panicked);
            state.running = false;
            self.0.changed.notify_all();
        }
    }
}

/// The thread: wait for a request, push, record, back off on failure.
fn run(store: &CheckpointStore, remote: &Remote, shared: &Shared) {
    let _obituary = Obituary(shared);
    let mut retry_at: Option<Instant> = None;
    loop {
        let target = {
            let mut state = lock(shared);
            loop {
                if state.end.is_some() {
                    return;
                }
                let due = state.urgent || retry_at.is_none_or(|t| Instant::now() >= t);
                if state.requested > state.attempted && due {
                    break;
                }
                let wait =
                    retry_at.map_or(MAX_BACKOFF, |t| t.saturating_duration_since(Instant::now()));
                state = shared
                    .changed
                    .wait_timeout(state, wait)
                    .map_or_else(|e| e.into_inner().0, |(s, _)| s);
            }
            state.urgent = false;
            state.running = true;
            state.requested
        };
        let outcome = store.steps().and_then(|seen| {
            let report = remote.push_with(store, &mut |_, _| lock(shared).end.is_none())?;
            Ok((seen, report))
        });
        let mut state = lock(shared);
        state.running = false;
        state.attempted = target;
        match outcome {
            Ok((seen, report)) if state.end.is_none() => {
                state.confirmed = seen.into_iter().collect();
                state.steps_uploaded += report.steps_pushed.len() as u64;
                state.bytes_uploaded += report.bytes_uploaded;
                state.failed = None;
                state.failures = 0;
                retry_at = None;
            }
            Ok(_) => {} // stopped part way
            Err(e) => {
                state.failures = state.failures.saturating_add(1);
                state.failed = Some(Arc::new(e));
                let backoff =
                    FIRST_BACKOFF.saturating_mul(1 << state.failures.min(6).saturating_sub(1));
                retry_at = Some(Instant::now() + backoff.min(MAX_BACKOFF));
                // A failed attempt is retried: ask for it.
                state.requested = state.requested.max(target + 1);
            }
        }
        shared.changed.notify_all();
    }
}

/// The state holds counters and a set: a panic elsewhere leaves it usable.
fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared
        .state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
