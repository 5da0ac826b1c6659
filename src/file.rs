//! File-system helpers and the clock, below every layer: a durable write
//! (temporary file beside, fsync, rename, directory fsync), the temporary
//! name itself, and seconds since the epoch.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Write `bytes` to `path` through a fsynced temporary file and a rename,
/// then fsync the directory. Removes the temporary file on failure.
pub(crate) fn write_durably(path: &Path, bytes: &[u8]) -> Result<()> {
    write_durably_with(path, |file| file.write_all(bytes))
}

/// Write `path` through `write`, which fills a temporary file beside it;
/// fsync it, rename it over `path`, fsync the directory. On any failure the
/// temporary file is removed and `path` is untouched; errors name `path`.
pub(crate) fn write_durably_with(
    path: &Path,
    write: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> Result<()> {
    let (dir, tmp) = temp_beside(path, "tmp");
    let result = (|| {
        // Errors name the file the caller asked for, not the temporary one.
        let mut file = File::create(&tmp).map_err(|e| Error::io("create", path, e))?;
        write(&mut file).map_err(|e| Error::io("write", path, e))?;
        file.sync_all().map_err(|e| Error::io("fsync", path, e))?;
        drop(file);
        fs::rename(&tmp, path).map_err(|e| Error::io("rename into", path, e))
    })();
    if result.is_err() {
        // Best effort: the temporary file may not exist if create failed.
        let _ = fs::remove_file(&tmp);
        return result;
    }
    sync_dir(&dir)
}

/// `path`'s directory, and a fresh hidden temporary name in it:
/// `.NAME.TAG-UUID`.
pub(crate) fn temp_beside(path: &Path, tag: &str) -> (PathBuf, PathBuf) {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{tag}-{}", uuid::Uuid::new_v4()));
    (dir, tmp)
}

/// fsync a directory so that a rename inside it is durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    let handle = File::open(dir).map_err(|e| Error::io("open directory", dir, e))?;
    handle
        .sync_all()
        .map_err(|e| Error::io("fsync directory", dir, e))
}
