//! Storage backends that fail or lose writes on command.

use std::fs::{File, OpenOptions};
use std::io;
use std::ops::Bound;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use redb::backends::FileBackend;
use redb::{BackendError, StorageBackend};

/// Which backend calls count toward a planned fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Write,
    SetLen,
    Sync,
}

/// A shared plan: fail the `fail_at`-th counted call (one shot).
#[derive(Debug)]
pub struct Plan {
    calls: AtomicU64,
    fail_at: AtomicU64,
    injected: AtomicU64,
    ops: Mutex<Vec<Op>>,
}

impl Plan {
    pub fn new() -> Arc<Plan> {
        Arc::new(Plan {
            calls: AtomicU64::new(0),
            fail_at: AtomicU64::new(u64::MAX),
            injected: AtomicU64::new(0),
            ops: Mutex::new(vec![Op::Write, Op::SetLen, Op::Sync]),
        })
    }

    /// Calls counted so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Fail the call `k` calls from now (0 = the next one) of the given kinds.
    pub fn arm(&self, k: u64, ops: &[Op]) {
        *self.ops.lock().expect("plan lock") = ops.to_vec();
        self.fail_at.store(self.calls() + k, Ordering::SeqCst);
    }

    pub fn disarm(&self) {
        self.fail_at.store(u64::MAX, Ordering::SeqCst);
    }

    /// Faults injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::SeqCst)
    }

    fn check(&self, op: Op) -> io::Result<()> {
        if !self.ops.lock().expect("plan lock").contains(&op) {
            return Ok(());
        }
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if n == self.fail_at.load(Ordering::SeqCst) {
            self.injected.fetch_add(1, Ordering::SeqCst);
            return Err(io::Error::other(format!(
                "injected fault at {op:?} call {n}"
            )));
        }
        Ok(())
    }
}

/// A file backend that fails as its [`Plan`] says.
#[derive(Debug)]
pub struct Faulty {
    inner: FileBackend,
    plan: Arc<Plan>,
}

impl Faulty {
    pub fn open(path: &Path, plan: Arc<Plan>) -> io::Result<Faulty> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let inner = FileBackend::new(file).map_err(io::Error::other)?;
        Ok(Faulty { inner, plan })
    }
}

impl StorageBackend for Faulty {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.plan.check(Op::SetLen)?;
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.plan.check(Op::Sync)?;
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.plan.check(Op::Write)?;
        self.inner.write(offset, data)
    }
    fn close(&self) -> io::Result<()> {
        self.inner.close()
    }
    fn try_lock_range(&self, s: Bound<u64>, e: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.try_lock_range(s, e)
    }
    fn try_lock_shared_range(&self, s: Bound<u64>, e: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.try_lock_shared_range(s, e)
    }
    fn lock_range(&self, s: Bound<u64>, e: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_range(s, e)
    }
    fn lock_shared_range(&self, s: Bound<u64>, e: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_shared_range(s, e)
    }
    fn unlock_range(&self, s: Bound<u64>, e: Bound<u64>) -> Result<(), BackendError> {
        self.inner.unlock_range(s, e)
    }
    fn query_lock_range(&self, s: Bound<u64>, e: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.query_lock_range(s, e)
    }
}

/// An in-memory disk that remembers what was synced: `image()` is what
/// every write made, `durable()` what a power cut at this moment would leave.
#[derive(Debug, Default)]
pub struct Disk {
    state: Mutex<DiskState>,
    /// Backend calls (writes, resizes, syncs) so far.
    calls: AtomicU64,
    /// At this call, take the power-cut image into `cut`.
    cut_at: AtomicU64,
    /// Seed choosing which unsynced writes survive the cut (0: none do).
    cut_seed: AtomicU64,
    cut: Mutex<Option<Vec<u8>>>,
    /// The call number of every sync so far.
    syncs: Mutex<Vec<u64>>,
}

#[derive(Debug, Default)]
struct DiskState {
    current: Vec<u8>,
    durable: Vec<u8>,
    /// Writes and resizes since the last sync, in order.
    pending: Vec<Pending>,
}

#[derive(Debug, Clone)]
enum Pending {
    Write(u64, Vec<u8>),
    SetLen(u64),
}

impl Disk {
    pub fn from_bytes(bytes: Vec<u8>) -> Arc<Disk> {
        Arc::new(Disk {
            state: Mutex::new(DiskState {
                current: bytes.clone(),
                durable: bytes,
                pending: Vec::new(),
            }),
            calls: AtomicU64::new(0),
            cut_at: AtomicU64::new(u64::MAX),
            cut_seed: AtomicU64::new(0),
            cut: Mutex::new(None),
            syncs: Mutex::new(Vec::new()),
        })
    }

