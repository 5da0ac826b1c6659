//! `ckpt`: look into and manage a ckptstore file from the shell.
//!
//! A thin shell over the library: it parses arguments, calls
//! `ckptstore::CheckpointStore`, and prints. Exit codes: 0 success, 1 error,
//! 2 usage, 3 `verify` found damage.

mod bench;
mod output;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use ckptstore::{CheckpointStore, Error, Goal, GradientCheckpoint, Retention, StoreOptions};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

/// Exit code: `verify` found damage.
const EXIT_DAMAGED: u8 = 3;

#[derive(Parser)]
#[command(
    name = "ckpt",
    version,
    about = "Inspect and manage ckptstore checkpoint stores"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the steps: time, loss CID, metrics, size.
    Ls {
        /// The store file.
        store: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one step's manifest: graph summary, blobs and sizes.
    Show {
        /// The store file.
        store: PathBuf,
        /// A step number, or `latest`.
        step: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write one step to a file in the original JSON checkpoint format.
    Export {
        /// The store file.
        store: PathBuf,
        /// A step number, or `latest`.
        step: String,
        /// The JSON file to write.
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Commit checkpoints from JSON files of the original format.
    Import {
        /// The store file (created if missing).
        store: PathBuf,
        /// The JSON files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Replace steps that are already stored.
        #[arg(long)]
        replace: bool,
    },
    /// Check every hash and reference count; exit 3 on any damage.
    Verify {
        /// The store file.
        store: PathBuf,
        /// Also check redb's page checksums (reads the whole file; needs
        /// write access).
        #[arg(long)]
        pages: bool,
    },
    /// Remove steps.
    Rm {
        /// The store file.
        store: PathBuf,
        /// The steps to remove.
        #[arg(required = true)]
        steps: Vec<u64>,
    },
    /// Apply a retention policy: keep what any rule keeps, delete the rest.
    Gc {
        /// The store file.
        store: PathBuf,
        /// Keep the N highest steps.
        #[arg(long, value_name = "N")]
        keep_last: Option<usize>,
        /// Keep every step that is a multiple of N.
        #[arg(long, value_name = "N")]
        keep_every: Option<u64>,
        /// Keep the last step of each interval of this many seconds.
        #[arg(long, value_name = "SECS")]
        keep_one_per: Option<u64>,
        /// Keep the K best steps by a metric, as METRIC:K:min or METRIC:K:max.
        #[arg(long, value_name = "METRIC:K:min|max")]
        keep_best: Vec<String>,
        /// Show what would be deleted without deleting.
        #[arg(long)]
        dry_run: bool,
    },
    /// Hand free space in the file back to the filesystem.
    Compact {
        /// The store file.
        store: PathBuf,
    },
    /// Steps, sizes, deduplication ratio, file size.
    Stats {
        /// The store file.
        store: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Compare write throughput: seed JSON, raw write+fsync, ckptstore.
    Bench {
        /// Workloads to run: small, medium, large.
        #[arg(long, value_delimiter = ',', default_value = "small,medium")]
        sizes: Vec<String>,
        /// Where to write the benchmark files (default: a temporary folder).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
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
        Command::Ls { store, json } => {
            let s = open_read(&store)?;
            output::ls(&s.summaries(..)?, json)?;
        }
        Command::Show { store, step, json } => {
            let s = open_read(&store)?;
            let step = resolve(&s, &step)?;
            let info = s.info(step)?.ok_or(Error::StepNotFound { step })?;
            let pinned = s.pinned()?.contains(&step);
            output::show(&info, pinned, json)?;
        }
        Command::Export {
            store,
            step,
            output,
        } => {
            let s = open_read(&store)?;
            let step = resolve(&s, &step)?;
            let bar = spinner(format!("exporting step {step}"));
            let ckpt = s.get(step)?.ok_or(Error::StepNotFound { step })?;
            ckpt.save(&output)?;
            bar.finish_and_clear();
            println!("exported step {step} to {}", output.display());
        }
        Command::Import {
            store,
            files,
            replace,
        } => {
            let s = open_write(&store)?;
            let bar = bar(files.len() as u64, "importing");
            for file in &files {
                let ckpt = GradientCheckpoint::load(file)?;
                let info = if replace {
                    s.replace(&ckpt)?
                } else {
                    s.commit(&ckpt)?
                };
                bar.inc(1);
                bar.suspend(|| {
                    println!(
                        "imported step {} from {} ({} written, {} reused)",
                        info.step,
                        file.display(),
                        output::bytes(info.bytes_written),
                        output::bytes(info.bytes_reused)
                    )
                });
            }
            bar.finish_and_clear();
        }
        Command::Verify { store, pages } => {
            let s = if pages {
                StoreOptions::new()
                    .check_integrity(true)
                    .open(existing(&store)?)?
            } else {
                open_read(&store)?
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
                "{} steps ok, {} checked, {} damaged",
                report.steps_ok,
                output::bytes(report.bytes_checked),
                report.damaged.len() + usize::from(!report.accounting.is_empty())
            );
            if report.staged_chunks > 0 {
                println!(
                    "{} chunks staged by a large commit under way or interrupted \
                     (the next writable open deletes an interrupted one's)",
                    report.staged_chunks
                );
            }
            if !report.is_ok() {
                return Ok(ExitCode::from(EXIT_DAMAGED));
            }
        }
        Command::Rm { store, steps } => {
            let s = open_write(&store)?;
            for step in steps {
                if s.remove(step)? {
                    println!("removed step {step}");
                } else {
                    return Err(Error::StepNotFound { step }.into());
                }
            }
        }
        Command::Gc {
            store,
            keep_last,
            keep_every,
            keep_one_per,
            keep_best,
            dry_run,
        } => {
            let mut policy = Retention::new();
            if let Some(n) = keep_last {
                policy = policy.keep_last(n);
            }
            if let Some(n) = keep_every {
                policy = policy.keep_every(n);
            }
            if let Some(secs) = keep_one_per {
                policy = policy.keep_one_per(Duration::from_secs(secs));
            }
            for rule in &keep_best {
                let (metric, k, goal) = parse_best(rule)?;
                policy = policy.keep_best(metric, k, goal);
            }
            if policy.is_empty() {
                return Err("gc needs at least one --keep-* rule".into());
            }
            let s = open_write(&store)?;
            let removed = if dry_run {
                s.retention_preview(&policy)?
            } else {
                s.apply_retention(&policy)?
            };
            let verb = if dry_run { "would remove" } else { "removed" };
            println!("{verb} {} steps: {removed:?}", removed.len());
        }
        Command::Compact { store } => {
            let s = open_write(&store)?;
            let before = std::fs::metadata(&store).map_or(0, |m| m.len());
            let bar = spinner("compacting".into());
            s.compact()?;
            bar.finish_and_clear();
            let after = std::fs::metadata(&store).map_or(0, |m| m.len());
            println!(
                "compacted {}: {} -> {}",
                store.display(),
                output::bytes(before),
                output::bytes(after)
            );
        }
        Command::Stats { store, json } => {
            let s = open_read(&store)?;
            output::stats(&s.stats()?, json)?;
        }
        Command::Bench { sizes, dir } => bench::run(&sizes, dir.as_deref())?,
    }
    Ok(ExitCode::SUCCESS)
}

/// The path of a store that must exist (read commands never create one).
fn existing(path: &Path) -> Result<&Path> {
    if path.exists() {
        Ok(path)
    } else {
        Err(format!("{}: no such store", path.display()).into())
    }
}

/// Open for reading, alongside a training process that may be writing.
fn open_read(path: &Path) -> Result<CheckpointStore> {
    CheckpointStore::open_read_only(existing(path)?).map_err(|e| busy(path, e))
}

/// Open for writing; refused while another process writes.
fn open_write(path: &Path) -> Result<CheckpointStore> {
    CheckpointStore::open(path).map_err(|e| busy(path, e))
}

/// Explain a lock conflict in terms of what the user can do.
fn busy(path: &Path, e: Error) -> Box<dyn std::error::Error> {
    match &e {
        Error::Open {
            source: redb::DatabaseError::DatabaseAlreadyOpen,
            ..
        } => format!(
            "{} is open by another process that does not share it (opened with \
             shared(false), or writing while this command needs to write); \
             try again when it has finished",
            path.display()
        )
        .into(),
        _ => e.into(),
    }
}

/// `latest` or a step number.
fn resolve(store: &CheckpointStore, step: &str) -> Result<u64> {
    if step == "latest" {
        return Ok(store
            .latest_step()?
            .ok_or("the store has no steps: there is no latest")?);
    }
    step.parse()
        .map_err(|_| format!("{step:?} is not a step number or `latest`").into())
}

fn parse_best(rule: &str) -> Result<(String, usize, Goal)> {
    let bad = || format!("--keep-best {rule:?}: expected METRIC:K:min or METRIC:K:max");
    let mut parts = rule.rsplitn(3, ':');
    let goal = match parts.next() {
        Some("min") => Goal::Minimize,
        Some("max") => Goal::Maximize,
        _ => return Err(bad().into()),
    };
    let k = parts.next().and_then(|k| k.parse().ok()).ok_or_else(bad)?;
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

fn spinner(what: String) -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_message(what);
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}
