//! A step of files (issue 76): any directory a framework wrote, as one
//! step, and back. Each regular file is an entry `files/<path>` (its path
//! under the directory, `/`-separated) holding its bytes, which the store
//! cuts into chunks and deduplicates like any blob; the entry
//! [`FILES_ENTRY`] lists the files (path, length, permission bits), so a
//! step of files is told from any other and written back exactly.

use std::collections::BTreeSet;
use std::fs;
use std::io::Write;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::file::{sync_dir, unix_now};
use crate::{Entry, Error, Result, Step};

/// The entry of a step of files that lists its files (JSON).
pub const FILES_ENTRY: &str = "ckptstore.files";

/// Where each file's bytes are: `files/` and its path.
const FILE_PREFIX: &str = "files/";

/// What [`FILES_ENTRY`] holds.
#[derive(Debug, Serialize, Deserialize)]
struct Listing {
    format: u32,
    files: Vec<Listed>,
}

/// One file of a step of files.
#[derive(Debug, Serialize, Deserialize)]
struct Listed {
    path: String,
    len: u64,
    /// The permission bits (`0o644`...), where the system has them.
    mode: u32,
}

/// Directory `dir` as step `step`: every regular file under it (its bytes
/// read whole), by path. A symbolic link, a socket or another special file
/// is refused (its meaning would not survive); an empty directory is not
/// kept.
///
/// # Errors
/// [`Error::Io`] naming the file that could not be read;
/// [`Error::InvalidCheckpoint`] for a special file or a path that is not
/// UTF-8.
pub fn step_of_dir(step: u64, dir: &Path) -> Result<Step> {
    let mut found = Vec::new();
    walk(dir, dir, &mut found, step)?;
    found.sort();
    let mut out = Step::new(step);
    out.timestamp = unix_now();
    let mut files = Vec::with_capacity(found.len());
    for (name, path) in found {
        let bytes = fs::read(&path).map_err(|e| Error::io("read", &path, e))?;
        let meta = fs::metadata(&path).map_err(|e| Error::io("look at", &path, e))?;
        files.push(Listed {
            path: name.clone(),
            len: bytes.len() as u64,
            mode: mode_of(&meta),
        });
        out.insert(format!("{FILE_PREFIX}{name}"), Entry::Blob(bytes));
    }
    let listing = serde_json::to_vec(&Listing { format: 1, files }).map_err(|e| Error::Json {
        path: None,
        source: Box::new(e),
    })?;
    out.insert(FILES_ENTRY, Entry::Blob(listing));
    Ok(out)
}

/// The files under `dir` (recursively), each by its path under `root`.
fn walk(root: &Path, dir: &Path, found: &mut Vec<(String, PathBuf)>, step: u64) -> Result<()> {
    let entries = fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("list", dir, e))?;
        let path = entry.path();
        let kind = entry
            .file_type()
            .map_err(|e| Error::io("look at", &path, e))?;
        if kind.is_dir() {
            walk(root, &path, found, step)?;
            continue;
        }
        let relative = path.strip_prefix(root).unwrap_or(&path);
        let name: Option<Vec<&str>> = relative
            .components()
            .map(|c| c.as_os_str().to_str())
            .collect();
        let Some(name) = name.map(|parts| parts.join("/")) else {
            return Err(invalid(
                step,
                format!("{}: not a UTF-8 path", path.display()),
            ));
        };
        if !kind.is_file() {
            return Err(invalid(
                step,
                format!("{name}: not a regular file (a link or a special file)"),
            ));
        }
        found.push((name, path));
    }
    Ok(())
}

/// Write step `step`'s files (a step of files, [`step_of_dir`]) into
/// directory `dir`, whole or not at all: into a new directory beside it,
/// each file and directory fsynced, then renamed to `dir` (which must not
/// exist, or be empty). The paths written, in order.
///
/// # Errors
/// [`Error::InvalidCheckpoint`] for a step that is not a step of files, or
/// whose listing names a path outside `dir` or a file it lacks, or of
/// another length; [`Error::Io`] naming the file or directory that failed
/// ([`Error::is_io`]), among them `dir` when it holds files.
pub fn write_dir(step: &Step, dir: &Path) -> Result<Vec<String>> {
    let listing = listing_of(step)?;
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(parent).map_err(|e| Error::io("create", parent, e))?;
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("dir");
    let tmp = parent.join(format!(
        ".{name}.tmp{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    let written = fill(step, &listing, &tmp).and_then(|paths| {
        fs::rename(&tmp, dir).map_err(|e| Error::io("rename into", dir, e))?;
        sync_dir(parent)?;
        Ok(paths)
    });
    if written.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    written
}

