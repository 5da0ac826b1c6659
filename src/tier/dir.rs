//! A node's directory of the local tier on disk: its stores, the records
//! of complete saves, the in-bucket marks. Every file under `records/` is
//! written durably and atomically (`crate::file`); a file whose name is
//! not one of the tier's is never read.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use super::names::{MarkName, RecordName, StoreName, RECORDS};
use super::record::{Record, SaveKey, MAX_RECORD_BYTES};
use crate::file::{remove_durably, write_durably};
use crate::{Error, Result};

/// The records of a directory, by name; and each file with a record's name
/// that was refused, as its error.
pub type Records = (Vec<(RecordName, Record)>, Vec<Error>);

/// A node's directory of the local tier (`ckptstore.dcp.Tiers`).
#[derive(Clone, Debug)]
pub struct TierDir {
    path: PathBuf,
}

impl TierDir {
    /// The directory at `path` (nothing is read or created).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where the store `name` is.
    pub fn store_path(&self, name: StoreName) -> PathBuf {
        self.path.join(name.to_string())
    }

    fn record_path(&self, name: RecordName) -> PathBuf {
        self.path.join(RECORDS).join(name.to_string())
    }

    fn mark_path(&self, step: u64) -> PathBuf {
        self.path.join(RECORDS).join(MarkName { step }.to_string())
    }

    /// The stores in the directory (files with a store's name), by name.
    /// None in a directory that does not exist.
    pub fn stores(&self) -> Result<Vec<StoreName>> {
        let mut out = Vec::new();
        for (name, file_type) in list(&self.path)? {
            if let (Ok(store), true) = (name.parse::<StoreName>(), file_type.is_file()) {
                out.push(store);
            }
        }
        out.sort_by_key(ToString::to_string);
        Ok(out)
    }

    /// The records in the directory (of rank `rank` only, if given), by
    /// name; and each file with a record's name that was refused (damaged,
    /// of another format, not matching its name), as its error.
    pub fn records(&self, rank: Option<u32>) -> Result<Records> {
        let folder = self.path.join(RECORDS);
        let mut names: Vec<RecordName> = list(&folder)?
            .into_iter()
            .filter(|(_, t)| t.is_file())
            .filter_map(|(n, _)| n.parse::<RecordName>().ok())
            .filter(|n| rank.is_none_or(|r| n.rank == r))
            .collect();
        names.sort();
        let (mut out, mut refused) = (Vec::new(), Vec::new());
        for name in names {
            match self.read_record(name) {
                Ok(Some(record)) => out.push((name, record)),
                Ok(None) => {} // removed meanwhile
                Err(e) => refused.push(e),
            }
        }
        Ok((out, refused))
    }

    fn read_record(&self, name: RecordName) -> Result<Option<Record>> {
        let path = self.record_path(name);
        let bytes = match read_bounded(&path, MAX_RECORD_BYTES) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) if e.kind() == ErrorKind::InvalidData => {
                return Err(Error::TierFile {
                    path,
                    reason: format!("damaged tier record: {e}"),
                })
            }
            Err(e) => return Err(Error::io("read", &path, e)),
        };
        Record::decode(&bytes, &name, &path).map(Some)
    }

    /// Write rank `rank`'s record of a save, durably (creating `records/`).
    pub fn write_record(&self, rank: u32, record: &Record) -> Result<()> {
        let name = RecordName {
            step: record.step,
            rank,
        };
        let path = self.record_path(name);
        let bytes = record.encode(&name, &path)?;
        let folder = self.path.join(RECORDS);
        fs::create_dir_all(&folder).map_err(|e| Error::io("create", &folder, e))?;
        write_durably(&path, &bytes)
    }

    /// Remove rank `rank`'s record of step `step`, and the step's
    /// in-bucket mark (the save it named is no longer vouched for here).
    pub fn remove_record(&self, step: u64, rank: u32) -> Result<()> {
        remove_durably(&self.record_path(RecordName { step, rank }))?;
        remove_durably(&self.mark_path(step))
    }

    /// Retire `steps` for rank `rank`, whose node holds the ranks
    /// `node_ranks` now, once its retention removed them from the stores
    /// it keeps: rank `rank`'s record of each and its in-bucket mark
    /// ([`remove_record`](Self::remove_record)), and the records of them
    /// here of ranks this node no longer holds. Those were written under
    /// another layout of the job (a relaunch with another number of ranks
    /// per node): no rank answers for them now, and the saves they vouch
    /// for lost their shards here. Records of the node's own ranks are
    /// left to them. The directory is listed once.
    pub fn retire(&self, steps: &[u64], rank: u32, node_ranks: &[u32]) -> Result<()> {
        for &step in steps {
            self.remove_record(step, rank)?;
        }
        for (name, file_type) in list(&self.path.join(RECORDS))? {
            let Ok(record) = name.parse::<RecordName>() else {
                continue;
            };
            let orphan = steps.contains(&record.step) && !node_ranks.contains(&record.rank);
            if file_type.is_file() && orphan {
                remove_durably(&self.record_path(record))?;
            }
        }
        Ok(())
    }

    /// Mark the save `(step, saved_at)` as whole in the bucket, durably.
    pub fn mark_in_bucket(&self, (step, saved_at): SaveKey) -> Result<()> {
        let folder = self.path.join(RECORDS);
        fs::create_dir_all(&folder).map_err(|e| Error::io("create", &folder, e))?;
        write_durably(&self.mark_path(step), saved_at.to_string().as_bytes())
    }

    /// Whether this node was told that the bucket holds the save `(step,
    /// saved_at)` whole (a mark of another save of the step, or a damaged
    /// one, is no).
    pub fn in_bucket(&self, (step, saved_at): SaveKey) -> Result<bool> {
        let path = self.mark_path(step);
        match read_bounded(&path, 64) {
            Ok(bytes) => Ok(std::str::from_utf8(&bytes)
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
                == Some(saved_at)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err(e) if e.kind() == ErrorKind::InvalidData => Ok(false),
            Err(e) => Err(Error::io("read", &path, e)),
        }
    }
}

/// The names and types of the entries of `dir` (none if it is missing).
fn list(dir: &Path) -> Result<Vec<(String, fs::FileType)>> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("list", dir, e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("list", dir, e))?;
        let file_type = entry
            .file_type()
            .map_err(|e| Error::io("stat", entry.path(), e))?;
        if let Ok(name) = entry.file_name().into_string() {
            out.push((name, file_type));
        }
    }
    Ok(out)
}

/// A file's bytes if it holds at most `limit` (else `InvalidData`).
fn read_bounded(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    fs::File::open(path)?
        .take(limit + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("more than {limit} bytes"),
        ));
    }
    Ok(bytes)
}
