//! The file system under pack files: one seam, so that tests put a disk
//! that loses what was not synced under a store's pack files, as they put
//! one under its redb file. Stores opened by path use [`RealFs`].

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::format::packs::{pack_name, PackHeader, PACK_HEADER_BYTES};

/// The operations on pack files and their directory.
pub(crate) trait PackIo: Send + Sync {
    /// Create the directory `dir` (its parent exists).
    fn create_dir(&self, dir: &Path) -> io::Result<()>;
    /// Remove the directory `dir` if it is empty.
    fn remove_dir(&self, dir: &Path) -> io::Result<()>;
    /// Make the entries of `dir` durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// The paths of the entries of `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>>;
    /// Whether `path` is there (a file or a directory).
    fn exists(&self, path: &Path) -> bool;
    /// Whether `path` is a directory.
    fn is_dir(&self, path: &Path) -> bool;
    /// The length of the file at `path`.
    fn len(&self, path: &Path) -> io::Result<u64>;
    /// Create the file `path`, which must not exist, for writing.
    fn create_new(&self, path: &Path) -> io::Result<Box<dyn PackFile>>;
    /// Open the existing file `path` for writing, cut to nothing.
    fn open_truncated(&self, path: &Path) -> io::Result<Box<dyn PackFile>>;
    /// Open the file `path` for reading.
    fn open_read(&self, path: &Path) -> io::Result<Box<dyn PackFile>>;
    /// Delete the file `path`.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
}

/// One open pack file.
pub(crate) trait PackFile: Send + Sync {
    /// Write all of `data` at `offset`.
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
    /// Fill `out` from `offset` (`UnexpectedEof` past the end).
    fn read_at(&self, out: &mut [u8], offset: u64) -> io::Result<()>;
    /// Make the file's data durable.
    fn sync_data(&self) -> io::Result<()>;
}

/// The operating system's file system.
pub(crate) struct RealFs;

impl PackIo for RealFs {
    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir(dir)
    }
    fn remove_dir(&self, dir: &Path) -> io::Result<()> {
        fs::remove_dir(dir)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        fs::read_dir(dir)?.map(|e| e.map(|e| e.path())).collect()
    }
    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }
    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }
    fn len(&self, path: &Path) -> io::Result<u64> {
        Ok(fs::metadata(path)?.len())
    }
    fn create_new(&self, path: &Path) -> io::Result<Box<dyn PackFile>> {
        let file = OpenOptions::new().write(true).create_new(true).open(path)?;
        Ok(Box::new(file))
    }
    fn open_truncated(&self, path: &Path) -> io::Result<Box<dyn PackFile>> {
        let file = OpenOptions::new().write(true).truncate(true).open(path)?;
        Ok(Box::new(file))
    }
    fn open_read(&self, path: &Path) -> io::Result<Box<dyn PackFile>> {
        Ok(Box::new(File::open(path)?))
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }
}

impl PackFile for File {
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.write_all_at(data, offset)
    }
    fn read_at(&self, out: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_exact_at(out, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        File::sync_data(self)
    }
}

/// A store's pack directory, and the file system it is on.
#[derive(Clone)]
pub(crate) struct PackDir {
    /// The directory (`STORE.packs`, beside the store's real path).
    pub(crate) path: PathBuf,
    pub(crate) io: Arc<dyn PackIo>,
}

impl PackDir {
    /// The pack directory `path` on the operating system's file system.
    pub(crate) fn real(path: PathBuf) -> PackDir {
        PackDir {
            path,
            io: Arc::new(RealFs),
        }
    }

    /// The path of pack file `id`.
    pub(crate) fn file(&self, id: u32) -> PathBuf {
        self.path.join(pack_name(id))
    }

    /// The header of the pack file at `path`, if it has one (any failure
    /// to read it is no header: such a file is never deleted).
    pub(crate) fn header_of(&self, path: &Path) -> Option<PackHeader> {
        let file = self.io.open_read(path).ok()?;
        let mut bytes = [0u8; PACK_HEADER_BYTES];
        file.read_at(&mut bytes, 0).ok()?;
        PackHeader::decode(&bytes)
    }
}

impl std::fmt::Debug for PackDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PackDir").field(&self.path).finish()
    }
}
