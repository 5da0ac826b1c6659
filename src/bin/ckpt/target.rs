//! What a command's first argument names, and each command that takes
//! several kinds of target dispatched by it: one decision per argument,
//! not a test per command.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use ckptstore::Retention;

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
}
