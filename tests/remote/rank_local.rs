//! Rank-local saves (`ShardUpload::RankLocal`, DCP's
//! `use_collectives=False`): ranks that never coordinate complete a step
//! only with every rank's shard of one save.

use std::time::Duration;

use ckptstore::{
    Entry, Remote, Retention, SaveId, ShardInfo, ShardSource, ShardUpload, ShardWrite, Step,
};

use super::{bytes, Result};

/// Rank `rank`'s shard of `step` in the save that fills it with `fill`.
fn shard(step: u64, rank: u32, fill: u64) -> Step {
    let mut c = Step::new(step);
    c.timestamp = 1_790_000_000 + step;
    c.insert(
        "w",
        Entry::Blob(bytes(fill * 10 + u64::from(rank), 256 << 10)),
    );
    c
}

/// Rank `rank` of `world` puts its shard of `step` in save `save`.
fn put(remote: &Remote, (step, rank, world): (u64, u32, u32), save: &str) -> Result<ShardInfo> {
    let fill = u64::from(save.as_bytes()[0]);
    Ok(remote.write_shard(ShardWrite::new(
        (step, rank, world),
        ShardSource::Owned(&shard(step, rank, fill)),
        ShardUpload::RankLocal(SaveId::of(save)),
    ))?)
}

fn dir_remote(dir: &std::path::Path) -> Result<Remote> {
    Ok(Remote::open(&format!("file://{}/bucket", dir.display()))?)
}

#[test]
fn a_step_completes_only_with_shards_of_one_save() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = dir_remote(dir.path())?;
    // Save "a" of step 5 died after rank 0's shard landed.
    assert!(!put(&remote, (5, 0, 2), "a")?.complete);
    // Save "b": its rank 1 lands first and finds two ranks' shards, one
    // of them save "a"'s: not a step.
    assert!(!put(&remote, (5, 1, 2), "b")?.complete);
    assert_eq!(remote.steps()?, Vec::<u64>::new());
    assert!(put(&remote, (5, 0, 2), "b")?.complete);
    assert_eq!(remote.steps()?, vec![5]);
    let fill = u64::from(b'b');
    for rank in 0..2 {
        assert_eq!(remote.get_shard(5, rank)?, Some(shard(5, rank, fill)));
    }
    // Saved again (save "c"): the step is save "b" until "c" is whole.
    assert!(!put(&remote, (5, 1, 2), "c")?.complete);
    assert_eq!(remote.get_shard(5, 1)?, Some(shard(5, 1, fill)));
    assert!(put(&remote, (5, 0, 2), "c")?.complete);
    assert_eq!(remote.get_shard(5, 1)?, Some(shard(5, 1, u64::from(b'c'))));
    assert!(remote.verify()?.is_ok());
    Ok(())
}

#[test]
fn a_save_that_died_at_another_world_size_neither_blocks_the_step_nor_stays() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = dir_remote(dir.path())?.with_grace_period(Duration::ZERO);
    // A job of 4 ranks died saving step 3: two shards landed.
    for rank in [0, 2] {
        assert!(!put(&remote, (3, rank, 4), "four")?.complete);
    }
    // Relaunched at 2 ranks, it saves step 3 again.
    assert!(!put(&remote, (3, 0, 2), "two")?.complete);
    assert!(put(&remote, (3, 1, 2), "two")?.complete);
    assert_eq!(remote.world_sizes()?, [(3, 2)].into());
    // Collection takes the dead save's shards, and keeps the step.
    remote.apply_retention(&Retention::new().keep_last(1))?;
    let left = std::fs::read_dir(dir.path().join(format!("bucket/shards/{:020}", 3)))?.count();
    assert_eq!(left, 2);
    let fill = u64::from(b't');
    for rank in 0..2 {
        assert_eq!(remote.get_shard(3, rank)?, Some(shard(3, rank, fill)));
    }
    assert!(remote.verify()?.is_ok());
    Ok(())
}

