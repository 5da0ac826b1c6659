//! What a store remembers of a bucket: a push asks only about what changed
//! (counted requests), and a collection that deleted what the store
//! remembered makes the next push look again.

use std::sync::Arc;

use ckptstore::{
    CheckpointStore, ComputationGraphStore, Durability, GradientCheckpoint, Remote, Retention,
    StoreOptions,
};
use object_store::memory::InMemory;
use object_store::{ObjectStoreExt, PutPayload};

use crate::common::bytes;
use crate::faults::Failing;
use crate::Result;

fn small(step: u64) -> GradientCheckpoint {
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    c.timestamp = 1_700_000_000 + step;
    c.set_optimizer_state("rng", bytes(step, 200));
    c
}

#[test]
fn pushing_a_step_into_a_large_bucket_costs_what_changed() -> Result {
    const STEPS: u64 = 1_000;
    const OTHER_CHUNKS: usize = 100_000;
    let dir = tempfile::tempdir()?;
    let store = StoreOptions::new()
        .shared(false)
        .durability(Durability::Eventual)
        .open(dir.path().join("run.ckpt"))?;
    for step in 0..STEPS {
        store.commit(&small(step))?;
    }
    let memory = Arc::new(InMemory::new());
    futures::executor::block_on(async {
        for i in 0..OTHER_CHUNKS {
            let key = format!("p/chunks/{}", blake3::hash(&i.to_le_bytes()).to_hex());
            memory
                .put(&key.as_str().into(), PutPayload::from_static(b"x"))
                .await?;
        }
        Ok::<(), object_store::Error>(())
    })?;
    let counting = Arc::new(Failing::new(memory, 0));
    let remote = Remote::with_store(counting.clone(), "p", "mem://count")?;
    assert_eq!(remote.push(&store)?.steps_pushed.len(), STEPS as usize);

    // A new step: two 1.5 MiB blobs of new bytes, and a small blob.
    let mut next = small(STEPS);
    next.set_optimizer_state("a", bytes(1, 1_500_000));
    next.set_optimizer_state("b", bytes(2, 1_500_000));
    store.commit(&next)?;
    counting.reset();
    let report = remote.push(&store)?;
    assert_eq!(report.steps_pushed, vec![STEPS]);
    // k: the step's chunks, all new bytes, uploaded in one pack: a few
    // requests whatever k (nothing is asked of the bucket per chunk).
    let k = usize::try_from(report.chunks_uploaded)?;
    assert!((3..40).contains(&k), "{report:?}");
    let requests = counting.requests();
    println!(
        "one new step into {OTHER_CHUNKS} chunks and {STEPS} steps: k = {k}, {requests} requests"
    );
    assert!(requests <= 12, "{requests} requests for k = {k}");

    // Nothing new: a handful of requests, whatever the bucket holds.
    counting.reset();
    assert!(remote.push(&store)?.steps_pushed.is_empty());
    assert!(counting.requests() <= 10, "{}", counting.requests());
    // Listing the bucket instead costs a request per 1,000 objects (and a
    // repair a GET of each step's manifest).
    counting.reset();
    assert!(remote.repair(&store)?.steps_pushed.is_empty());
    let listing = counting.requests();
    println!("a push with nothing new: listing the bucket costs {listing} requests");
    assert!(listing > OTHER_CHUNKS / 1000, "{listing}");
    assert_eq!(remote.get(STEPS)?, Some(next));

    // The newest step: the hint, the commits from it on, one manifest.
    counting.reset();
    assert_eq!(remote.latest_step()?, Some(STEPS));
    let latest = counting.requests();
    println!("latest_step(): {latest} requests");
    assert!(latest <= 3, "{latest}");
    assert_eq!(remote.steps()?.len(), STEPS as usize + 1);
    Ok(())
}

