//! Requests counted (issue 39, item 6): what a global step costs the
//! bucket, with the limits pinned (request counts are deterministic). The
//! ranks are separate `Remote`s over one counting in-memory store, as
//! processes over one bucket are.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ckptstore::{Dtype, Entry, Remote, ShardSource, ShardUpload, ShardWrite, Step, Tensor};
use object_store::memory::InMemory;

use super::faults::Failing;
use super::Result;
use crate::common::bytes;

const MIB: usize = 1 << 20;
const RANKS: u32 = 4;

/// Rank `rank`'s shard of `step`: three tensors of 8 MiB (new data) and a
/// small blob. `compressible`: bf16 near zero (a few exponent bytes, as
/// trained weights are) rather than random bytes.
fn shard(step: u64, rank: u32, seed: u64, compressible: bool) -> Result<Step> {
    let mut c = Step::new(step);
    c.timestamp = 1_800_000_000 + step;
    for i in 0..3u64 {
        let mut data = bytes(seed * 100 + u64::from(rank) * 10 + i, 8 * MIB);
        if compressible {
            data.iter_mut().skip(1).step_by(2).for_each(|b| *b = 0x3c);
        }
        let w = Tensor::new(Dtype::BF16, vec![4 * MIB as u64], data)?;
        c.insert(format!("w{i}"), Entry::Tensor(w));
    }
    c.insert("rng", Entry::Blob(vec![rank as u8; 100]));
    Ok(c)
}

/// Requests per rank allowed for `bytes`: `per_gib` per GiB (rounded
/// up), plus 10.
fn allowed(per_gib: usize, bytes: usize) -> usize {
    (per_gib * bytes).div_ceil(1 << 30) + 10
}

#[test]
fn a_global_step_costs_requests_per_rank_not_per_chunk() -> Result {
    global_step_requests(false)
}

/// The same limits with chunks stored compressed: packs fill by raw bytes
/// and a read asks for the stored ranges, so compression adds no request
/// per chunk.
#[test]
fn a_compressed_global_step_keeps_the_same_request_limits() -> Result {
    global_step_requests(true)
}

fn global_step_requests(compress: bool) -> Result {
    let counting = Arc::new(Failing::new(Arc::new(InMemory::new()), 0));
    let open = || {
        Remote::with_store(counting.clone(), "run", "mem://run")
            .map(|r| r.with_compression(compress))
    };
    let ranks: Vec<Remote> = (0..RANKS)
        .map(|_| open())
        .collect::<ckptstore::Result<_>>()?;
    let new_bytes = 24 * MIB + 100;
    // Step 1: every rank's data is new.
    let mut names = Vec::new();
    for (rank, remote) in (0..RANKS).zip(&ranks) {
        counting.reset();
        let info = remote.upload_shard(1, rank, RANKS, &shard(1, rank, 1, compress)?)?;
        let n = counting.requests();
        assert!(n <= allowed(32, new_bytes), "rank {rank}: {n} requests");
        eprintln!("rank {rank}: a save of 24 MiB of new data, {n} requests");
        if compress {
            // The chunks went compressed (this is that path's count).
            assert!(info.bytes_uploaded < new_bytes as u64 * 4 / 5, "{info:?}");
        } else {
            assert_eq!(info.bytes_uploaded, new_bytes as u64);
        }
        names.push(info.shard);
    }
    counting.reset();
    ranks[0].commit_global(1, &names)?;
    let n = counting.requests();
    assert!(n <= 2 * RANKS as usize + 10, "finish: {n} requests");
    eprintln!("the coordinator's commit of {RANKS} ranks: {n} requests");
    // Step 2, the same state: nothing uploaded, a few requests per rank.
    let mut again = Vec::new();
    for (rank, remote) in (0..RANKS).zip(&ranks) {
        counting.reset();
        let mut same = shard(1, rank, 1, compress)?;
        same.step = 2;
        let info = remote.upload_shard(2, rank, RANKS, &same)?;
        let n = counting.requests();
        assert!(n <= 10, "rank {rank}, unchanged: {n} requests");
        eprintln!("rank {rank}: a save of the same state, {n} requests");
        assert_eq!(info.bytes_uploaded, 0, "{info:?}");
        again.push(info.shard);
    }
    ranks[0].commit_global(2, &again)?;
    // A load: each rank, from a new remote, reads its whole shard.
    for rank in 0..RANKS {
        let reader = open()?;
        counting.reset();
        let global = reader.open_global(2)?.ok_or("complete")?;
        let entries = reader.entries(&global, rank)?;
        let pieces: Vec<_> = entries
            .iter()
            .map(|(n, e)| (rank, n.as_str(), 0, e.len))
            .collect();
        let got = reader.read_pieces(&global, &pieces)?;
        let n = counting.requests();
        assert!(
            n <= allowed(80, new_bytes),
            "rank {rank}, load: {n} requests"
        );
        eprintln!("rank {rank}: open the step and read its whole shard, {n} requests");
        let want = shard(1, rank, 1, compress)?;
        assert!(got[0] == want.entries["rng"].bytes() && got[1] == want.entries["w0"].bytes());
        // A restarted job saves after its load: what it loaded is not
        // uploaded again.
        let mut same = want;
        same.step = 3;
        let info = reader.upload_shard(3, rank, RANKS, &same)?;
        assert_eq!(info.bytes_uploaded, 0, "rank {rank}: {info:?}");
    }
    Ok(())
}

