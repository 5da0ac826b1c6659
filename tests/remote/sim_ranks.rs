//! Simulated ranks on the simulated S3 (`sim_s3`), for the tests
//! (`simulated.rs`) and the benchmark (`bench/benches/sim.rs` includes
//! this file): each rank a thread with its own `Remote` and request
//! count, all released at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ckptstore::{Entry, Remote, Step};

use super::sim_s3::SimS3;

/// A rank's error, which crosses threads.
pub type Result<T = (), E = Box<dyn std::error::Error + Send + Sync>> = std::result::Result<T, E>;

/// The simulated bucket's URL.
pub const URL: &str = "s3://sim/run";

/// A rank's own `Remote` of the simulated bucket, and its request count.
pub fn rank_remote(sim: &Arc<SimS3>) -> Result<(Remote, Arc<AtomicUsize>)> {
    let client = sim.client();
    let count = Arc::clone(&client.requests);
    Ok((Remote::open_with_connector(URL, Arc::new(client))?, count))
}

/// Rank `rank`'s shard of `step`: 4 KiB of its own.
pub fn shard(step: u64, rank: u32) -> Step {
    let mut s = Step::new(step);
    s.timestamp = 1_700_000_000;
    let mut bytes: Vec<u8> = (0..4096u32)
        .map(|i| (i * 7 + rank * 13).to_le_bytes()[0])
        .collect();
    bytes[..4].copy_from_slice(&rank.to_le_bytes());
    s.insert("w", Entry::Blob(bytes));
    s
}

/// `rank` run for each of `world` ranks on threads released at once
/// (each waits at `Gate::wait`); their results, by rank. A rank's error
/// crosses back as its text; a thread that cannot be started (a process
/// limit) releases the others to stop at once, and fails the run.
pub fn at_once<T: Send>(
    world: u32,
    rank: impl Fn(u32, &Gate) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let gate = Gate::default();
    let closed = gate.open.write().map_err(|_| "gate")?;
    std::thread::scope(|s| {
        let mut ranks = Vec::with_capacity(world as usize);
        let mut failed = None;
        for r in 0..world {
            let (rank, gate) = (&rank, &gate);
            let started = std::thread::Builder::new()
                .stack_size(256 << 10)
                .spawn_scoped(s, move || rank(r, gate).map_err(|e| e.to_string()));
            match started {
                Ok(h) => ranks.push(h),
                Err(e) => {
                    failed = Some(format!("rank {r} of {world}: no thread ({e}); see `ulimit -n` and vm.max_map_count"));
                    gate.stop.store(true, Ordering::SeqCst);
                    break;
                }
            }
        }
        drop(closed);
        let mut got = Vec::with_capacity(world as usize);
        for h in ranks {
            got.push(h.join().map_err(|_| "a rank panicked")?);
        }
        if let Some(why) = failed {
            return Err(why.into());
        }
        got.into_iter().map(|r| r.map_err(Into::into)).collect()
    })
}

/// Where ranks wait until every one is started.
#[derive(Default)]
pub struct Gate {
    open: std::sync::RwLock<()>,
    stop: std::sync::atomic::AtomicBool,
}

impl Gate {
    /// Wait until every rank is started; an error if one could not be.
    pub fn wait(&self) -> Result {
        drop(self.open.read().map_err(|_| "gate")?);
        if self.stop.load(Ordering::SeqCst) {
            return Err("not every rank started".into());
        }
        Ok(())
    }
}

/// (median, max) of `counts`.
pub fn spread(counts: &[usize]) -> (usize, usize) {
    let mut sorted = counts.to_vec();
    sorted.sort_unstable();
    (sorted[sorted.len() / 2], sorted[sorted.len() - 1])
}
