//! Background replication ([`StoreOptions::replicate_to`]): a thread that
//! pushes the store to its remote after each local commit, retries with
//! backoff, and reports through [`ReplicationStatus`] and `flush`.
//!
//! Every write transaction of the store bumps a request counter; the thread
//! runs one [`CheckpointStore::push`] at a time, covering every request made
//! before it started. A push after a restart (the thread starts with one
//! request) uploads whatever the bucket lacks, so nothing committed is lost
//! to a crash between a commit and its upload.
//!
//! [`StoreOptions::replicate_to`]: crate::StoreOptions::replicate_to

use std::collections::BTreeSet;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Remote;
use crate::{CheckpointStore, Error, Result};

/// The first retry waits this long; each failure doubles it.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Where background replication stands
/// ([`CheckpointStore::replication_status`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplicationStatus {
    /// The bucket's URL.
    pub url: String,
    /// Steps committed here that no push has confirmed in the bucket yet,
    /// ascending.
    pub pending: Vec<u64>,
    /// Whether a push is running now.
    pub running: bool,
    /// Steps uploaded since the store was opened.
    pub steps_uploaded: u64,
    /// Chunk bytes uploaded since the store was opened.
    pub bytes_uploaded: u64,
    /// Pushes that failed in a row (0 after a success).
    pub consecutive_failures: u32,
    /// The last failure, while failures go on; retried with backoff.
    pub last_error: Option<String>,
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
                Err(Error::ReplicationFailed {
                    url: self.remote.url().to_owned(),
                    steps,
                    source,
                })
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
            let report = store.push_with(remote, &mut |_, _| lock(shared).end.is_none())?;
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