/// The coordinator's commit of 256 ranks reads their shard manifests
/// many at once (a bucket tens of milliseconds away would otherwise take
/// 256 round trips), in a request per rank, and still refuses a shard
/// that is not there.
#[test]
fn the_coordinators_commit_checks_shards_many_at_once() -> Result {
    const N: u32 = 256;
    let counting = Arc::new(Failing::new(Arc::new(InMemory::new()), 0));
    let open = || Remote::with_store(counting.clone(), "run", "mem://run");
    let mut names = Vec::new();
    for rank in 0..N {
        let mut c = Step::new(4);
        c.insert("rank", Entry::Blob(rank.to_le_bytes().to_vec()));
        names.push(open()?.upload_shard(4, rank, N, &c)?.shard);
    }
    *counting.get_delay.lock().map_err(|_| "lock")? = std::time::Duration::from_millis(2);
    counting.reset();
    let mut gone = names.clone();
    gone[200] = names[0];
    let e = open()?
        .commit_global(4, &gone)
        .expect_err("rank 200's shard is not there");
    assert!(e.to_string().contains("shard"), "{e}");
    open()?.commit_global(4, &names)?;
    let (n, most) = (
        counting.requests(),
        counting.most_gets_in_flight.load(Ordering::SeqCst),
    );
    eprintln!("the coordinator's commit of {N} ranks twice: {n} requests, {most} reads at once");
    assert!(n <= 2 * (N as usize + 10), "{n} requests");
    assert!((32..=64).contains(&most), "{most} shard reads at once");
    Ok(())
}

/// A global step of 256 ranks (separate `Remote`s, one after another):
/// the coordinator's commit costs O(ranks), and a restore at 256 ranks
/// costs each rank a few requests and its own shard, not every rank's.
#[test]
fn a_step_of_256_ranks_opens_in_requests_per_rank() -> Result {
    const N: u32 = 256;
    let counting = Arc::new(Failing::new(Arc::new(InMemory::new()), 0));
    let open = || Remote::with_store(counting.clone(), "run", "mem://run");
    let shard = |rank: u32| -> Result<Step> {
        let mut c = Step::new(9);
        c.timestamp = 1_800_000_009;
        let data = bytes(u64::from(rank), 96 << 10);
        c.insert(
            "w",
            Entry::Tensor(Tensor::new(Dtype::U8, vec![96 << 10], data)?),
        );
        Ok(c)
    };
    let mut names = Vec::new();
    for rank in 0..N {
        names.push(open()?.upload_shard(9, rank, N, &shard(rank)?)?.shard);
    }
    counting.reset();
    open()?.commit_global(9, &names)?;
    let finish = counting.requests();
    assert!(finish <= 2 * N as usize + 10, "finish: {finish} requests");
    counting.reset();
    for rank in 0..N {
        let reader = open()?;
        let global = reader.open_global(9)?.ok_or("complete")?;
        let got = reader.read_pieces(&global, &[(rank, "w", 0, 96 << 10)])?;
        assert!(got[0] == shard(rank)?.entries["w"].bytes(), "rank {rank}");
    }
    let restore = counting.requests();
    assert!(
        restore <= N as usize * (10 + 1),
        "restore: {restore} requests"
    );
    eprintln!(
        "{N} ranks: the coordinator's commit {finish} requests; a restore {restore} \
         ({} per rank)",
        restore / N as usize
    );
    Ok(())
}