/// Requests per rank of a rank-local save and of a load at its world
/// size, over one counting in-memory store (each rank a `Remote` of its
/// own, as processes are): constant in the world size, but for the rank
/// that finds every shard there and completes the step (a manifest per
/// rank).
#[test]
fn a_rank_local_save_and_load_cost_each_rank_requests_constant_in_the_world() -> Result {
    use std::sync::Arc;

    use object_store::memory::InMemory;

    use super::faults::Failing;

    let mut costs = Vec::new();
    for world in [2u32, 4, 8, 32] {
        let counting = Arc::new(Failing::new(Arc::new(InMemory::new()), 0));
        let open = || Remote::with_store(counting.clone(), "run", "mem://run");
        let mut saves = Vec::new();
        for rank in 0..world {
            let remote = open()?;
            counting.reset();
            let info = put(&remote, (7, rank, world), "s")?;
            saves.push(counting.requests());
            assert_eq!(info.complete, rank == world - 1, "rank {rank} of {world}");
        }
        let mut loads = Vec::new();
        for rank in 0..world {
            let reader = open()?;
            counting.reset();
            let global = reader.open_global(7)?.ok_or("complete")?;
            let len = reader.entries(&global, rank)?["w"].len;
            let got = reader.read_pieces(&global, &[(rank, "w", 0, len)])?;
            assert!(got[0] == shard(7, rank, u64::from(b's')).entries["w"].bytes());
            loads.push(counting.requests());
        }
        let last = saves.pop().ok_or("a rank")?;
        eprintln!(
            "{world} ranks: a save {saves:?} requests, the completing rank's {last}; a load {loads:?}"
        );
        // Every rank that lands before the last: the same (the first
        // also makes the bucket's collection mark).
        let most = *saves.iter().max().ok_or("a rank")?;
        assert!(
            saves[1..].iter().all(|&n| n == saves[1]),
            "{world} ranks: {saves:?}"
        );
        assert!(last <= most + world as usize + 4, "{world} ranks: {last}");
        assert!(
            loads.iter().all(|&n| n == loads[0]),
            "{world} ranks: {loads:?}"
        );
        costs.push((most, loads[0]));
    }
    assert!(
        costs.iter().all(|&c| c == costs[0]),
        "by world size: {costs:?}"
    );
    Ok(())
}

/// Reports by save (issue 73, item 5): rank 0's shard of a save that
/// died and rank 1's shard of its relaunch are not "every rank landed":
/// the newest save is the relaunch, rank 1 landed, rank 0 is missing.
#[test]
fn an_incomplete_step_is_reported_by_its_newest_save() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = dir_remote(dir.path())?;
    assert!(!put(&remote, (3, 0, 2), "a")?.complete);
    // Apart in time as a relaunch is (listings keep milliseconds).
    std::thread::sleep(Duration::from_millis(50));
    assert!(!put(&remote, (3, 1, 2), "b")?.complete);
    let status = remote.shards(3)?;
    assert_eq!(
        (
            &status.landed[..],
            &status.missing[..],
            status.save,
            status.saves,
            status.complete
        ),
        (&[1][..], &[0][..], Some(SaveId::of("b")), 2, false),
        "{status:?}"
    );
    let url = remote.url().to_owned();
    let (code, out, err) = crate::common::ckpt(&["ls", &url, "--all"])?;
    assert_eq!(code, 0, "{err}");
    let said = format!(
        "3  incomplete: 1 of 2 ranks of the newest save {} landed (1), missing 0; shards of 1 \
         older saves beside it",
        SaveId::of("b")
    );
    assert!(out.contains(&said), "{out}");
    // The relaunch's rank 0 lands: the step is whole, of save "b".
    std::thread::sleep(Duration::from_millis(50));
    assert!(put(&remote, (3, 0, 2), "b")?.complete);
    let status = remote.shards(3)?;
    assert_eq!(
        (&status.landed[..], status.missing.len(), status.complete),
        (&[0, 1][..], 0, true)
    );
    Ok(())
}

