//! Printing: tables for people, JSON for programs.

use std::io::Write;

use std::collections::BTreeMap;

use ckptstore::{ShardStatus, StepInfo, StepSummary, StoreStats};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// `println!` that returns the error (a closed pipe: `ckpt ls | head`)
/// instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {
        writeln!(std::io::stdout().lock(), $($arg)*)?
    };
}

/// Bytes with a binary unit.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Unix seconds as `YYYY-MM-DD HH:MM:SS` UTC.
pub fn time(unix: u64) -> String {
    let days = i64::try_from(unix / 86_400).unwrap_or(i64::MAX);
    let secs = unix % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

fn metrics(m: &std::collections::BTreeMap<String, f64>) -> String {
    m.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A listing's last column: the metrics, then the names the step was saved
/// under.
fn metrics_and_names(s: &StepSummary) -> String {
    let names = s.save_record.names.iter().map(String::as_str);
    let m = metrics(&s.metrics);
    std::iter::once(m.as_str())
        .filter(|m| !m.is_empty())
        .chain(names)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The steps as a table; with `ranks`, the number of ranks of each too.
pub fn ls(summaries: &[StepSummary], ranks: Option<&BTreeMap<u64, u32>>, json: bool) -> Result {
    if json {
        outln!("{}", serde_json::to_string_pretty(summaries)?);
        return Ok(());
    }
    let rank_column = |cell: &str| ranks.map_or(String::new(), |_| format!("  {cell:>5}"));
    outln!(
        "{:>10}{}  {:<19}  {:>10}  {:>10}  {:<24}  metrics",
        "step",
        rank_column("ranks"),
        "time (UTC)",
        "size",
        "written",
        "loss_cid"
    );
    for s in summaries {
        let n = ranks.and_then(|r| r.get(&s.step)).map_or(1, |n| *n);
        outln!(
            "{:>10}{}  {:<19}  {:>10}  {:>10}  {:<24}  {}",
            s.step,
            rank_column(&n.to_string()),
            time(s.timestamp),
            bytes(s.logical_bytes),
            bytes(s.bytes_written),
            s.loss_cid.as_deref().unwrap_or("-"),
            metrics_and_names(s)
        );
    }
    outln!("{} steps", summaries.len());
    Ok(())
}

/// Complete steps with their ranks, and global steps not complete, as one
/// JSON object.
pub fn ls_all_json(
    summaries: &[StepSummary],
    ranks: &BTreeMap<u64, u32>,
    incomplete: &[ShardStatus],
) -> Result {
    let steps: Vec<_> = summaries
        .iter()
        .map(|s| {
            let mut v = serde_json::to_value(s)?;
            v["world_size"] = ranks.get(&s.step).copied().unwrap_or(1).into();
            Ok(v)
        })
        .collect::<serde_json::Result<_>>()?;
    let incomplete: Vec<_> = incomplete
        .iter()
        .map(|s| {
            serde_json::json!({
                "step": s.step, "world_size": s.world_size, "landed": s.landed,
                "missing": s.missing, "world_sizes": s.world_sizes,
                "save": s.save.map(|id| id.to_string()), "saves": s.saves,
            })
        })
        .collect();
    let all = serde_json::json!({ "steps": steps, "incomplete": incomplete });
    outln!("{}", serde_json::to_string_pretty(&all)?);
    Ok(())
}

/// Global steps not complete: of each one's newest save, which ranks
/// landed and which are missing.
pub fn incomplete(steps: &[ShardStatus]) -> Result {
    for s in steps {
        let list = |ranks: &[u32]| match ranks {
            [] => "none".to_owned(),
            _ => ranks
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(","),
        };
        let save = s
            .save
            .map_or_else(|| "coordinated save".to_owned(), |id| format!("save {id}"));
        let others = match s.saves {
            0 | 1 => String::new(),
            n => format!("; shards of {} older saves beside it", n - 1),
        };
        let conflict = if s.world_sizes.len() > 1 {
            format!(" (shards disagree on the world size: {:?})", s.world_sizes)
        } else {
            String::new()
        };
        let missing = if s.missing.is_empty() {
            "none missing: not committed".to_owned()
        } else {
            format!("missing {}", list(&s.missing))
        };
        outln!(
            "{:>10}  incomplete: {} of {} ranks of the newest {save} landed ({}), \
             {missing}{others}{conflict}",
            s.step,
            s.landed.len(),
            s.world_size.unwrap_or(0),
            list(&s.landed),
        );
    }
    outln!("{} incomplete steps", steps.len());
    Ok(())
}

/// A step's manifest; with its summary, what its commit wrote new and
/// what it shared with earlier steps; and its save record: what its save
/// cost the caller, when the saver recorded it, and the names a framework
/// saved it under.
pub fn show(info: &StepInfo, summary: Option<&StepSummary>, pinned: bool, json: bool) -> Result {
    if json {
        let mut value = serde_json::to_value(info)?;
        if let (Some(s), Some(map)) = (summary, value.as_object_mut()) {
            map.insert("logical_bytes".into(), s.logical_bytes.into());
            map.insert("bytes_written".into(), s.bytes_written.into());
            map.insert("stored_bytes".into(), s.stored_bytes.into());
        }
        outln!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    outln!(
        "step:      {}{}",
        info.step,
        if pinned { " (pinned)" } else { "" }
    );
    outln!(
        "time:      {} UTC ({})",
        time(info.timestamp),
        info.timestamp
    );
    outln!("loss_cid:  {}", info.loss_cid.as_deref().unwrap_or("-"));
    outln!("metrics:   {}", metrics(&info.metrics));
    if let Some(s) = summary {
        let shared = s.logical_bytes.saturating_sub(s.bytes_written);
        let stored = if s.stored_bytes == s.bytes_written {
            String::new()
        } else {
            format!(" ({} as stored, compressed)", bytes(s.stored_bytes))
        };
        outln!(
            "written:   {} new{stored}, {} shared with earlier steps",
            bytes(s.bytes_written),
            bytes(shared)
        );
    }
    if let Some(s) = info.save_record.staging {
        outln!(
            "save:      blocked {:.3} s, staging {:.3} s",
            s.blocked_seconds,
            s.staging_seconds
        );
    }
    for name in &info.save_record.names {
        outln!("saved as:  {name}");
    }
    outln!(
        "graph:     {} nodes, {} edges",
        info.node_count,
        info.edge_count
    );
    outln!(
        "blobs:     {} ({} total)",
        info.blobs.len(),
        bytes(info.blobs.values().sum())
    );
    for (name, len) in &info.blobs {
        outln!("  {name:<30} {:>12}", bytes(*len));
    }
    if !info.tensors.is_empty() {
        let total = info.tensors.values().map(|t| t.bytes).sum();
        outln!("tensors:   {} ({} total)", info.tensors.len(), bytes(total));
        for (name, t) in &info.tensors {
            let shape = format!("{:?}", t.shape);
            outln!(
                "  {name:<30} {:>12}  {:<8} {shape}",
                bytes(t.bytes),
                t.dtype.name()
            );
        }
    }
    Ok(())
}

pub fn stats(s: &StoreStats, json: bool) -> Result {
    if json {
        outln!("{}", serde_json::to_string_pretty(s)?);
        return Ok(());
    }
    outln!("steps:          {}", s.steps);
    outln!("logical bytes:  {}", bytes(s.logical_bytes));
    outln!(
        "stored bytes:   {} in {} chunks",
        bytes(s.stored_bytes),
        s.chunks
    );
    outln!("dedup ratio:    {:.2}x", s.dedup_ratio());
    outln!("file size:      {}", bytes(s.file_bytes));
    if s.pack_files > 0 {
        outln!(
            "pack files:     {} in {} files",
            bytes(s.pack_bytes),
            s.pack_files
        );
    }
    Ok(())
}

/// A bucket's totals: its complete steps, their bytes (`logical`), the
/// bytes of the stored copies of their chunks (`chunks`: each copy once;
/// a chunk two writers packed apart counts twice), and what those take
/// as stored (`stored`: fewer where chunks are stored compressed).
pub fn bucket_stats(
    url: &str,
    steps: usize,
    logical: u64,
    chunks: u64,
    stored: u64,
    json: bool,
) -> Result {
    if json {
        let v = serde_json::json!({
            "url": url, "steps": steps, "logical_bytes": logical,
            "chunk_bytes": chunks, "stored_bytes": stored,
        });
        outln!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let ratio = |a: u64, b: u64| if b == 0 { 1.0 } else { a as f64 / b as f64 };
    outln!("steps:          {steps}");
    outln!("logical bytes:  {}", bytes(logical));
    outln!(
        "chunk bytes:    {} (dedup ratio {:.2}x)",
        bytes(chunks),
        ratio(logical, chunks)
    );
    outln!(
        "stored bytes:   {} ({:.2}x smaller compressed)",
        bytes(stored),
        ratio(chunks, stored)
    );
    Ok(())
}

/// A DCP step: its tensors with their global shapes, and its values.
pub fn show_dcp(index: &ckptstore::DcpIndex, json: bool) -> Result {
    if json {
        let tensors: serde_json::Map<String, serde_json::Value> = index
            .tensors
            .iter()
            .map(|(name, t)| {
                let v = serde_json::json!({
                    "dtype": t.dtype.name(),
                    "shape": t.shape,
                    "boxes": t.boxes.len(),
                });
                (name.clone(), v)
            })
            .collect();
        let v = serde_json::json!({
            "step": index.step,
            "world_size": index.world_size,
            "dcp": true,
            "tensors": tensors,
            "values": index.values,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "step {}: saved through torch.distributed.checkpoint by {} ranks",
        index.step, index.world_size
    );
    println!("tensors ({}):", index.tensors.len());
    for (name, t) in &index.tensors {
        println!(
            "  {name}  {} {:?}  ({} boxes)",
            t.dtype.name(),
            t.shape,
            t.boxes.len()
        );
    }
    if !index.values.is_empty() {
        println!(
            "values ({}): {}",
            index.values.len(),
            index.values.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_time() {
        assert_eq!(time(0), "1970-01-01 00:00:00");
        assert_eq!(time(1_750_000_000), "2025-06-15 15:06:40");
        assert_eq!(time(951_782_400), "2000-02-29 00:00:00");
    }

    #[test]
    fn byte_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
    }
}
