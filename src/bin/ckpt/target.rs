//! What a command's first argument names, and each command that takes
//! several kinds of target dispatched by it: one decision per argument,
//! not a test per command.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use ckptstore::{CheckpointStore, Retention};

use crate::args::Format;
use crate::{export, remote, tier, Result};

/// A command's target: a bucket URL, a node's directory of a local tier,
/// or a store file.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Target<'a> {
    Bucket(&'a str),
    Tier(&'a Path),
    Store(&'a Path),
}

impl<'a> Target<'a> {
    /// The target `arg` names: a URL (`s3://`, `file://`), else a tier's
    /// directory, else a store.
    pub(crate) fn of(arg: &'a str) -> Target<'a> {
        if remote::is_url(arg) {
            Target::Bucket(arg)
        } else {
            Target::of_path(Path::new(arg))
        }
    }

    /// As [`of`](Self::of), for an argument parsed as a path.
    pub(crate) fn of_path(path: &'a Path) -> Target<'a> {
        match path.to_str() {
            Some(url) if remote::is_url(url) => Target::Bucket(url),
            _ if tier::is_tier(path) => Target::Tier(path),
            _ => Target::Store(path),
        }
    }

    /// `ckpt ls`.
    pub(crate) fn ls(self, json: bool, all: bool) -> Result<ExitCode> {
        match self {
            Target::Bucket(url) => remote::ls(url, json, all),
            _ if all => {
                Err("--all lists global steps not complete, in a bucket: give a URL".into())
            }
            Target::Tier(dir) => tier::ls(dir, json),
            Target::Store(path) => crate::ls_store(path, json),
        }
    }

    /// `ckpt show`.
    pub(crate) fn show(self, step: &str, json: bool) -> Result<ExitCode> {
        match self {
            Target::Bucket(url) => remote::show(url, step, json),
            Target::Tier(path) | Target::Store(path) => crate::show_store(path, step, json),
        }
    }

    /// `ckpt export` (not `--hf`).
    pub(crate) fn export(
        self,
        step: &str,
        output: &Path,
        prefix: Option<&str>,
        format: Option<Format>,
    ) -> Result<ExitCode> {
        match self {
            Target::Bucket(url) => remote::export(url, step, output, prefix),
            _ if prefix.is_some() => {
                Err("--prefix selects tensors of a DCP step in a bucket: give a URL".into())
            }
            Target::Tier(path) | Target::Store(path) => {
                export::export(path, step, output, Format::of(output, format))
            }
        }
    }

    /// `ckpt verify`.
    pub(crate) fn verify(self, pages: bool) -> Result<ExitCode> {
        match self {
            Target::Bucket(url) => remote::verify(url, pages),
            Target::Tier(dir) => tier::verify(dir, pages),
            Target::Store(path) => crate::verify_store(path, pages),
        }
    }

    /// `ckpt gc`.
    pub(crate) fn gc(
        self,
        policy: &Retention,
        dry_run: bool,
        grace: Option<Duration>,
    ) -> Result<ExitCode> {
        match self {
            Target::Bucket(url) => remote::gc(url, policy, dry_run, grace),
            _ if grace.is_some() => {
                Err("--grace-period is for a bucket URL; a store file has no grace period".into())
            }
            Target::Tier(path) | Target::Store(path) => crate::gc_store(path, policy, dry_run),
        }
    }

    /// `ckpt stats`.
    pub(crate) fn stats(self, json: bool) -> Result<ExitCode> {
        match self {
            Target::Bucket(url) => remote::stats(url, json),
            Target::Tier(path) | Target::Store(path) => crate::stats_store(path, json),
        }
    }

    /// `ckpt save-dir`.
    pub(crate) fn save_dir(self, step: u64, dir: &Path) -> Result<ExitCode> {
        let written = match self {
            Target::Bucket(url) => {
                remote::open_remote(url)?
                    .save_dir(step, dir)?
                    .bytes_uploaded
            }
            Target::Tier(_) => {
                return Err("a tier's directory holds DCP saves: give a store file or a URL".into())
            }
            Target::Store(path) => {
                let store = CheckpointStore::open(path).map_err(|e| crate::explain(path, e))?;
                store.save_dir(step, dir)?.bytes_written
            }
        };
        println!(
            "saved {} as step {step} ({written} new bytes)",
            dir.display()
        );
        Ok(ExitCode::SUCCESS)
    }

    /// `ckpt load-dir`.
    pub(crate) fn load_dir(self, step: &str, dir: &Path) -> Result<ExitCode> {
        let paths = match self {
            Target::Bucket(url) => {
                let remote = remote::open_remote(url)?;
                let step = match step {
                    "latest" => remote
                        .latest_step()?
                        .ok_or("the bucket holds no complete step")?,
                    n => n
                        .parse()
                        .map_err(|_| format!("{n:?} is not a step number or latest"))?,
                };
                remote.load_dir(step, dir)?
            }
            Target::Tier(path) | Target::Store(path) => {
                let store = crate::open_read(path)?;
                let step = crate::resolve(&store, step)?;
                store.load_dir(step, dir)?
            }
        };
        println!("wrote {} files into {}", paths.len(), dir.display());
        Ok(ExitCode::SUCCESS)
    }
}