/// Ranks of a rank-local save landing at once (issue 75, item 1), each
/// its own `Remote`, completing the step as `ckptstore.dcp` does through
/// the job's rendezvous store (here an atomic count and the names beside
/// it): every rank uploads its shard naming the save
/// (`ShardUpload::RankLocalShard`: no listing, no other rank's manifest
/// read), and the rank whose count completes the world commits the names
/// reported (`Remote::commit_reported`). Each rank's requests stay a
/// handful whatever the world, and the step is whole; with
/// `ShardUpload::RankLocal` instead, ranks landing at once list and read
/// each other's shards (printed beside, for comparison).
#[test]
fn ranks_landing_at_once_complete_the_step_with_the_names_they_report() -> Result {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier, Mutex};

    use ckptstore::ShardHash;
    use object_store::memory::InMemory;

    use super::faults::Failing;

    const WORLD: u32 = 16;
    /// Requests of each rank, and shard manifests it read, by rank.
    type Costs = Vec<(usize, usize)>;
    let save = |reported: bool| -> Result<(Arc<InMemory>, Costs)> {
        let memory = Arc::new(InMemory::new());
        let landed = AtomicUsize::new(0);
        let names: Mutex<Vec<Option<ShardHash>>> = Mutex::new(vec![None; WORLD as usize]);
        let barrier = Barrier::new(WORLD as usize);
        let rank = |rank: u32| -> Result<(usize, usize)> {
            let counting = Arc::new(Failing::new(memory.clone(), 0));
            let remote = Remote::with_store(counting.clone(), "run", "mem://run")?;
            let state = shard(7, rank, 1);
            let then = if reported {
                ShardUpload::RankLocalShard(SaveId::of("s"))
            } else {
                ShardUpload::RankLocal(SaveId::of("s"))
            };
            barrier.wait();
            let write = ShardWrite::new((7, rank, WORLD), ShardSource::Owned(&state), then);
            let info = remote.write_shard(write)?;
            if reported {
                names.lock().map_err(|_| "lock")?[rank as usize] = Some(info.shard);
                if landed.fetch_add(1, Ordering::SeqCst) + 1 == WORLD as usize {
                    let all = names.lock().map_err(|_| "lock")?.clone();
                    let all: Option<Vec<ShardHash>> = all.into_iter().collect();
                    remote.commit_reported(7, &all.ok_or("every rank's name")?)?;
                }
            }
            let gets = counting.gets.lock().map_err(|_| "lock")?;
            let shards_read = gets.iter().filter(|k| k.contains("/shards/")).count();
            Ok((counting.requests(), shards_read))
        };
        // A rank's error crosses back as its text (`Result`'s is not Send).
        let rank = |r: u32| rank(r).map_err(|e| e.to_string());
        let costs = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..WORLD).map(|r| s.spawn(move || rank(r))).collect();
            ranks
                .into_iter()
                .map(|h| h.join().map_err(|_| "a rank panicked".to_owned())?)
                .collect::<std::result::Result<Vec<_>, String>>()
        })?;
        Ok((memory, costs))
    };
    let (memory, costs) = save(true)?;
    let (_, listing) = save(false)?;
    let most = costs.iter().map(|c| c.0).max().ok_or("a rank")?;
    let by_listing = listing.iter().map(|c| c.0).max().ok_or("a rank")?;
    eprintln!(
        "{WORLD} ranks at once: requests per rank {:?} (reported names), {:?} (listing)",
        costs.iter().map(|c| c.0).collect::<Vec<_>>(),
        listing.iter().map(|c| c.0).collect::<Vec<_>>()
    );
    // A rank's upload is a handful of requests (the lock cycle, the
    // collection mark, its pack, its shard); the completing rank's commit
    // adds a lock cycle, the step's commits listed, the step's manifest,
    // the hint and the commit. No rank reads a shard manifest. (A rank's
    // listing of the locks returns the push locks of the ranks writing at
    // that moment: at thousands of ranks at once, pages of them.)
    let mut uploads: Vec<usize> = costs.iter().map(|c| c.0).collect();
    uploads.sort_unstable();
    let (upload, completing) = (uploads[uploads.len() - 2], uploads[uploads.len() - 1]);
    assert!(upload <= 7 && completing <= upload + 7, "{costs:?}");
    assert!(
        costs.iter().all(|c| c.1 == 0),
        "shard manifests read: {costs:?}"
    );
    let remote = Remote::with_store(memory, "run", "mem://run")?;
    assert_eq!(remote.steps()?, vec![7]);
    let status = remote.shards(7)?;
    assert!(status.complete && status.missing.is_empty(), "{status:?}");
    for rank in 0..WORLD {
        assert_eq!(remote.get_shard(7, rank)?, Some(shard(7, rank, 1)));
    }
    assert!(remote.verify()?.is_ok());
    eprintln!("the most a rank made: {most} reported, {by_listing} listing");
    assert!(by_listing >= most, "{listing:?}");
    Ok(())
}

/// A rank-local save whose completing rank died before its commit
/// (issue 75): every rank's shard of the save is there, but the step is
/// not listed until a relaunch's recovery (`Remote::complete_landed`)
/// finds the save whole and commits it; a save with a rank missing is
/// left as it is.
#[test]
fn a_save_whose_completing_rank_died_is_completed_by_the_recovery() -> Result {
    let dir = tempfile::tempdir()?;
    let remote = dir_remote(dir.path())?;
    let upload = |step: u64, rank: u32, save: &str| -> Result<ShardInfo> {
        let state = shard(step, rank, u64::from(save.as_bytes()[0]));
        let then = ShardUpload::RankLocalShard(SaveId::of(save));
        let write = ShardWrite::new((step, rank, 3), ShardSource::Owned(&state), then);
        Ok(remote.write_shard(write)?)
    };
    for rank in 0..3 {
        assert!(!upload(5, rank, "whole")?.complete);
    }
    for rank in 0..2 {
        upload(6, rank, "partial")?;
    }
    assert!(remote.steps()?.is_empty());
    assert_eq!(remote.complete_landed()?, vec![5]);
    assert_eq!(remote.steps()?, vec![5]);
    for rank in 0..3 {
        assert_eq!(
            remote.get_shard(5, rank)?,
            Some(shard(5, rank, u64::from(b'w')))
        );
    }
    assert!(!remote.shards(6)?.complete);
    assert!(remote.complete_landed()?.is_empty());
    Ok(())
}
