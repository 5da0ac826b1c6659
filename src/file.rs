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

/// Write `bytes` to `path` whole or not at all, durably: through a
/// temporary file beside it (`.NAME.tmpPID-UUID`, PID this process's id,
/// so that a sweeper can tell one a killed writer left), fsynced, renamed
/// over `path`, then the directory fsynced. On failure the temporary file
/// is removed and `path` is untouched; errors name `path`.
///
/// ```
/// # let dir = tempfile::tempdir()?;
/// let path = dir.path().join("marker.json");
/// ckptstore::write_durably(&path, b"{}")?;
/// assert_eq!(std::fs::read(&path)?, b"{}");
/// ckptstore::remove_durably(&path)?;
/// assert!(!path.exists());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn write_durably(path: &Path, bytes: &[u8]) -> Result<()> {
    write_durably_with(path, |file| file.write_all(bytes))
}

/// Write `path` through `write`, which fills a temporary file beside it;
/// fsync it, rename it over `path`, fsync the directory. On any failure the
/// temporary file is removed and `path` is untouched; errors name `path`.
pub(crate) fn write_durably_with(
    path: &Path,
    write: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> Result<()> {
    let (dir, tmp) = temp_beside(path, &format!("tmp{}", std::process::id()));
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

/// Remove `path` if it is there, and fsync its directory: once this
/// returns, a crash does not bring it back.
pub fn remove_durably(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("remove", path, e)),
    }
    let (dir, _) = temp_beside(path, "rm");
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

/// Symbolic links [`real_path`] follows before it gives up (as Linux's
/// `open`).
const MAX_LINKS: usize = 40;

/// `path` made absolute with every symbolic link resolved: the one name of
/// the file it stands for, which every later file operation uses (so a
/// later `chdir`, or a link repointed, changes nothing). A path that does
/// not exist yet resolves through its directory, which must exist; a
/// dangling link resolves to its target, which `open(O_CREAT)` would
/// create.
pub(crate) fn real_path(path: &Path) -> Result<PathBuf> {
    let mut path = path.to_owned();
    for _ in 0..MAX_LINKS {
        match fs::canonicalize(&path) {
            Ok(real) => return Ok(real),
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::io("resolve the path", &path, e))
            }
            Err(_) => {}
        }
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
            _ => PathBuf::from("."),
        };
        if let Ok(target) = fs::read_link(&path) {
            // A dangling link: what it names, relative to its directory.
            path = dir.join(target);
            continue;
        }
        let Some(name) = path.file_name().map(ToOwned::to_owned) else {
            let e = std::io::Error::from(std::io::ErrorKind::InvalidInput);
            return Err(Error::io("resolve the path (it names no file)", &path, e));
        };
        let dir = fs::canonicalize(&dir).map_err(|e| Error::io("find the directory", &dir, e))?;
        return Ok(dir.join(name));
    }
    let e = std::io::Error::other("too many levels of symbolic links");
    Err(Error::io("resolve the path", &path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_durable_writes_temporary_file_names_its_process() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.json");
        let names = || -> Vec<String> {
            fs::read_dir(dir.path())
                .expect("list")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect()
        };
        // While it is written: `.m.json.tmpPID-UUID`, and nothing else.
        let mut seen = Vec::new();
        let failed = write_durably_with(&path, |file| {
            file.write_all(b"half")?;
            seen = names();
            Err(std::io::Error::other("injected"))
        });
        let pid = format!(".m.json.tmp{}-", std::process::id());
        assert!(
            seen.len() == 1 && seen[0].starts_with(&pid) && seen[0].len() == pid.len() + 36,
            "{seen:?}"
        );
        // A write that fails leaves neither file.
        assert!(failed.is_err() && names().is_empty(), "{:?}", names());
        write_durably(&path, b"whole").expect("write");
        assert_eq!(fs::read(&path).expect("read"), b"whole");
        assert_eq!(names(), ["m.json"]);
    }

    #[test]
    fn real_paths_resolve_links_and_new_names() {
        let dir = tempfile::tempdir().expect("tempdir");
        let real = fs::canonicalize(dir.path()).expect("canonical");
        fs::write(real.join("run-7.ckpt"), b"x").expect("write");
        std::os::unix::fs::symlink("run-7.ckpt", real.join("latest.ckpt")).expect("link");
        std::os::unix::fs::symlink("run-8.ckpt", real.join("next.ckpt")).expect("link");
        let resolve = |name: &str| real_path(&dir.path().join(name)).expect(name);
        assert_eq!(resolve("latest.ckpt"), real.join("run-7.ckpt"));
        assert_eq!(resolve("run-7.ckpt"), real.join("run-7.ckpt"));
        // Dangling: the target, which a writable open creates.
        assert_eq!(resolve("next.ckpt"), real.join("run-8.ckpt"));
        assert_eq!(resolve("new.ckpt"), real.join("new.ckpt"));
        let e = real_path(&dir.path().join("missing/dir/x")).expect_err("no such directory");
        assert!(
            e.to_string().starts_with(&format!(
                "find the directory {}",
                dir.path().join("missing/dir").display()
            )),
            "{e}"
        );
        std::os::unix::fs::symlink("loop.ckpt", real.join("loop.ckpt")).expect("link");
        assert!(real_path(&real.join("loop.ckpt")).is_err());
    }
}
