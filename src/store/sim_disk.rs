//! A simulated disk under a whole store, its redb file and its pack files,
//! that remembers what was synced: a power cut at any call leaves what
//! was durable then, and (seeded) any subset of what was not, as a disk
//! and a file system may persist unsynced writes and directory entries in
//! any order. One call counter covers both, so a cut falls between any two
//! of the store's writes, whichever file they go to.

// Test sizes are small; 64-bit only.
#![allow(clippy::cast_possible_truncation)]

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use redb::{BackendError, StorageBackend};

use crate::engine::packs::io::{PackFile, PackIo};
use crate::engine::packs::PackDir;

/// The directory the simulated store lives in (always there, durable).
pub(crate) const ROOT: &str = "/sim";

/// One file's bytes: as written, as synced, and the writes since.
#[derive(Clone, Debug, Default)]
struct Content {
    current: Vec<u8>,
    durable: Vec<u8>,
    /// Writes and resizes since the last sync, in order.
    pending: Vec<Pending>,
}

#[derive(Clone, Debug)]
enum Pending {
    Write(u64, Vec<u8>),
    SetLen(u64),
}

impl Content {
    fn durable(bytes: Vec<u8>) -> Content {
        Content {
            current: bytes.clone(),
            durable: bytes,
            pending: Vec::new(),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let (at, end) = (offset as usize, offset as usize + data.len());
        if self.current.len() < end {
            self.current.resize(end, 0);
        }
        self.current[at..end].copy_from_slice(data);
        self.pending.push(Pending::Write(offset, data.to_vec()));
    }

    fn set_len(&mut self, len: u64) {
        self.current.resize(len as usize, 0);
        self.pending.push(Pending::SetLen(len));
    }

    fn sync(&mut self) {
        self.durable.clone_from(&self.current);
        self.pending.clear();
    }

    /// What a cut leaves: the durable bytes, every resize, and the writes
    /// `keep` keeps.
    fn after_cut(&self, keep: &mut dyn FnMut() -> bool) -> Vec<u8> {
        let mut img = self.durable.clone();
        for p in &self.pending {
            match p {
                Pending::SetLen(len) => img.resize(*len as usize, 0),
                Pending::Write(off, data) if keep() => {
                    let (at, end) = (*off as usize, *off as usize + data.len());
                    if img.len() < end {
                        img.resize(end, 0);
                    }
                    img[at..end].copy_from_slice(data);
                }
                Pending::Write(..) => {}
            }
        }
        img
    }
}

/// The file system: directories and names, current and durable, over
/// inodes (a deleted file stays readable through an open handle).
#[derive(Debug, Default)]
struct State {
    redb: Content,
    inodes: Vec<Content>,
    names: BTreeMap<PathBuf, usize>,
    durable_names: BTreeMap<PathBuf, usize>,
    dirs: BTreeSet<PathBuf>,
    durable_dirs: BTreeSet<PathBuf>,
}

/// What a power cut left: the redb file and every pack file by path.
#[derive(Clone, Debug)]
pub(crate) struct Image {
    redb: Vec<u8>,
    dirs: BTreeSet<PathBuf>,
    files: BTreeMap<PathBuf, Vec<u8>>,
}

/// The disk.
#[derive(Debug)]
pub(crate) struct SimDisk {
    state: Mutex<State>,
    calls: AtomicU64,
    cut_at: AtomicU64,
    cut_seed: AtomicU64,
    cut: Mutex<Option<Image>>,
}

impl SimDisk {
    /// A disk holding `image`, all of it durable.
    pub(crate) fn new(image: &Image) -> Arc<SimDisk> {
        let mut st = State {
            redb: Content::durable(image.redb.clone()),
            dirs: image.dirs.clone(),
            durable_dirs: image.dirs.clone(),
            ..State::default()
        };
        for (path, bytes) in &image.files {
            st.inodes.push(Content::durable(bytes.clone()));
            st.names.insert(path.clone(), st.inodes.len() - 1);
        }
        st.durable_names = st.names.clone();
        Arc::new(SimDisk {
            state: Mutex::new(st),
            calls: AtomicU64::new(0),
            cut_at: AtomicU64::new(u64::MAX),
            cut_seed: AtomicU64::new(0),
            cut: Mutex::new(None),
        })
    }