#[test]
fn a_collection_that_deleted_remembered_chunks_is_noticed() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    let big = |step: u64, seed: u64| {
        let mut c = small(step);
        c.set_optimizer_state("w", bytes(seed, 3 << 20));
        c
    };
    store.commit(&big(1, 100))?;
    store.commit(&big(2, 200))?;
    let url = format!("file://{}", dir.path().join("bucket").display());
    let remote = Remote::open(&url)?.with_grace_period(std::time::Duration::ZERO);
    remote.push(&store)?; // the remote knows where step 1's chunks lie

    // Another process deletes step 1 from the bucket and collects its
    // pack.
    let other = Remote::open(&url)?.with_grace_period(std::time::Duration::ZERO);
    let gc = other.gc(&Retention::new().keep_last(1))?;
    assert!(gc.packs_deleted >= 1, "{gc:?}");

    // The store now commits step 3 with step 1's bytes: its chunks must be
    // uploaded again, though the remote once knew them to be there.
    store.commit(&big(3, 100))?;
    let report = remote.push(&store)?;
    assert_eq!(report.steps_pushed, vec![3]);
    assert!(report.chunks_uploaded >= 3, "{report:?}");
    let verified = remote.verify()?;
    assert!(verified.is_ok(), "{verified:?}");
    assert_eq!(remote.get(3)?, store.get(3)?);
    Ok(())
}

#[test]
fn a_bucket_made_again_at_the_same_url_is_listed_again() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    store.commit(&small(1))?;
    let bucket = dir.path().join("bucket");
    let url = format!("file://{}", bucket.display());
    Remote::open(&url)?.push(&store)?;
    std::fs::remove_dir_all(&bucket)?;
    let report = Remote::open(&url)?.push(&store)?;
    assert_eq!(report.steps_pushed, vec![1]);
    assert_eq!(Remote::open(&url)?.get(1)?, store.get(1)?);
    Ok(())
}

#[test]
fn a_step_replaced_locally_is_pushed_again() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    store.commit(&small(1))?;
    let url = format!("file://{}", dir.path().join("bucket").display());
    let remote = Remote::open(&url)?;
    remote.push(&store)?;
    let mut redone = small(1);
    redone.set_optimizer_state("rng", bytes(99, 200));
    store.replace(&redone)?;
    assert_eq!(remote.push(&store)?.steps_pushed, vec![1]);
    assert_eq!(remote.get(1)?, Some(redone.clone()));
    store.remove(1)?;
    store.commit(&small(1))?;
    assert_eq!(remote.push(&store)?.steps_pushed, vec![1]);
    assert_eq!(remote.get(1)?, Some(small(1)));
    drop(store);
    // A store that remembers a bucket is marked format 4, which 0.3 refuses
    // (it would replace steps without forgetting them).
    let db = redb::Database::open(dir.path().join("run.ckpt"))?;
    let txn = redb::ReadableDatabase::begin_read(&db)?;
    let meta = txn.open_table(redb::TableDefinition::<&str, &[u8]>::new("meta"))?;
    let format = meta.get("format_version")?.ok_or("no format")?;
    assert_eq!(format.value(), 4u32.to_le_bytes().as_slice());
    Ok(())
}

#[test]
fn a_push_from_a_read_only_store_makes_the_writer_list_again() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("run.ckpt");
    let writer = CheckpointStore::open(&path)?;
    writer.commit(&small(1))?;
    let url = format!("file://{}", dir.path().join("bucket").display());
    let remote = Remote::open(&url)?;
    remote.push(&writer)?; // the writer remembers step 1
    writer.commit(&small(2))?;
    // `ckpt push` beside the writer: a read-only store pushes step 2,
    // which the writer cannot know of.
    let reader = CheckpointStore::open_read_only(&path)?;
    assert_eq!(Remote::open(&url)?.push(&reader)?.steps_pushed, vec![2]);
    // The writer replaces step 2: its push must supersede the reader's
    // commit (a newer generation), which it learns of by listing.
    let mut redone = small(2);
    redone.set_optimizer_state("rng", bytes(77, 200));
    writer.replace(&redone)?;
    assert_eq!(remote.push(&writer)?.steps_pushed, vec![2]);
    assert_eq!(Remote::open(&url)?.get(2)?, Some(redone));
    Ok(())
}
