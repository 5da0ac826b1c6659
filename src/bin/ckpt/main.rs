//! `ckpt`: look into and manage a ckptstore file from the shell.
//!
//! A thin shell over the library: it parses arguments, calls
//! `ckptstore::CheckpointStore`, and prints; one function per subcommand.
//! Exit codes: 0 success, 1 error, 2 usage, 3 `verify` found damage.
//!
//! Which commands may do what: `import` creates a store if it is missing;
//! `rm`, `gc` (without `--dry-run`) and `compact` change an existing store;
//! every other command only reads, never changes a byte of the file, and
//! works beside a training process that is writing.

mod args;
mod bench;
mod export;
mod output;
mod remote;
mod target;
mod tier;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use args::{Cli, Command, Format};
use ckptstore::{CheckpointStore, Error, Goal, GradientCheckpoint, Retention};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use target::Target;

/// Exit code: `verify` found damage.
const EXIT_DAMAGED: u8 = 3;

/// How often `compact --wait` tries again while readers are busy.
const COMPACT_RETRY: Duration = Duration::from_millis(100);

fn main() -> ExitCode {
    let cli = Cli::parse();
    remote::set_retry_window(std::time::Duration::from_secs(cli.retry_window));
    match run(cli.command) {
        Ok(code) => code,
        // The reader of our output went away (`ckpt ls | head`): done.
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ckpt: {}", one_line(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line.
fn one_line(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !msg.contains(&text) {
            msg.push_str(": ");
            msg.push_str(&text);
        }
        source = s.source();
    }
    msg
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn run(command: Command) -> Result<ExitCode> {
    match command {
        Command::Ls { store, json, all } => Target::of(&store).ls(json, all),
        Command::Show { store, step, json } => Target::of(&store).show(&step, json),
        Command::Export {
            store,
            step,
            output,
            prefix,
            hf: true,
            max_shard_size,
            dtype,
            ..
        } => export::export_hf(
            &store,
            &step,
            &output,
            &args::HfOptions {
                max_shard: max_shard_size,
                prefix: prefix.as_deref(),
                dtype,
            },
        ),
        Command::Export {
            store,
            step,
            output,
            prefix,
            format,
            ..
        } => Target::of(&store).export(&step, &output, prefix.as_deref(), format),
        Command::Import {
            store,
            files,
            replace,
            step,
            format,
        } => import(&store, &files, replace, step, format),
        Command::Verify { store, pages } => Target::of(&store).verify(pages),
        Command::Rm { store, steps } => rm(&store, &steps),
        Command::Gc {
            store,
            keep_last,
            keep_every,
            keep_one_per,
            keep_best,
            dry_run,
            grace_period,
        } => {
            let policy = policy(keep_last, keep_every, keep_one_per, &keep_best)?;
            let grace = grace_period.map(Duration::from_secs);
            Target::of(&store).gc(&policy, dry_run, grace)
        }
        push @ Command::Push { .. } => remote::push(push),
        Command::Pull { url, store, step } => remote::pull(&url, &store, &step),
        Command::Cp { store, to } => cp(&store, &to),
        Command::Compact { store, wait } => compact(&store, Duration::from_secs(wait)),
        Command::Stats { store, json } => Target::of_path(&store).stats(json),
        Command::SaveDir { store, step, dir } => Target::of_path(&store).save_dir(step, &dir),
        Command::LoadDir { store, step, dir } => Target::of_path(&store).load_dir(&step, &dir),
        Command::Bench { sizes, dir } => {
            bench::run(&sizes, dir.as_deref()).map(|()| ExitCode::SUCCESS)
        }
    }
}

fn ls_store(store: &Path, json: bool) -> Result<ExitCode> {
    let s = open_read(store)?;
    output::ls(&s.summaries(..)?, None, json)?;
    Ok(ExitCode::SUCCESS)
}

fn show_store(store: &Path, step: &str, json: bool) -> Result<ExitCode> {
    let s = open_read(store)?;
    let step = resolve(&s, step)?;
    let info = s.info(step)?.ok_or(Error::StepNotFound { step })?;
    let pinned = s.pinned()?.contains(&step);
    let summary = s.summaries(step..=step)?.into_iter().next();
    output::show(&info, summary.as_ref(), pinned, json)?;
    Ok(ExitCode::SUCCESS)
}

fn import(
    store: &Path,
    files: &[PathBuf],
    replace: bool,
    step: Option<u64>,
    format: Option<Format>,
) -> Result<ExitCode> {
    let safetensors = files
        .iter()
        .any(|f| Format::of(f, format) == Format::Safetensors);
    if safetensors && (files.len() != 1 || step.is_none()) {
        return Err(
            "a safetensors file is imported alone, with --step N (the step to store it as)".into(),
        );
    }
    if !safetensors && step.is_some() {
        return Err("--step is for safetensors files; a JSON checkpoint names its own step".into());
    }
    if let (true, Some(step), false) = (safetensors, step, replace) {
        return import_streamed(store, &files[0], step);
    }
    // Read every file first: a bad one leaves no trace, not even a new store.
    let ckpts = files
        .iter()
        .map(|f| {
            match (Format::of(f, format), step) {
                (Format::Safetensors, Some(step)) => GradientCheckpoint::load_safetensors(f, step),
                _ => GradientCheckpoint::load(f),
            }
            .map(|c| (f, c))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let s = CheckpointStore::open(store).map_err(|e| explain(store, e))?;
    let bar = bar(files.len() as u64, "importing");
    for (file, ckpt) in &ckpts {
        let info = if replace {
            s.replace(ckpt)
        } else {
            s.commit(ckpt)
        };
        let info = info.map_err(|e| explain_import(store, file, e))?;
        bar.inc(1);
        bar.suspend(|| print_imported(&info, file));
    }
    bar.finish_and_clear();
    Ok(ExitCode::SUCCESS)
}

/// Import a safetensors file one tensor at a time. A store this command
/// creates is removed again if the import fails: a bad file leaves no trace.
fn import_streamed(store: &Path, file: &Path, step: u64) -> Result<ExitCode> {
    let existed = store.exists();
    let s = CheckpointStore::open(store).map_err(|e| explain(store, e))?;
    let bar = spinner(format!("importing {}", file.display()));
    let imported = s.import_safetensors(file, step);
    bar.finish_and_clear();
    let info = match imported {
        Ok(info) => info,
        Err(e) => {
            drop(s);
            if !existed {
                let _ = CheckpointStore::remove_store(store);
            }
            return Err(explain_import(store, file, e));
        }
    };
    print_imported(&info, file);
    Ok(ExitCode::SUCCESS)
}

fn print_imported(info: &ckptstore::CommitInfo, file: &Path) {
    println!(
        "imported step {} from {} ({} written, {} reused)",
        info.step,
        file.display(),
        output::bytes(info.bytes_written),
        output::bytes(info.bytes_reused)
    );
}

/// An import's error: a stored step names the flag that overwrites it.
fn explain_import(store: &Path, file: &Path, e: Error) -> Box<dyn std::error::Error> {
    match e {
        Error::StepExists { step } => format!(
            "{}: step {step} is already stored in {}; pass --replace to overwrite it",
            file.display(),
            store.display()
        )
        .into(),
        e => explain(store, e),
    }
}

fn verify_store(store: &Path, pages: bool) -> Result<ExitCode> {
    let s = open_read(store)?;
    let pages_ok = if pages {
        let bar = spinner("checking every page".into());
        let ok = CheckpointStore::check_pages(store)?;
        bar.finish_and_clear();
        if !ok {
            println!("DAMAGED pages: redb's page checksums do not match");
        }
        ok
    } else {
        true
    };
    let total = s.steps()?.len() as u64;
    let bar = bar(total, "verifying");
    let report = s.verify_with(&mut |_, _| bar.inc(1))?;
    bar.finish_and_clear();
    for (step, e) in &report.damaged {
        println!("DAMAGED step {step}: {}", one_line(e));
    }
    for problem in &report.accounting {
        println!("DAMAGED accounting: {problem}");
    }
    println!(
        "{} steps ok, {} checked, {} damaged{}",
        report.steps_ok,
        output::bytes(report.bytes_checked),
        report.damaged.len() + usize::from(!report.accounting.is_empty()),
        if pages { ", every page checked" } else { "" }
    );
    if !report.steps_gone.is_empty() {
        println!(
            "not checked: steps {:?}, removed by a writer while this ran",
            report.steps_gone
        );
    }
    if report.staged_chunks > 0 {
        println!(
            "{} chunks staged by a large commit under way or interrupted \
             (the next writable open deletes an interrupted one's)",
            report.staged_chunks
        );
    }
    if report.pack_files + report.stray_pack_files + report.in_flight_pack_files > 0 {
        println!(
            "{} pack files, {} ({} live){}{}",
            report.pack_files,
            output::bytes(report.pack_bytes),
            output::bytes(report.pack_live_bytes),
            match report.in_flight_pack_files {
                0 => String::new(),
                n => format!(
                    "; {n} pack file(s) of commits under way or interrupted (the next \
                     writable open deletes an interrupted one's)"
                ),
            },
            match report.stray_pack_files {
                0 => String::new(),
                n => format!(
                    "; {n} stray pack file(s) no record names (left by a writer that \
                     died, or not this store's: the next writable open deletes the \
                     store's own, and leaves the rest)"
                ),
            }
        );
    }
    if !report.is_ok() || !pages_ok {
        return Ok(ExitCode::from(EXIT_DAMAGED));
    }
    Ok(ExitCode::SUCCESS)
}

fn rm(store: &Path, steps: &[u64]) -> Result<ExitCode> {
    let s = open_write(store)?;
    s.remove_all(steps).map_err(|e| explain(store, e))?;
    for step in steps {
        println!("removed step {step}");
    }
    Ok(ExitCode::SUCCESS)
}

fn policy(
    keep_last: Option<u64>,
    keep_every: Option<u64>,
    keep_one_per: Option<u64>,
    keep_best: &[String],
) -> Result<Retention> {
    let mut policy = Retention::new();
    if let Some(n) = keep_last {
        policy = policy.keep_last(usize::try_from(n)?);
    }
    if let Some(n) = keep_every {
        policy = policy.keep_every(n);
    }
    if let Some(secs) = keep_one_per {
        policy = policy.keep_one_per(Duration::from_secs(secs));
    }
    for rule in keep_best {
        let (metric, k, goal) = parse_best(rule)?;
        policy = policy.keep_best(metric, k, goal);
    }
    if policy.is_empty() {
        return Err("gc needs at least one --keep-* rule".into());
    }
    Ok(policy)
}

fn gc_store(store: &Path, policy: &Retention, dry_run: bool) -> Result<ExitCode> {
    let (verb, removed) = if dry_run {
        ("would remove", open_read(store)?.retention_preview(policy)?)
    } else {
        let s = open_write(store)?;
        (
            "removed",
            s.apply_retention(policy).map_err(|e| explain(store, e))?,
        )
    };
    println!("{verb} {} steps: {removed:?}", removed.len());
    Ok(ExitCode::SUCCESS)
}

fn cp(store: &Path, to: &Path) -> Result<ExitCode> {
    let s = open_read(store)?;
    let bar = spinner(format!("copying to {}", to.display()));
    let copied = s
        .copy_to(to, ckptstore::StoreOptions::new())
        .map_err(|e| explain(store, e))?;
    bar.finish_and_clear();
    println!("copied {} steps to {}", copied.len(), to.display());
    Ok(ExitCode::SUCCESS)
}

fn compact(store: &Path, wait: Duration) -> Result<ExitCode> {
    let s = open_write(store)?;
    let before = std::fs::metadata(store).map_or(0, |m| m.len());
    let bar = spinner("compacting".into());
    let deadline = Instant::now() + wait;
    loop {
        match s.compact() {
            Ok(_) => break,
            Err(Error::Busy { .. }) if Instant::now() < deadline => {
                std::thread::sleep(COMPACT_RETRY);
            }
            Err(e @ Error::Busy { .. }) => {
                return Err(format!(
                    "{}{}; `ckpt compact --wait SECS` waits for readers",
                    e,
                    if wait.is_zero() {
                        String::new()
                    } else {
                        format!(" (waited {}s)", wait.as_secs())
                    }
                )
                .into())
            }
            Err(e) => return Err(explain(store, e)),
        }
    }
    bar.finish_and_clear();
    let after = std::fs::metadata(store).map_or(0, |m| m.len());
    println!(
        "compacted {}: {} -> {}",
        store.display(),
        output::bytes(before),
        output::bytes(after)
    );
    Ok(ExitCode::SUCCESS)
}

fn stats_store(store: &Path, json: bool) -> Result<ExitCode> {
    let s = open_read(store)?;
    output::stats(&s.stats()?, json)?;
    Ok(ExitCode::SUCCESS)
}

/// The path of a store that must exist: only `import` creates one.
fn existing(path: &Path) -> Result<&Path> {
    if path.exists() {
        Ok(path)
    } else {
        Err(format!(
            "{}: no such store (check the path; only `ckpt import` and `ckpt pull` create a store)",
            path.display()
        )
        .into())
    }
}

/// Open for reading, alongside a training process that may be writing.
pub(crate) fn open_read(path: &Path) -> Result<CheckpointStore> {
    let s = CheckpointStore::open_read_only(existing(path)?).map_err(|e| explain(path, e))?;
    if s.recovered_in_memory() {
        eprintln!(
            "ckpt: {} was not closed cleanly (its writer died); reading it as recovery \
             will leave it, without changing the file",
            path.display()
        );
    }
    Ok(s)
}

/// Open an existing store for writing; refused while another process
/// writes.
fn open_write(path: &Path) -> Result<CheckpointStore> {
    CheckpointStore::open(existing(path)?).map_err(|e| explain(path, e))
}

/// An error in terms of what the user can do about it.
pub(crate) fn explain(path: &Path, e: Error) -> Box<dyn std::error::Error> {
    if e.is_locked() {
        return format!(
            "{} is open by another process that does not share it (opened with \
             shared(false), or writing while this command needs to write); \
             try again when it has finished",
            path.display()
        )
        .into();
    }
    e.into()
}

/// `latest` or a step number.
pub(crate) fn resolve(store: &CheckpointStore, step: &str) -> Result<u64> {
    if step == "latest" {
        return Ok(store
            .latest_step()?
            .ok_or("the store has no steps: there is no latest")?);
    }
    step.parse()
        .map_err(|_| format!("{step:?} is not a step number or `latest`").into())
}

fn parse_best(rule: &str) -> Result<(String, usize, Goal)> {
    let bad = || format!("--keep-best {rule:?}: expected METRIC:K:min or METRIC:K:max with K >= 1");
    let mut parts = rule.rsplitn(3, ':');
    let goal = match parts.next() {
        Some("min") => Goal::Minimize,
        Some("max") => Goal::Maximize,
        _ => return Err(bad().into()),
    };
    let k = parts
        .next()
        .and_then(|k| k.parse().ok())
        .filter(|&k| k > 0)
        .ok_or_else(bad)?;
    let metric = parts.next().filter(|m| !m.is_empty()).ok_or_else(bad)?;
    Ok((metric.to_owned(), k, goal))
}

/// A progress bar on stderr; indicatif draws nothing when stderr is not a
/// terminal.
fn bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_owned());
    bar
}

/// A progress bar of bytes on stderr.
fn bytes_bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    let template = "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {elapsed}";
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_owned());
    bar
}

fn spinner(what: String) -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_message(what);
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}
