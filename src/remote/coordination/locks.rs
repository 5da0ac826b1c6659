//! Locks that keep garbage collection from deleting a chunk a push in
//! flight counts on.
//!
//! A push writes `locks/push-<uuid>` before it lists the bucket's chunks,
//! and deletes it when done; a collection writes `locks/gc-<uuid>` before
//! it lists what the steps reference. Each writes its own lock first and
//! then lists the others', so of a push and a collection that overlap, at
//! least one sees the other: the collection then deletes no chunk, or the
//! push waits until the collection is over. A lock counts while it is
//! younger than the remote's grace period, by the server's clock (each
//! lock's time is compared with that of the lock just written); a push
//! rewrites its lock as it goes (by time, between chunks), so only the
//! lock of a killed process goes stale.
//!
//! A push that could not rewrite its lock in time (an upload stalled for
//! half the grace period) may have been taken for dead: before it writes a
//! commit it rewrites its lock, waits out any collection that started
//! meanwhile, and checks again (HEAD) that every chunk the step names is
//! there, uploading what is not ([`Shared::reassert`](super::Shared::reassert)).

use std::time::{Duration, Instant};

use object_store::path::Path;

use crate::remote::coordination::Shared;
use crate::remote::format::layout::LOCKS;
use crate::remote::BucketError;
use crate::Result;

/// How often a push waiting for a collection looks again.
const POLL: Duration = Duration::from_millis(200);

/// What holds a lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LockKind {
    Push,
    Gc,
}

impl LockKind {
    fn prefix(self) -> &'static str {
        match self {
            LockKind::Push => "push-",
            LockKind::Gc => "gc-",
        }
    }
}

/// A lock this process wrote.
#[derive(Debug)]
pub(crate) struct Lock {
    key: Path,
    name: String,
    written: Instant,
    /// A collection may have taken it for stale since the holder last
    /// checked its chunks.
    lapsed: bool,
}

impl Shared<'_> {
    /// Write a lock of `kind`.
    pub(crate) fn write_lock(&self, kind: LockKind) -> Result<Lock> {
        let name = format!("{}{}", kind.prefix(), uuid::Uuid::new_v4().simple());
        let lock = Lock {
            key: self.bucket.layout.lock(&name),
            name,
            written: Instant::now(),
            lapsed: false,
        };
        self.bucket.put(&lock.key, lock_body())?;
        Ok(lock)
    }

    /// Write `lock` again if a quarter of the grace period went by since;
    /// if half of it did, a collection may have judged it stale (the
    /// server's clock counts from before the write returned): mark it.
    pub(crate) fn refresh(&self, lock: &mut Lock) -> Result<()> {
        let elapsed = lock.written.elapsed();
        if elapsed >= self.grace / 4 {
            lock.lapsed |= elapsed >= self.grace / 2;
            self.bucket.put(&lock.key, lock_body())?;
            lock.written = Instant::now();
        }
        Ok(())
    }

    /// Before a commit that relies on chunks in the bucket: whether the
    /// lock lapsed since the last call, in which case it has been written
    /// again and no collection runs now, and the caller must check (HEAD)
    /// the chunks it relies on before committing, then call again.
    pub(crate) fn reassert(&self, lock: &mut Lock) -> Result<bool> {
        self.refresh(lock)?;
        lock.lapsed |= lock.written.elapsed() >= self.grace / 2;
        if !lock.lapsed {
            return Ok(false);
        }
        self.bucket.put(&lock.key, lock_body())?;
        lock.written = Instant::now();
        self.wait_for_collections(lock)?;
        lock.lapsed = false;
        Ok(true)
    }

    /// Delete `lock`. Failing that, it goes stale after the grace period.
    pub(crate) fn release(&self, lock: Lock) {
        let Lock { key, .. } = lock;
        let _ = self.bucket.delete(&key);
    }

    /// The names of the live locks of `kind` other than `own`. Only the
    /// keys of `kind` are listed where the bucket lists by key prefix (S3):
    /// a push's listing is one request however many other pushes hold
    /// locks at that moment.
    pub(crate) fn live_locks(&self, kind: LockKind, own: &Lock) -> Result<Vec<String>> {
        let mut locks = self.bucket.list_starting(LOCKS, kind.prefix())?;
        locks.retain(|(name, _)| *name != own.name);
        if locks.is_empty() {
            return Ok(Vec::new());
        }
        // Each lock's age by the server's clock: the time of the lock just
        // written (of the other kind: asked of the server).
        let now = self.bucket.modified(&own.key)?;
        let now = now.unwrap_or_else(system_millis);
        let grace = i64::try_from(self.grace.as_millis()).unwrap_or(i64::MAX);
        Ok(locks
            .into_iter()
            .filter(|(_, t)| now.saturating_sub(*t) < grace)
            .map(|(name, _)| name)
            .collect())
    }

    /// Run `f` holding a push lock ([`lock_for_push`](Self::lock_for_push)),
    /// released whatever `f` returns.
    pub(crate) fn with_push_lock<T>(&self, f: impl FnOnce(&mut Lock) -> Result<T>) -> Result<T> {
        let mut lock = self.lock_for_push()?;
        let result = f(&mut lock);
        self.release(lock);
        result
    }

    /// Take a push lock, waiting (at most the grace period) while a
    /// collection runs.
    fn lock_for_push(&self) -> Result<Lock> {
        let mut lock = self.write_lock(LockKind::Push)?;
        match self.wait_for_collections(&mut lock) {
            Ok(()) => Ok(lock),
            Err(e) => {
                self.release(lock);
                Err(e)
            }
        }
    }

    /// Wait (at most the grace period, keeping `lock` fresh) until no
    /// collection holds a live lock.
    fn wait_for_collections(&self, lock: &mut Lock) -> Result<()> {
        let started = Instant::now();
        loop {
            let collections = self.live_locks(LockKind::Gc, lock)?;
            if collections.is_empty() {
                return Ok(());
            }
            if started.elapsed() >= self.grace {
                return Err(BucketError::Busy {
                    url: self.bucket.url.clone(),
                    detail: format!(
                        "a garbage collection holds {LOCKS}/{} for longer than the grace \
                         period ({} s); if no collection runs, delete that object",
                        collections.join(", "),
                        self.grace.as_secs()
                    ),
                }
                .into());
            }
            std::thread::sleep(POLL.min(self.grace / 8));
            self.refresh(lock)?;
        }
    }
}

/// What a lock (or an owner object) says: who wrote it, for a person
/// looking at the bucket (no reader relies on it).
#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct LockBody {
    pub(crate) pid: u32,
    pub(crate) host: String,
    pub(crate) unix_ms: i64,
}

/// This process's [`LockBody`], as JSON.
pub(crate) fn lock_body() -> Vec<u8> {
    body_of(std::env::var("HOSTNAME").unwrap_or_default())
}

fn body_of(host: String) -> Vec<u8> {
    let body = LockBody {
        pid: std::process::id(),
        host,
        unix_ms: system_millis(),
    };
    // A struct of a number, a string and a number always serializes.
    serde_json::to_vec(&body).unwrap_or_default()
}

fn system_millis() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_body_is_json_whatever_the_host_name() {
        for host in [
            "node-7",
            "a \"quoted\" \\ name",
            "tab\there",
            "\u{1b}[31m",
            "ünïcode",
        ] {
            let body = body_of(host.to_owned());
            let read: LockBody = serde_json::from_slice(&body).expect("JSON");
            assert_eq!((read.pid, read.host.as_str()), (std::process::id(), host));
            assert!(read.unix_ms > 0);
        }
    }
}
