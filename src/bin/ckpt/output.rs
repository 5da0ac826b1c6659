//! Printing: tables for people, JSON for programs.

use ckptstore::{StepInfo, StepSummary, StoreStats};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

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

pub fn ls(summaries: &[StepSummary], json: bool) -> Result {
    if json {
        println!("{}", serde_json::to_string_pretty(summaries)?);
        return Ok(());
    }
    println!(
        "{:>10}  {:<19}  {:>10}  {:>10}  {:<24}  metrics",
        "step", "time (UTC)", "size", "written", "loss_cid"
    );
    for s in summaries {
        println!(
            "{:>10}  {:<19}  {:>10}  {:>10}  {:<24}  {}",
            s.step,
            time(s.timestamp),
            bytes(s.logical_bytes),
            bytes(s.bytes_written),
            s.loss_cid.as_deref().unwrap_or("-"),
            metrics(&s.metrics)
        );
    }
    println!("{} steps", summaries.len());
    Ok(())
}

pub fn show(info: &StepInfo, pinned: bool, json: bool) -> Result {
    if json {
        println!("{}", serde_json::to_string_pretty(info)?);
        return Ok(());
    }
    println!(
        "step:      {}{}",
        info.step,
        if pinned { " (pinned)" } else { "" }
    );
    println!(
        "time:      {} UTC ({})",
        time(info.timestamp),
        info.timestamp
    );
    println!("loss_cid:  {}", info.loss_cid.as_deref().unwrap_or("-"));
    println!("metrics:   {}", metrics(&info.metrics));
    println!(
        "graph:     {} nodes, {} edges",
        info.node_count, info.edge_count
    );
    println!(
        "blobs:     {} ({} total)",
        info.blobs.len(),
        bytes(info.blobs.values().sum())
    );
    for (name, len) in &info.blobs {
        println!("  {name:<30} {:>12}", bytes(*len));
    }
    if !info.tensors.is_empty() {
        let total = info.tensors.values().map(|t| t.bytes).sum();
        println!("tensors:   {} ({} total)", info.tensors.len(), bytes(total));
        for (name, t) in &info.tensors {
            let shape = format!("{:?}", t.shape);
            println!(
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
        println!("{}", serde_json::to_string_pretty(s)?);
        return Ok(());
    }
    println!("steps:          {}", s.steps);
    println!("logical bytes:  {}", bytes(s.logical_bytes));
    println!(
        "stored bytes:   {} in {} chunks",
        bytes(s.stored_bytes),
        s.chunks
    );
    println!("dedup ratio:    {:.2}x", s.dedup_ratio());
    println!("file size:      {}", bytes(s.file_bytes));
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
