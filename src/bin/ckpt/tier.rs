//! `ckpt ls DIR` and `ckpt verify DIR` for a node's directory of a local
//! tier (`ckptstore.dcp.Tiers`): each save recorded there, with the ranks
//! whose shards the directory holds, the ranks whose copies it keeps, and
//! whether the bucket holds it; `verify` checks every shard and copy
//! against the records. Every rule about the directory is the library's
//! (`ckptstore::tier`).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;

use ckptstore::tier::{Cost, Record, StoreKind, StoreName, TierDir};
use ckptstore::{CheckpointStore, ContentDigest};

use super::{one_line, open_read, Result};

/// A recorded step as listed.
#[derive(serde::Serialize)]
struct Listed {
    step: u64,
    world_size: u32,
    ranks: Vec<u32>,
    copies_of: Vec<u32>,
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

/// `ckpt ls DIR`: exit 3 if a store of the directory cannot be read
/// (named on stderr; the rest is listed).
pub(crate) fn ls(dir: &Path, json: bool) -> Result<ExitCode> {
    let tier = TierDir::new(dir);
    let (saves, _) = saves(&tier)?;
    let (held, unreadable) = held(&tier, &mut |_, _, _| Ok(()), &mut |line| {
        eprintln!("ckpt: {line}");
    })?;
    let mut listed = Vec::new();
    for Newest {
        record: r, cost, ..
    } in saves.values()
    {
        let has = |kind| -> Vec<u32> {
            (0..r.world_size())
                .filter(|&src| {
                    held.get(&(StoreName { kind, rank: src }, r.step))
                        == Some(&r.digests[src as usize])
                })
                .collect()
        };
        listed.push(Listed {
            step: r.step,
            world_size: r.world_size(),
            ranks: has(StoreKind::Own),
            copies_of: has(StoreKind::Copies),
            upload: r.upload,
            in_bucket: tier.in_bucket(r.key())?,
            cost: *cost,
        });
    }
    let code = if unreadable == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&listed)?);
        return Ok(code);
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
    Ok(code)
}