    /// The call number of every sync so far.
    pub fn sync_calls(&self) -> Vec<u64> {
        self.syncs.lock().expect("syncs lock").clone()
    }

    /// Backend calls so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Cut the power just before call `at` (counting from the start):
    /// the image is taken then, while the store runs on. With `seed` 0 every
    /// unsynced write is lost; otherwise a seeded random subset survives.
    pub fn plan_cut(&self, at: u64, seed: u64) {
        self.cut_seed.store(seed, Ordering::SeqCst);
        self.cut_at.store(at, Ordering::SeqCst);
    }

    /// The image the planned cut left, if it happened.
    pub fn cut_image(&self) -> Option<Vec<u8>> {
        self.cut.lock().expect("cut lock").clone()
    }

    fn count_call(&self) {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if n == self.cut_at.load(Ordering::SeqCst) {
            let mut x = self.cut_seed.load(Ordering::SeqCst);
            let image = self.after_power_cut(|_| {
                if x == 0 {
                    return false;
                }
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % 2 == 0
            });
            *self.cut.lock().expect("cut lock") = Some(image);
        }
    }

    /// What the disk holds with every write applied.
    pub fn image(&self) -> Vec<u8> {
        self.state.lock().expect("disk lock").current.clone()
    }

    /// What survives a power cut now: the synced image plus the unsynced
    /// writes for which `keep(i)` says true (a disk may persist any subset,
    /// in any order).
    pub fn after_power_cut(&self, mut keep: impl FnMut(usize) -> bool) -> Vec<u8> {
        let st = self.state.lock().expect("disk lock");
        let mut img = st.durable.clone();
        for (i, p) in st.pending.iter().enumerate() {
            match p {
                Pending::SetLen(len) => img.resize(*len as usize, 0),
                Pending::Write(off, data) if keep(i) => {
                    let end = *off as usize + data.len();
                    if img.len() < end {
                        img.resize(end, 0);
                    }
                    img[*off as usize..end].copy_from_slice(data);
                }
                Pending::Write(..) => {}
            }
        }
        img
    }

    pub fn pending_writes(&self) -> usize {
        self.state.lock().expect("disk lock").pending.len()
    }
}

/// A backend over a [`Disk`].
#[derive(Debug)]
pub struct DiskBackend(pub Arc<Disk>);

impl StorageBackend for DiskBackend {
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.state.lock().expect("disk lock").current.len() as u64)
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let st = self.0.state.lock().expect("disk lock");
        let end = offset as usize + out.len();
        if end > st.current.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past end",
            ));
        }
        out.copy_from_slice(&st.current[offset as usize..end]);
        Ok(())
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.count_call();
        let mut st = self.0.state.lock().expect("disk lock");
        st.current.resize(len as usize, 0);
        st.pending.push(Pending::SetLen(len));
        Ok(())
    }
    fn sync_data(&self) -> io::Result<()> {
        self.0
            .syncs
            .lock()
            .expect("syncs lock")
            .push(self.0.calls());
        self.0.count_call();
        let mut guard = self.0.state.lock().expect("disk lock");
        let st = &mut *guard;
        st.durable.clone_from(&st.current);
        st.pending.clear();
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.count_call();
        let mut st = self.0.state.lock().expect("disk lock");
        let end = offset as usize + data.len();
        if st.current.len() < end {
            st.current.resize(end, 0);
        }
        st.current[offset as usize..end].copy_from_slice(data);
        st.pending.push(Pending::Write(offset, data.to_vec()));
        Ok(())
    }
    // One process uses the disk: every lock is granted, so the shared
    // (default) concurrency mode works as on a file.
    fn try_lock_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<bool, BackendError> {
        Ok(true)
    }
    fn try_lock_shared_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<bool, BackendError> {
        Ok(true)
    }
    fn lock_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<(), BackendError> {
        Ok(())
    }
    fn lock_shared_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<(), BackendError> {
        Ok(())
    }
    fn unlock_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<(), BackendError> {
        Ok(())
    }
    fn query_lock_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<bool, BackendError> {
        Ok(false)
    }
}

/// Copy a file, for trials on copies of one store.
pub fn copy(from: &Path, to: &Path) -> io::Result<()> {
    std::fs::copy(from, to).map(|_| ())?;
    File::open(to)?.sync_all()
}
