//! Reads of a `file://` bucket's chunks straight into place, with the file
//! system directly, on every core, where the object store would copy each
//! chunk through a buffer of its own: each chunk file is read into the
//! part of the caller's buffer it fills and hashed there, a slice at a
//! time while the slice is in the CPU's cache. A chunk that fills several
//! parts (two pieces share it, or a piece needs part of it) is read whole,
//! hashed, then copied. Where a chunk's bytes go ([`Regions`]) and how a
//! checked chunk is copied there ([`place`]) are shared with the object
//! store's path (`pieces.rs`).

use std::collections::{BTreeSet, HashSet};
use std::fs::File;
use std::io::{ErrorKind, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::engine::hashing::{read_hashed, run_parallel};
use crate::format::manifest::{hex, Hash};
use crate::remote::format::stored::Stored;
use crate::remote::read::restore::{decoded, Want};
use crate::remote::read::Reader;
use crate::{Error, Result};

/// Where one fetched chunk's bytes go: (range in the chunk, the part of a
/// piece's buffer it fills). Ranges are checked against the chunk's
/// length when it is placed.
pub(crate) type Regions<'o> = Vec<(std::ops::Range<usize>, &'o mut [u8])>;

/// Copy the parts of `chunk` (checked) into `regions`.
pub(crate) fn place(step: u64, chunk: &[u8], regions: &mut Regions<'_>) -> Result<()> {
    for (range, out) in regions {
        let part = chunk
            .get(range.clone())
            .ok_or_else(|| Error::corrupt(Some(step), "a chunk is shorter than its pieces need"))?;
        out.copy_from_slice(part);
    }
    Ok(())
}

/// Read the chunks of `jobs` (index in `wanted`, where its bytes go) from
/// the `file://` bucket of `remote` into place; returns the jobs whose
/// chunk file was not where the layout puts it (the caller fetches those
/// through the object store, which reports a missing chunk).
pub(crate) fn read_into<'o>(
    remote: &Reader<'_>,
    step: u64,
    wanted: &[Want<'_>],
    jobs: Vec<(usize, Regions<'o>)>,
) -> Result<Vec<(usize, Regions<'o>)>> {
    let not_here = Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    run_parallel(jobs, threads, &|_, (i, mut regions)| {
        let want = wanted[i];
        let Want {
            what,
            object,
            at,
            len: n,
            hash,
            stored,
        } = want;
        let path = Path::new("/").join(remote.bucket.layout.object(&object).as_ref());
        let damaged = || {
            Error::corrupt(
                Some(step),
                format!(
                    "{what}: chunk {} in {} fails its hash check",
                    hex(&hash),
                    remote
                        .bucket
                        .layout
                        .url_of(&remote.bucket.url, &remote.bucket.layout.object(&object))
                ),
            )
        };
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                lock(&not_here)?.push((i, regions));
                return Ok(());
            }
            Err(e) => return Err(Error::io("open chunk", &path, e)),
        };
        let size = file
            .metadata()
            .map_err(|e| Error::io("stat chunk", &path, e))?
            .len();
        let read = |e| Error::io("read chunk", &path, e);
        // All of a chunk, or (a blob's tail) part of a packed chunk.
        let from = at.unwrap_or(0);
        let held = want.stored_len();
        let fits = match at {
            None => size == held,
            Some(at) => at.checked_add(held).is_some_and(|end| end <= size),
        };
        if !fits {
            return Err(damaged());
        }
        if from > 0 {
            file.seek(SeekFrom::Start(from)).map_err(read)?;
        }
        if stored != Stored::Raw {
            // Compressed: read as stored, decoded and checked, then placed.
            let mut bytes = vec![0u8; usize::try_from(held).map_err(|_| damaged())?];
            file.read_exact(&mut bytes).map_err(read)?;
            let chunk = decoded(want.identity(), bytes.into()).ok_or_else(damaged)?;
            return place(step, &chunk, &mut regions);
        }
        let mut next_slice = |slice: &mut [u8], _| file.read_exact(slice);
        if let [(range, out)] = regions.as_mut_slice() {
            if *range == (0..n) {
                // Straight into place; bytes that fail never stay.
                if read_hashed(out, &mut next_slice).map_err(read)? != hash {
                    out.fill(0);
                    return Err(damaged());
                }
                return Ok(());
            }
        }
        let mut chunk = vec![0u8; n];
        if read_hashed(&mut chunk, &mut next_slice).map_err(read)? != hash {
            return Err(damaged());
        }
        place(step, &chunk, &mut regions)
    })?;
    not_here.into_inner().map_err(|_| poisoned())
}

/// Which of `hashes` the `file://` bucket of `remote` holds (where
/// `direct` holds): each chunk's file looked up with the file system, on
/// every core, where the object store would make a request of each on one
/// thread (a shard of 256 chunks, and the commit of a global step, look up
/// every chunk they name).
pub(crate) fn present(remote: &Reader<'_>, hashes: BTreeSet<Hash>) -> Result<HashSet<Hash>> {
    let found = Mutex::new(HashSet::new());
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    run_parallel(hashes.into_iter().collect(), threads, &|_, hash| {
        let path = chunk_path(remote, &hash);
        match std::fs::metadata(&path) {
            Ok(meta) if meta.is_file() => {
                lock(&found)?.insert(hash);
                Ok(())
            }
            Ok(_) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("look up chunk", &path, e)),
        }
    })?;
    found.into_inner().map_err(|_| poisoned())
}

fn lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock().map_err(|_| poisoned())
}

fn poisoned() -> Error {
    Error::corrupt(None, "a chunk reader panicked")
}

/// Whether `remote` is a `file://` bucket whose object paths are its file
/// paths (no character `LocalFileSystem` would encode).
pub(crate) fn direct(remote: &Reader<'_>) -> bool {
    remote.bucket.dir.as_ref().is_some_and(|d| {
        d.to_str().is_some_and(|d| {
            d.chars()
                .all(|c| c.is_ascii_alphanumeric() || "/-_.".contains(c))
        })
    })
}

/// The file of chunk `hash`: the path `LocalFileSystem` (rooted at /)
/// gives its object.
fn chunk_path(remote: &Reader<'_>, hash: &Hash) -> PathBuf {
    Path::new("/").join(remote.bucket.layout.chunk(hash).as_ref())
}