    /// An empty disk.
    pub(crate) fn empty() -> Arc<SimDisk> {
        let mut dirs = BTreeSet::new();
        dirs.insert(PathBuf::from(ROOT));
        SimDisk::new(&Image {
            redb: Vec::new(),
            dirs,
            files: BTreeMap::new(),
        })
    }

    fn st(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Calls that change or sync something, so far.
    pub(crate) fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Cut the power just before call `at`; with `seed` 0 every unsynced
    /// write and name is lost, otherwise a seeded half of them survives.
    pub(crate) fn plan_cut(&self, at: u64, seed: u64) {
        self.cut_seed.store(seed, Ordering::SeqCst);
        self.cut_at.store(at, Ordering::SeqCst);
    }

    /// What the planned cut left, if it came.
    pub(crate) fn cut_image(&self) -> Option<Image> {
        self.cut
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Everything as written (no cut).
    pub(crate) fn image(&self) -> Image {
        self.image_with(&mut || true, true)
    }

    fn count(&self) {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if n == self.cut_at.load(Ordering::SeqCst) {
            let mut x = self.cut_seed.load(Ordering::SeqCst);
            let mut keep = move || {
                if x == 0 {
                    return false;
                }
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % 2 == 0
            };
            let image = self.image_with(&mut keep, false);
            *self
                .cut
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(image);
        }
    }

    /// The disk after a cut that keeps what `keep` says of each unsynced
    /// thing (`all`: everything as written).
    fn image_with(&self, keep: &mut dyn FnMut() -> bool, all: bool) -> Image {
        let st = self.st();
        let content = |c: &Content, keep: &mut dyn FnMut() -> bool| {
            if all {
                c.current.clone()
            } else {
                c.after_cut(keep)
            }
        };
        let mut dirs = st.durable_dirs.clone();
        for d in st.dirs.difference(&st.durable_dirs) {
            if all || keep() {
                dirs.insert(d.clone());
            }
        }
        let mut names = st.durable_names.clone();
        let changed: BTreeSet<&PathBuf> = st.names.keys().chain(st.durable_names.keys()).collect();
        for path in changed {
            let (now, then) = (st.names.get(path), st.durable_names.get(path));
            if now != then && (all || keep()) {
                match now {
                    Some(inode) => names.insert(path.clone(), *inode),
                    None => names.remove(path),
                };
            }
        }
        let files = names
            .into_iter()
            .filter(|(p, _)| p.parent().is_some_and(|d| dirs.contains(d)))
            .map(|(p, inode)| (p, content(&st.inodes[inode], keep)))
            .collect();
        Image {
            redb: content(&st.redb, keep),
            dirs,
            files,
        }
    }

    /// The pack directory of the store `ROOT/run.ckpt` on this disk.
    pub(crate) fn pack_dir(self: &Arc<Self>) -> PackDir {
        PackDir {
            path: Path::new(ROOT).join("run.ckpt.packs"),
            io: Arc::new(SimFs(self.clone())),
        }
    }
}

/// The redb file on a [`SimDisk`].
#[derive(Debug)]
pub(crate) struct SimBackend(pub(crate) Arc<SimDisk>);

impl StorageBackend for SimBackend {
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.st().redb.current.len() as u64)
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        read_from(&self.0.st().redb.current, offset, out)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.count();
        self.0.st().redb.set_len(len);
        Ok(())
    }
    fn sync_data(&self) -> io::Result<()> {
        self.0.count();
        self.0.st().redb.sync();
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.count();
        self.0.st().redb.write(offset, data);
        Ok(())
    }
    // One process uses the disk: every lock is granted.
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

fn read_from(bytes: &[u8], offset: u64, out: &mut [u8]) -> io::Result<()> {
    let end = offset as usize + out.len();
    let Some(src) = bytes.get(offset as usize..end) else {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "read past the end",
        ));
    };
    out.copy_from_slice(src);
    Ok(())
}

