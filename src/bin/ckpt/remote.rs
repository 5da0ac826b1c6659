//! The subcommands on a bucket: `push`, `pull`, and `ls`, `show`, `verify`
//! and `gc` given a URL.

use std::path::Path;
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Duration;

use ckptstore::{BucketError, CheckpointStore, Error, Remote, Retention};

use super::args::Command;
use super::{bar, bytes_bar, explain, one_line, output, Result, EXIT_DAMAGED};

/// How long a failing request to a bucket is retried (`--retry-window`).
static RETRY_WINDOW: OnceLock<Duration> = OnceLock::new();

/// Set the retry window of the buckets this command opens.
pub(crate) fn set_retry_window(window: Duration) {
    let _ = RETRY_WINDOW.set(window);
}

/// The bucket at `url`, its requests retried for the retry window.
pub(crate) fn open_remote(url: &str) -> Result<Remote> {
    let remote = Remote::open(url)?;
    Ok(match RETRY_WINDOW.get() {
        Some(window) if *window != remote.retry_window() => remote.with_retry_window(*window)?,
        _ => remote,
    })
}

/// Whether a store argument is a bucket URL rather than a path.
pub(crate) fn is_url(arg: &str) -> bool {
    arg.split_once("://").is_some_and(|(scheme, _)| {
        !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphanumeric())
    })
}