/// The files of `listing` written under `tmp` (a new directory), durably.
fn fill(step: &Step, listing: &Listing, tmp: &Path) -> Result<Vec<String>> {
    fs::create_dir(tmp).map_err(|e| Error::io("create", tmp, e))?;
    let mut dirs = BTreeSet::new();
    let mut paths = Vec::with_capacity(listing.files.len());
    for f in &listing.files {
        let relative = safe_path(&f.path).ok_or_else(|| {
            invalid(
                step.step,
                format!("{:?}: a path outside the directory", f.path),
            )
        })?;
        let bytes = step
            .entries
            .get(&format!("{FILE_PREFIX}{}", f.path))
            .map(Entry::bytes)
            .filter(|b| b.len() as u64 == f.len)
            .ok_or_else(|| {
                invalid(
                    step.step,
                    format!("{}: missing, or not {} bytes", f.path, f.len),
                )
            })?;
        let path = tmp.join(&relative);
        if let Some(d) = path.parent() {
            fs::create_dir_all(d).map_err(|e| Error::io("create", d, e))?;
            dirs.insert(d.to_path_buf());
        }
        let mut file = fs::File::create(&path).map_err(|e| Error::io("create", &path, e))?;
        file.write_all(bytes)
            .map_err(|e| Error::io("write", &path, e))?;
        set_mode(&file, f.mode).map_err(|e| Error::io("set the permissions of", &path, e))?;
        file.sync_all().map_err(|e| Error::io("fsync", &path, e))?;
        paths.push(f.path.clone());
    }
    for d in dirs.iter().rev() {
        sync_dir(d)?;
    }
    sync_dir(tmp)?;
    Ok(paths)
}

/// The listing of a step of files.
fn listing_of(step: &Step) -> Result<Listing> {
    let raw = step
        .entries
        .get(FILES_ENTRY)
        .map(Entry::bytes)
        .ok_or_else(|| {
            invalid(
                step.step,
                format!("not a step of files (no {FILES_ENTRY} entry)"),
            )
        })?;
    let listing: Listing = serde_json::from_slice(raw)
        .map_err(|e| invalid(step.step, format!("{FILES_ENTRY}: {e}")))?;
    if listing.format != 1 {
        return Err(invalid(
            step.step,
            format!("{FILES_ENTRY} of format {}", listing.format),
        ));
    }
    Ok(listing)
}

/// `path` (a listing's, `/`-separated) as a relative path with no `..`,
/// no root and no empty part; `None` otherwise.
fn safe_path(path: &str) -> Option<PathBuf> {
    let candidate = Path::new(path);
    let parts: Vec<Component<'_>> = candidate.components().collect();
    let plain = parts.iter().all(|c| matches!(c, Component::Normal(_)));
    let same = path
        .split('/')
        .all(|p| !p.is_empty() && p != "." && p != "..");
    (plain && same && !parts.is_empty()).then(|| candidate.to_path_buf())
}

fn invalid(step: u64, reason: String) -> Error {
    Error::InvalidCheckpoint { step, reason }
}

#[cfg(unix)]
fn mode_of(meta: &fs::Metadata) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    meta.permissions().mode() & 0o7777
}

#[cfg(not(unix))]
fn mode_of(_: &fs::Metadata) -> u32 {
    0o644
}

#[cfg(unix)]
fn set_mode(file: &fs::File, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    file.set_permissions(fs::Permissions::from_mode(mode & 0o7777))
}

#[cfg(not(unix))]
fn set_mode(_: &fs::File, _: u32) -> std::io::Result<()> {
    Ok(())
}