/// `ckpt verify DIR`: every step of every store of the directory read and
/// hash-checked, and every shard and copy of a recorded save compared
/// with the digest its record gives; a shard or copy a record here says
/// this node keeps, and that is not here, is missing. Exit 3 on damage (a
/// refused record, a store that cannot be read, a shard missing, too).
/// `--pages` checks a store file, not a directory.
pub(crate) fn verify(dir: &Path, pages: bool) -> Result<ExitCode> {
    if pages {
        return Err("--pages checks a store file: give one of the directory's stores".into());
    }
    let tier = TierDir::new(dir);
    let (saves, refused) = saves(&tier)?;
    let mut damaged = refused;
    let mut checked = 0usize;
    let (held, unreadable) = held(
        &tier,
        &mut |name, store, steps| {
            let report = store.verify()?;
            for (step, e) in &report.damaged {
                println!("DAMAGED {name} step {step}: {}", one_line(e));
            }
            damaged += report.damaged.len();
            checked += steps;
            Ok(())
        },
        &mut |line| println!("{line}"),
    )?;
    damaged += unreadable;
    let mut shards = 0usize;
    for Newest { record: r, .. } in saves.values() {
        for ((name, step), digest) in &held {
            if *step != r.step || name.rank >= r.world_size() {
                continue;
            }
            shards += 1;
            if *digest != r.digests[name.rank as usize] {
                damaged += 1;
                println!(
                    "DIFFERS {name} step {step}: not the shard the record of step {step} names \
                     (another save of the step); a load does not use it"
                );
            }
        }
    }
    damaged += missing(&saves, &held);
    println!(
        "{} saves recorded, {shards} shards and copies of them checked against their records, \
         {checked} store steps read, {damaged} damaged",
        saves.len()
    );
    Ok(if damaged == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}

/// Print each shard and copy that a record of the newest save of a step
/// says this node keeps (`Record::kept_by` the rank that wrote it) but
/// that no store of the directory holds; their number.
fn missing(saves: &Saves, held: &Held) -> usize {
    let mut missing = std::collections::BTreeSet::new();
    for (&step, newest) in saves {
        for &by in &newest.by {
            for store in newest.record.kept_by(by) {
                if !held.contains_key(&(store, step)) {
                    missing.insert((step, store, by));
                }
            }
        }
    }
    for (step, store, by) in &missing {
        let what = match store.kind {
            StoreKind::Own => "its own shard",
            StoreKind::Copies => "a copy of its shard",
        };
        println!(
            "MISSING {store} step {step}: rank {by}'s record says this node keeps {what} \
             of step {step} for rank {}; it is not here",
            store.rank
        );
    }
    missing.len()
}
/// Bytes in MiB, for the table (the precision of a float is plenty there).
#[allow(clippy::cast_precision_loss)]
fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

fn list(ranks: &[u32]) -> String {
    if ranks.is_empty() {
        return "-".to_owned();
    }
    ranks
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The newest save of each step, with its cost over the node's ranks and
/// the ranks whose records of it are here.
type Saves = BTreeMap<u64, Newest>;

/// A step's newest save recorded in a directory.
struct Newest {
    record: Record,
    /// The save's cost over the ranks that recorded it here.
    cost: Option<Cost>,
    /// The ranks whose records of it are here.
    by: Vec<u32>,
}

/// The newest save of each step recorded in the directory, with the ranks
/// whose records of it are here and its cost over them (the longest times,
/// the bytes summed); and the number of records refused (each named on
/// stderr, and skipped).
fn saves(tier: &TierDir) -> Result<(Saves, usize)> {
    let (records, refused) = tier.records(None)?;
    for e in &refused {
        eprintln!("ckpt: {}; skipped", one_line(e));
    }
    if records.is_empty() && refused.is_empty() {
        eprintln!(
            "ckpt: {} has no records: no step of a local tier was completed here",
            tier.path().display()
        );
    }
    let mut out = Saves::new();
    for (name, r) in records {
        let cost = r.cost;
        let newest = |r: &Record| Newest {
            record: r.clone(),
            cost: None,
            by: Vec::new(),
        };
        let slot = out.entry(r.step).or_insert_with(|| newest(&r));
        if slot.record.saved_at < r.saved_at {
            *slot = newest(&r);
        }
        if slot.record.saved_at == r.saved_at {
            slot.by.push(name.rank);
            if let Some(c) = cost {
                let sum = slot.cost.get_or_insert_with(Cost::default);
                sum.blocked_seconds = sum.blocked_seconds.max(c.blocked_seconds);
                sum.durable_seconds = sum.durable_seconds.max(c.durable_seconds);
                sum.bytes_new += c.bytes_new;
                sum.bytes_deduplicated += c.bytes_deduplicated;
            }
        }
    }
    Ok((out, refused.len()))
}

/// The content digest of each step of each store of the directory.
type Held = BTreeMap<(StoreName, u64), ContentDigest>;

/// The content digest of each step of each store of the directory, after
/// `each` saw the store (opened read-only) and its number of steps; and
/// the number of stores that could not be read, each told to `damaged` in
/// a line (the others are still read).
fn held(
    tier: &TierDir,
    each: &mut dyn FnMut(StoreName, &CheckpointStore, usize) -> Result<()>,
    damaged: &mut dyn FnMut(String),
) -> Result<(Held, usize)> {
    let mut out = BTreeMap::new();
    let mut unreadable = 0;
    for name in tier.stores()? {
        let path = tier.store_path(name);
        let read = open_read(&path).and_then(|store| {
            let steps = store.steps()?;
            let mut digests = Vec::with_capacity(steps.len());
            for &step in &steps {
                digests.push((step, store.content_digest(step)?));
            }
            Ok((store, digests))
        });
        let (store, digests) = match read {
            Ok(found) => found,
            Err(e) => {
                unreadable += 1;
                damaged(format!(
                    "DAMAGED {name}: {} cannot be read ({}); a load passes over it",
                    path.display(),
                    one_line(&*e)
                ));
                continue;
            }
        };
        if let Err(e) = each(name, &store, digests.len()) {
            unreadable += 1;
            damaged(format!("DAMAGED {name}: {}", one_line(&*e)));
            continue;
        }
        for (step, digest) in digests {
            if let Some(d) = digest {
                out.insert((name, step), d);
            }
        }
    }
    Ok((out, unreadable))
}