/// `ckpt push` (`command` is a [`Command::Push`]).
pub(crate) fn push(command: Command) -> Result<ExitCode> {
    let Command::Push {
        store,
        url,
        adopt,
        repair,
        compress,
        no_compress,
    } = command
    else {
        return Err("not a push".into());
    };
    let url = url.as_str();
    let s = super::open_read(&store)?;
    let mut remote = open_remote(url)?;
    if compress || no_compress {
        remote = remote.with_compression(compress);
    }
    if adopt {
        remote.adopt(&s)?;
    }
    let total: u64 = s.summaries(..)?.iter().map(|s| s.bytes_written).sum();
    let bar = bytes_bar(total, "pushing (at most)");
    let report = if repair {
        remote.repair(&s)?
    } else {
        remote.push_with(&s, &mut |step, uploaded| {
            bar.set_message(format!("pushing step {step}"));
            bar.set_position(uploaded);
            true
        })?
    };
    bar.finish_and_clear();
    // What compression saved, where it saved anything.
    let compressed = if report.bytes_uploaded < report.raw_bytes_uploaded {
        format!(" ({} compressed)", output::bytes(report.raw_bytes_uploaded))
    } else {
        String::new()
    };
    println!(
        "pushed {} steps to {url} ({} were there): {} uploaded{compressed} in {} chunks, {} already there",
        report.steps_pushed.len(),
        report.steps_present,
        output::bytes(report.bytes_uploaded),
        report.chunks_uploaded,
        output::bytes(report.bytes_skipped)
    );
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn pull(url: &str, store: &Path, step: &str) -> Result<ExitCode> {
    let remote = open_existing(url)?;
    let step = resolve(&remote, step)?;
    let created = !store.exists();
    let s = CheckpointStore::open(store).map_err(|e| explain(store, e))?;
    let bar = bytes_bar(0, &format!("pulling step {step}"));
    let info = remote.pull_with(step, &s, &mut |fetched, total| {
        bar.set_length(total);
        bar.set_position(fetched);
    });
    bar.finish_and_clear();
    if info.is_err() && created {
        // Leave no empty store behind a pull that failed.
        drop(s);
        let _ = CheckpointStore::remove_store(store);
    }
    let info = info.map_err(|e| match e {
        Error::StepExists { step } => format!(
            "step {step} is already in {}; remove it there first (`ckpt rm`) to pull it again",
            store.display()
        )
        .into(),
        Error::StepsNotFound { .. } => {
            format!("step {step} is not in {url} (`ckpt ls {url}` lists its steps)").into()
        }
        e => explain(store, e),
    })?;
    println!(
        "pulled step {step} from {url} into {} ({} written, {} already there)",
        store.display(),
        output::bytes(info.bytes_written),
        output::bytes(info.bytes_reused)
    );
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn ls(url: &str, json: bool, all: bool) -> Result<ExitCode> {
    let remote = open_existing(url)?;
    let ranks = remote.world_sizes()?;
    let sharded = ranks.values().any(|&n| n > 1);
    let summaries = remote.summaries()?;
    match (all, json) {
        (false, _) => output::ls(&summaries, sharded.then_some(&ranks), json)?,
        (true, false) => {
            output::ls(&summaries, Some(&ranks), false)?;
            output::incomplete(&remote.incomplete_steps()?)?;
        }
        (true, true) => output::ls_all_json(&summaries, &ranks, &remote.incomplete_steps()?)?,
    }
    warn_skipped(&remote)?;
    Ok(ExitCode::SUCCESS)
}

/// `ckpt stats URL`: the bucket's steps, their bytes, the bytes of the
/// stored copies of their chunks (each copy once) and what those take as
/// stored.
pub(crate) fn stats(url: &str, json: bool) -> Result<ExitCode> {
    let remote = open_existing(url)?;
    let summaries = remote.summaries()?;
    let sum = |f: fn(&ckptstore::StepSummary) -> u64| summaries.iter().map(f).sum::<u64>();
    let (logical, chunks, stored) = (
        sum(|s| s.logical_bytes),
        sum(|s| s.bytes_written),
        sum(|s| s.stored_bytes),
    );
    output::bucket_stats(url, summaries.len(), logical, chunks, stored, json)?;
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn show(url: &str, step: &str, json: bool) -> Result<ExitCode> {
    let remote = open_existing(url)?;
    let step = resolve(&remote, step)?;
    if let Some(index) = remote.dcp_index(step)? {
        output::show_dcp(&index, json)?;
        return Ok(ExitCode::SUCCESS);
    }
    let info = remote
        .info(step)?
        .ok_or_else(|| format!("step {step} is not in {url} (`ckpt ls {url}` lists its steps)"))?;
    let summary = remote.summaries()?.into_iter().find(|s| s.step == step);
    output::show(&info, summary.as_ref(), false, json)?;
    Ok(ExitCode::SUCCESS)
}

/// The bucket at `url` and its DCP step `step` (a number or `latest`).
fn dcp_step(url: &str, step: &str) -> Result<(Remote, u64)> {
    let remote = open_existing(url)?;
    let step = resolve(&remote, step)?;
    if remote.dcp_index(step)?.is_none() {
        return Err(format!(
            "step {step} of {url} was not saved through ckptstore.dcp; `ckpt pull` copies \
             a step into a store, which exports it"
        )
        .into());
    }
    Ok((remote, step))
}

/// Consolidate a DCP step into one safetensors file.
pub(crate) fn export(
    url: &str,
    step: &str,
    output: &std::path::Path,
    prefix: Option<&str>,
) -> Result<ExitCode> {
    let (remote, step) = dcp_step(url, step)?;
    let names = remote.consolidate(step, output, prefix)?;
    println!(
        "step {step}: {} tensors written to {}",
        names.len(),
        output.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// `ckpt export URL STEP --hf -o DIR`: the step exported and what was
/// written.
pub(crate) fn export_hf(
    url: &str,
    step: &str,
    dir: &std::path::Path,
    o: &super::args::HfOptions<'_>,
) -> Result<(u64, ckptstore::HfExport)> {
    let (remote, step) = dcp_step(url, step)?;
    let written = remote.export_hf(step, dir, o.max_shard, o.prefix, o.dtype)?;
    Ok((step, written))
}

pub(crate) fn verify(url: &str, pages: bool) -> Result<ExitCode> {
    if pages {
        return Err("--pages checks a store file's pages; a bucket has none".into());
    }
    let remote = open_existing(url)?;
    let total = remote.steps()?.len() as u64;
    let bar = bar(total, "verifying");
    let report = remote.verify_with(&mut |_, _| bar.inc(1))?;
    bar.finish_and_clear();
    for (step, e) in &report.damaged {
        println!("DAMAGED step {step}: {}", one_line(e));
    }
    println!(
        "{} steps ok, {} checked, {} damaged",
        report.steps_ok,
        output::bytes(report.bytes_checked),
        report.damaged.len()
    );
    if !report.is_ok() {
        return Ok(ExitCode::from(EXIT_DAMAGED));
    }
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn gc(
    url: &str,
    policy: &Retention,
    dry_run: bool,
    grace: Option<Duration>,
) -> Result<ExitCode> {
    let mut remote = open_existing(url)?;
    if let Some(grace) = grace {
        remote = remote.with_grace_period(grace);
    }
    if dry_run {
        let doomed = remote.retention_preview(policy)?;
        println!("would remove {} steps: {doomed:?}", doomed.len());
        return Ok(ExitCode::SUCCESS);
    }
    warn_skipped(&remote)?;
    let collected = remote.gc(policy)?;
    let removed = &collected.steps_removed;
    println!("removed {} steps: {removed:?}", removed.len());
    if collected.deferred {
        println!("chunks not collected: a push is in flight; run gc again when it is done");
    } else {
        println!(
            "deleted {} chunks and {} packs ({}) and {} stray manifests; kept {} unreferenced \
             objects younger than {} s",
            collected.chunks_deleted,
            collected.packs_deleted,
            output::bytes(collected.bytes_deleted),
            collected.manifests_deleted,
            collected.young_kept,
            remote.grace_period().as_secs()
        );
        if collected.packs_repacked > 0 {
            println!(
                "rewrote the needed chunks of mostly unneeded packs into {} packs ({}); the old \
                 packs go with the next gc",
                collected.packs_repacked,
                output::bytes(collected.bytes_repacked)
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Say on stderr which steps a listing skipped because their objects do
/// not check out.
fn warn_skipped(remote: &Remote) -> Result<()> {
    for (step, why) in remote.skipped_steps()? {
        eprintln!(
            "ckpt: warning: step {step} skipped: {}; `ckpt verify {}` reports it",
            why.chars().take(300).collect::<String>(),
            remote.url()
        );
    }
    Ok(())
}

/// The bucket at `url`, for a command that only reads it (or deletes from
/// it): a mistyped URL is an error, not an empty bucket.
fn open_existing(url: &str) -> Result<Remote> {
    let remote = open_remote(url)?;
    if !remote.exists()? {
        let none = BucketError::NoBucket {
            url: url.to_owned(),
            source: None,
        };
        return Err(Error::from(none).into());
    }
    Ok(remote)
}

/// `latest` or a step number, in the bucket.
fn resolve(remote: &Remote, step: &str) -> Result<u64> {
    if step == "latest" {
        return Ok(remote.latest_step()?.ok_or_else(|| {
            format!("{} has no complete step: there is no latest", remote.url())
        })?);
    }
    step.parse()
        .map_err(|_| format!("{step:?} is not a step number or `latest`").into())
}