/// The newest step of a bucket of 1,200 steps costs a GET of the hint, a
/// listing of the commits from the hinted step on and a GET of its
/// manifest, not a listing of every commit; a hint that names a step
/// whose commit is gone, or that is not a hint at all, costs a longer
/// search, never a wrong answer.
#[test]
fn the_newest_step_is_found_without_listing_every_commit() -> Result {
    const STEPS: u64 = 1_200;
    let counting = Arc::new(Failing::new(Arc::new(InMemory::new()), 0));
    let remote = Remote::with_store(counting.clone(), "run", "mem://run")?;
    for step in 1..=STEPS {
        let mut c = Step::new(step);
        c.insert("rng", Entry::Blob(step.to_le_bytes().to_vec()));
        let shard = remote.upload_shard(step, 0, 1, &c)?.shard;
        remote.commit_global(step, &[shard])?;
    }
    counting.reset();
    assert_eq!(remote.latest_step()?, Some(STEPS));
    let (n, listed) = (counting.requests(), counting.listed());
    eprintln!("the newest of {STEPS} steps: {n} requests, {listed} objects listed");
    assert!(n <= 3 && listed <= 2, "{n} requests, {listed} listed");

    // Opening the newest step for a load lists once: the requests of
    // `latest_step` and the collection mark, not those and a listing of
    // the step's commits again.
    counting.reset();
    let newest = remote.open_latest_global()?.ok_or("a complete step")?;
    let (one, listed) = (counting.requests(), counting.listed());
    counting.reset();
    let step = remote.latest_step()?.ok_or("a complete step")?;
    let two = remote.open_global(step)?.ok_or("a complete step")?;
    let both = counting.requests();
    eprintln!("the newest step opened: {one} requests in one listing, {both} in two");
    assert_eq!((newest.step(), newest.commit()), (two.step(), two.commit()));
    assert!(
        one <= 4 && listed <= 2 && one < both,
        "{one} requests ({listed} listed), {both} in two"
    );

    let hint = object_store::path::Path::from("run/hints/latest");
    let put = |bytes: &[u8]| -> Result {
        let payload = object_store::PutPayload::from(bytes.to_vec());
        futures::executor::block_on(object_store::ObjectStoreExt::put(
            counting.inner.as_ref(),
            &hint,
            payload,
        ))?;
        Ok(())
    };
    for stale in [
        &br#"{"format":1,"step":99999}"#[..],
        br#"{"format":1,"step":7}"#,
        b"\xff not a hint",
        br#"{"format":9,"step":1}"#,
    ] {
        put(stale)?;
        assert_eq!(
            remote.latest_step()?,
            Some(STEPS),
            "{}",
            String::from_utf8_lossy(stale)
        );
        let opened = remote.open_latest_global()?.map(|g| g.step());
        assert_eq!(opened, Some(STEPS), "{}", String::from_utf8_lossy(stale));
    }
    Ok(())
}

/// A coordinator's save in one lock cycle (issue 53, item 6): its shard
/// and the step's commit under one push lock, its own shard not read
/// back. An unchanged one-rank save costs at most 10 requests, where the
/// two calls (`upload_shard`, then `commit_global`) cost more.
#[test]
fn a_coordinators_save_is_one_lock_cycle() -> Result {
    let counting = Arc::new(Failing::new(Arc::new(InMemory::new()), 0));
    let remote = Remote::with_store(counting.clone(), "run", "mem://run")?;
    let none = std::collections::BTreeMap::new();
    let save = |step: u64, combined: bool| -> Result<usize> {
        let mut same = shard(1, 0, 1, false)?;
        same.step = step;
        counting.reset();
        if combined {
            remote.write_shard(ShardWrite::new(
                (step, 0, 1),
                ShardSource::Borrowed(&same, &none),
                ShardUpload::Commit(vec![None]),
            ))?;
        } else {
            let name = remote.upload_shard(step, 0, 1, &same)?.shard;
            remote.commit_global(step, &[name])?;
        }
        Ok(counting.requests())
    };
    save(1, true)?;
    let (one, two) = (save(2, true)?, save(3, false)?);
    eprintln!("an unchanged one-rank save: {one} requests in one lock cycle, {two} in two");
    assert!(
        one <= 10 && one < two,
        "{one} requests in one cycle, {two} in two"
    );
    assert_eq!(remote.steps()?, vec![1, 2, 3]);
    let mut want = shard(1, 0, 1, false)?;
    want.step = 2;
    assert!(remote.get_shard(2, 0)? == Some(want));
    // The other ranks' names are checked before anything is uploaded.
    let err = remote
        .write_shard(ShardWrite::new(
            (4, 0, 2),
            ShardSource::Borrowed(&shard(4, 0, 1, false)?, &none),
            ShardUpload::Commit(vec![None, None]),
        ))
        .expect_err("another rank's shard not named");
    assert!(err.to_string().contains("shard 1: no shard named"), "{err}");
    assert_eq!(remote.steps()?, vec![1, 2, 3]);
    Ok(())
}
