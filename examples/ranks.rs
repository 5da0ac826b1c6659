//! Four ranks of a data-parallel job checkpoint global steps into one
//! bucket; rank 3 dies before its shard of step 3 lands, so step 3 stays
//! invisible until the rank, restarted, redoes it. Step 4 is left with
//! three shards of four, for `ckpt ls URL --all` to show.
//!
//! `cargo run --example ranks [URL]` (default: a directory bucket in /tmp).

use std::time::{SystemTime, UNIX_EPOCH};

use ckptstore::{Entry, Remote, Step};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const WORLD: u32 = 4;

/// Rank `rank`'s shard of `step`: its slice of the parameters (1 MiB).
fn shard(step: u64, rank: u32) -> Step {
    let mut s = Step::new(step);
    s.metrics.insert("loss".into(), 1.0 / (step as f64 + 1.0));
    let fill = u8::try_from((step * 16 + u64::from(rank)) % 256).unwrap_or(0);
    s.insert("params", Entry::Blob(vec![fill; 1 << 20]));
    s
}

fn rank(url: &str, rank: u32, steps: std::ops::RangeInclusive<u64>) -> Result {
    let remote = Remote::open(url)?;
    for step in steps {
        let info = remote.commit_shard(step, rank, WORLD, &shard(step, rank))?;
        if info.complete {
            println!("   rank {rank}: step {step} complete (this rank's shard landed last)");
        }
    }
    Ok(())
}

fn main() -> Result {
    let url = std::env::args().nth(1).unwrap_or_else(|| {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        format!("file:///tmp/ckptstore-ranks-{t}")
    });
    println!("== four ranks checkpoint steps 1..=3 into {url}; rank 3 dies before step 3");
    std::thread::scope(|s| -> Result {
        let ranks: Vec<_> = (0..WORLD)
            .map(|r| {
                let last = if r == 3 { 2 } else { 3 };
                let url = url.as_str();
                s.spawn(move || rank(url, r, 1..=last))
            })
            .collect();
        for r in ranks {
            r.join().map_err(|_| "a rank panicked")??;
        }
        Ok(())
    })?;
    let remote = Remote::open(&url)?;
    let status = remote.shards(3)?;
    println!(
        "   latest complete step: {:?}; step 3: ranks {:?} landed, {:?} missing",
        remote.latest_step()?,
        status.landed,
        status.missing
    );
    println!("== rank 3 restarts and redoes step 3");
    rank(&url, 3, 3..=3)?;
    println!("   latest complete step: {:?}", remote.latest_step()?);
    let restored = remote.get_shard(3, 2)?.ok_or("rank 2's shard of step 3")?;
    assert_eq!(restored.entries, shard(3, 2).entries);
    println!("   rank 2's shard of step 3 restores byte for byte");
    println!("== step 4: ranks 0, 1 and 2 land; rank 3 is still computing");
    for r in 0..3 {
        rank(&url, r, 4..=4)?;
    }
    println!("   latest complete step: {:?}", remote.latest_step()?);
    println!("   see it with: ckpt ls {url} --all");
    Ok(())
}
