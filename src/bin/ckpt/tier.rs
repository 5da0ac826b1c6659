//! `ckpt ls DIR` for a node's directory of a local tier
//! (`ckptstore.dcp.Tiers`): each step recorded there, with the ranks whose
//! shards the directory holds, the ranks whose copies it keeps, and
//! whether the bucket holds it. The records are written by the Python
//! package; their format is in docs/design.md ("The local tier").

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::ExitCode;

use super::{open_read, Result};

/// The fields of a record `ckpt ls` shows (the rest is DCP's metadata).
#[derive(Clone, serde::Deserialize)]
struct Record {
    format: u32,
    step: u64,
    saved_at: u64,
    digests: Vec<String>,
    upload: bool,
    #[serde(default)]
    cost: Option<Cost>,
}

/// What a save cost one rank (the record's `cost`), or, as listed, the
/// ranks recorded in the directory: the longest times, the bytes summed.
#[derive(Clone, Copy, Default, serde::Deserialize, serde::Serialize)]
struct Cost {
    blocked_seconds: f64,
    durable_seconds: f64,
    bytes_new: u64,
    bytes_deduplicated: u64,
}

/// A recorded step as listed.
#[derive(serde::Serialize)]
struct Listed {
    step: u64,
    world_size: usize,
    ranks: Vec<usize>,
    copies_of: Vec<usize>,
    upload: bool,
    in_bucket: bool,
    /// The cost of the save for the ranks whose records are here.
    cost: Option<Cost>,
}

/// Whether `path` is taken for a node's directory of a local tier: a
/// directory (a store is a file).
pub(crate) fn is_tier(path: &Path) -> bool {
    path.is_dir()
}

pub(crate) fn ls(dir: &Path, json: bool) -> Result<ExitCode> {
    let records = records(dir)?;
    let held = held(dir)?;
    let mut listed = Vec::new();
    for (r, cost) in records.values() {
        let has = |kind: &str| -> Vec<usize> {
            (0..r.digests.len())
                .filter(|&src| held.get(&(kind.to_owned(), src, r.step)) == Some(&r.digests[src]))
                .collect()
        };
        let marker = dir
            .join("records")
            .join(format!("step-{:020}.in-bucket", r.step));
        let in_bucket =
            std::fs::read_to_string(marker).is_ok_and(|text| text.trim() == r.saved_at.to_string());
        listed.push(Listed {
            step: r.step,
            world_size: r.digests.len(),
            ranks: has("rank"),
            copies_of: has("copies-of"),
            upload: r.upload,
            in_bucket,
            cost: *cost,
        });
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&listed)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:>10}  {:>5}  {:<16}  {:<16}  {:>9}  {:>9}  {:>10}  bucket",
        "step", "world", "ranks held", "copies of", "blocked s", "durable s", "new"
    );
    for l in &listed {
        let bucket = match (l.upload, l.in_bucket) {
            (_, true) => "in bucket",
            (true, false) => "upload pending",
            (false, false) => "-",
        };
        let (blocked, durable, new) = l.cost.map_or_else(
            || ("-".to_owned(), "-".to_owned(), "-".to_owned()),
            |c| {
                (
                    format!("{:.3}", c.blocked_seconds),
                    format!("{:.3}", c.durable_seconds),
                    format!("{:.1} MiB", mib(c.bytes_new)),
                )
            },
        );
        println!(
            "{:>10}  {:>5}  {:<16}  {:<16}  {blocked:>9}  {durable:>9}  {new:>10}  {bucket}",
            l.step,
            l.world_size,
            list(&l.ranks),
            list(&l.copies_of)
        );
    }
    println!("{} complete steps", listed.len());
    Ok(ExitCode::SUCCESS)
}

/// Bytes in MiB, for the table (the precision of a float is plenty there).
#[allow(clippy::cast_precision_loss)]
fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

fn list(ranks: &[usize]) -> String {
    if ranks.is_empty() {
        return "-".to_owned();
    }
    ranks
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The newest record of each step in `dir/records`, with the cost of that
/// save over the ranks whose records of it are here.
fn records(dir: &Path) -> Result<BTreeMap<u64, (Record, Option<Cost>)>> {
    let mut all: Vec<Record> = Vec::new();
    let folder = dir.join("records");
    if !folder.is_dir() {
        eprintln!(
            "ckpt: {} has no records/: no step of a local tier was completed here",
            dir.display()
        );
        return Ok(BTreeMap::new());
    }
    for entry in
        std::fs::read_dir(&folder).map_err(|e| format!("reading {}: {e}", folder.display()))?
    {
        let path = entry?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let text = std::fs::read(&path)?;
        match serde_json::from_slice::<Record>(&text) {
            Ok(r) if r.format == 1 => all.push(r),
            Ok(r) => eprintln!(
                "ckpt: {}: record format {} is unknown; skipped",
                path.display(),
                r.format
            ),
            Err(e) => eprintln!("ckpt: {}: damaged record ({e}); skipped", path.display()),
        }
    }
    let mut out: BTreeMap<u64, (Record, Option<Cost>)> = BTreeMap::new();
    for r in all {
        let cost = r.cost;
        let slot = out.entry(r.step).or_insert_with(|| (r.clone(), None));
        if slot.0.saved_at < r.saved_at {
            *slot = (r.clone(), None);
        }
        if slot.0.saved_at == r.saved_at {
            if let Some(c) = cost {
                let sum = slot.1.get_or_insert_with(Cost::default);
                sum.blocked_seconds = sum.blocked_seconds.max(c.blocked_seconds);
                sum.durable_seconds = sum.durable_seconds.max(c.durable_seconds);
                sum.bytes_new += c.bytes_new;
                sum.bytes_deduplicated += c.bytes_deduplicated;
            }
        }
    }
    Ok(out)
}

/// The content digest of each (kind, rank, step) the stores of `dir` hold:
/// kind "rank" for a rank's own store, "copies-of" for copies.
fn held(dir: &Path) -> Result<BTreeMap<(String, usize, u64), String>> {
    let mut out = BTreeMap::new();
    let mut names = BTreeSet::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            names.insert(entry.file_name().to_string_lossy().into_owned());
        }
    }
    for name in names {
        let Some(stem) = name.strip_suffix(".ckpt") else {
            continue;
        };
        let Some((kind, rank)) = stem.rsplit_once('-') else {
            continue;
        };
        let (Ok(rank), true) = (rank.parse::<usize>(), kind == "rank" || kind == "copies-of")
        else {
            continue;
        };
        let store = open_read(&dir.join(&name))?;
        for step in store.steps()? {
            if let Some(d) = store.content_digest(step)? {
                out.insert((kind.to_owned(), rank, step), d.to_string());
            }
        }
    }
    Ok(out)
}