fn not_found() -> io::Error {
    io::Error::from(io::ErrorKind::NotFound)
}

/// The pack files on a [`SimDisk`].
struct SimFs(Arc<SimDisk>);

/// An open pack file: its inode.
struct SimFile(Arc<SimDisk>, usize);

impl PackIo for SimFs {
    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        self.0.count();
        self.0.st().dirs.insert(dir.to_owned());
        Ok(())
    }
    fn remove_dir(&self, dir: &Path) -> io::Result<()> {
        self.0.count();
        let mut st = self.0.st();
        if st.names.keys().any(|p| p.parent() == Some(dir)) {
            return Err(io::Error::other("directory not empty"));
        }
        st.dirs.remove(dir);
        Ok(())
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.0.count();
        let mut guard = self.0.st();
        let st = &mut *guard;
        let under = |p: &Path| p.parent() == Some(dir);
        st.durable_names.retain(|p, _| !under(p));
        for (p, inode) in &st.names {
            if under(p) {
                st.durable_names.insert(p.clone(), *inode);
            }
        }
        st.durable_dirs.retain(|d| !under(d));
        for d in &st.dirs {
            if under(d) {
                st.durable_dirs.insert(d.clone());
            }
        }
        Ok(())
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let st = self.0.st();
        if !st.dirs.contains(dir) {
            return Err(not_found());
        }
        Ok(st
            .names
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .cloned()
            .collect())
    }
    fn exists(&self, path: &Path) -> bool {
        let st = self.0.st();
        st.dirs.contains(path) || st.names.contains_key(path)
    }
    fn is_dir(&self, path: &Path) -> bool {
        self.0.st().dirs.contains(path)
    }
    fn len(&self, path: &Path) -> io::Result<u64> {
        let st = self.0.st();
        let inode = st.names.get(path).ok_or_else(not_found)?;
        Ok(st.inodes[*inode].current.len() as u64)
    }
    fn create_new(&self, path: &Path) -> io::Result<Box<dyn PackFile>> {
        self.0.count();
        let mut st = self.0.st();
        if !path.parent().is_some_and(|d| st.dirs.contains(d)) {
            return Err(not_found());
        }
        if st.names.contains_key(path) {
            return Err(io::Error::from(io::ErrorKind::AlreadyExists));
        }
        st.inodes.push(Content::default());
        let inode = st.inodes.len() - 1;
        st.names.insert(path.to_owned(), inode);
        Ok(Box::new(SimFile(self.0.clone(), inode)))
    }
    fn open_truncated(&self, path: &Path) -> io::Result<Box<dyn PackFile>> {
        self.0.count();
        let mut st = self.0.st();
        let inode = *st.names.get(path).ok_or_else(not_found)?;
        st.inodes[inode].set_len(0);
        Ok(Box::new(SimFile(self.0.clone(), inode)))
    }
    fn open_read(&self, path: &Path) -> io::Result<Box<dyn PackFile>> {
        let inode = *self.0.st().names.get(path).ok_or_else(not_found)?;
        Ok(Box::new(SimFile(self.0.clone(), inode)))
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.0.count();
        self.0
            .st()
            .names
            .remove(path)
            .map(drop)
            .ok_or_else(not_found)
    }
}

impl PackFile for SimFile {
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.0.count();
        self.0.st().inodes[self.1].write(offset, data);
        Ok(())
    }
    fn read_at(&self, out: &mut [u8], offset: u64) -> io::Result<()> {
        read_from(&self.0.st().inodes[self.1].current, offset, out)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.0.count();
        self.0.st().inodes[self.1].sync();
        Ok(())
    }
}
