//! Dedup never points at lost bytes, in a bucket (issue 65, item 1): a
//! writer relies only on packs it uploaded or confirmed itself; any other
//! pack it would deduplicate against (learned by a load, or from the
//! step below a push) is checked once, a HEAD per pack, and the chunks
//! of one deleted, cut short or replaced are uploaded again, so the step
//! the save acknowledges loads.

use std::sync::Arc;

use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint, Remote};
use object_store::memory::InMemory;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use super::faults::Failing;
use super::Result;
use crate::common::bytes;

const MIB: usize = 1 << 20;

/// How the packs are lost.
#[derive(Clone, Copy, Debug)]
pub(super) enum Loss {
    Deleted,
    /// Cut to half.
    Truncated,
    /// Another object of another length in its place.
    Replaced,
}

/// Step `step` of one rank: a frozen 8 MiB tensor, 2 MiB that change
/// with the step, and a small blob that never changes (as DCP's
/// metadata).
fn shard(step: u64) -> GradientCheckpoint {
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    c.timestamp = 1_800_000_000 + step;
    c.set_optimizer_state("frozen", bytes(7, 8 * MIB));
    c.set_optimizer_state("moving", bytes(100 + step, 2 * MIB));
    c.set_optimizer_state("metadata", vec![3; 500]);
    c
}

/// The keys of the bucket's pack objects.
fn packs(memory: &InMemory, prefix: &str) -> Result<Vec<object_store::ObjectMeta>> {
    Ok(futures::executor::block_on(async {
        use futures::TryStreamExt;
        let at = format!("{prefix}/packs").into();
        memory.list(Some(&at)).try_collect::<Vec<_>>().await
    })?)
}

/// Lose every pack under `prefix` as `loss` says.
pub(super) fn lose(memory: &InMemory, prefix: &str, loss: Loss) -> Result {
    let found = packs(memory, prefix)?;
    assert!(!found.is_empty(), "no packs");
    for meta in found {
        let at = &meta.location;
        let len = usize::try_from(meta.size)?;
        futures::executor::block_on(async {
            match loss {
                Loss::Deleted => memory.delete(at).await,
                Loss::Truncated => memory
                    .put(at, PutPayload::from(vec![1u8; len / 2]))
                    .await
                    .map(drop),
                Loss::Replaced => memory
                    .put(at, PutPayload::from(vec![2u8; len + 10]))
                    .await
                    .map(drop),
            }
        })?;
    }
    Ok(())
}

/// Every byte of step `step`'s one shard, read by a new remote.
fn read_back(open: &dyn Fn() -> ckptstore::Result<Remote>, step: u64) -> Result<()> {
    let reader = open()?;
    let global = reader.open_global(step)?.ok_or("complete")?;
    let entries = reader.entries(&global, 0)?;
    let pieces: Vec<_> = entries
        .iter()
        .map(|(n, e)| (0, n.as_str(), 0, e.len))
        .collect();
    let got = reader.read_pieces(&global, &pieces)?;
    let want = shard(step);
    for ((name, _), bytes) in entries.iter().zip(got) {
        assert!(bytes == want.optimizer_state[name], "step {step}: {name}");
    }
    Ok(())
}

/// An in-memory bucket, and the requests made of it counted.
fn bucket() -> (Arc<InMemory>, Arc<Failing>) {
    let memory = Arc::new(InMemory::new());
    let counting = Arc::new(Failing::new(memory.clone(), 0));
    (memory, counting)
}

/// Step 1 saved by one remote, then loaded (its frozen tensor) by a new
/// one, which is returned: it knows where step 1's chunks lie, and has
/// confirmed none of its packs.
fn saved_then_loaded(open: &dyn Fn() -> ckptstore::Result<Remote>) -> Result<Remote> {
    let first = open()?;
    let info = first.upload_shard(1, 0, 1, &shard(1).into_step())?;
    first.commit_global(1, &[info.shard])?;
    let job = open()?;
    let global = job.open_global(1)?.ok_or("complete")?;
    job.read_pieces(&global, &[(0, "frozen", 0, 8 * MIB as u64)])?;
    Ok(job)
}

#[test]
fn a_save_after_its_packs_were_lost_uploads_their_chunks_again() -> Result {
    for loss in [Loss::Deleted, Loss::Truncated, Loss::Replaced] {
        let (memory, counting) = bucket();
        let open = || Remote::with_store(counting.clone(), "run", "mem://run");
        // The job comes back: it loads step 1 (and so knows where its
        // chunks lie), then the bucket loses the packs.
        let job = saved_then_loaded(&open)?;
        read_back(&open, 1)?;
        lose(&memory, "run", loss)?;
        counting.reset();
        let info = job.upload_shard(2, 0, 1, &shard(2).into_step())?;
        let asked = counting.requests();
        job.commit_global(2, &[info.shard])?;
        // Everything uploaded again: nothing was there to rely on.
        assert_eq!(
            info.bytes_uploaded,
            (10 * MIB + 500) as u64,
            "{loss:?}: {info:?}"
        );
        read_back(&open, 2).map_err(|e| format!("{loss:?}: {e}"))?;
        // The same state saved again relies on what this save uploaded:
        // nothing new, and the requests of an unchanged save.
        let mut same = shard(2);
        same.step = 3;
        counting.reset();
        let info = job.upload_shard(3, 0, 1, &same.into_step())?;
        let unchanged = counting.requests();
        assert_eq!(info.bytes_uploaded, 0, "{loss:?}: {info:?}");
        assert!(unchanged <= 10, "{loss:?}: {unchanged} requests");
        eprintln!(
            "{loss:?}: the save after the loss {asked} requests, an unchanged one {unchanged}"
        );
    }
    Ok(())
}

#[test]
fn a_pack_learned_by_a_load_is_confirmed_once_then_relied_on() -> Result {
    let (_, counting) = bucket();
    let open = || Remote::with_store(counting.clone(), "run", "mem://run");
    let job = saved_then_loaded(&open)?;
    // Each save's requests.
    let save = |step: u64| -> Result<usize> {
        counting.reset();
        let info = job.upload_shard(step, 0, 1, &shard(step).into_step())?;
        job.commit_global(step, &[info.shard])?;
        Ok(counting.requests())
    };
    // The first save after the load: one HEAD more than the next one.
    let after_load = save(2)?;
    let after_that = save(3)?;
    assert_eq!(after_load, after_that + 1, "{after_load} then {after_that}");
    read_back(&open, 3)?;
    Ok(())
}

#[test]
fn a_push_after_a_lost_pack_uploads_its_chunks_again() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    store.commit(&shard(1))?;
    let memory = Arc::new(InMemory::new());
    let open = || Remote::with_store(memory.clone(), "run", "mem://run");
    open()?.push(&store)?;
    lose(&memory, "run", Loss::Deleted)?;
    store.commit(&shard(2))?;
    // Another process pushes step 2, over step 1 as the bucket holds it.
    let report = open()?.push(&store)?;
    assert_eq!(report.steps_pushed, vec![2], "{report:?}");
    assert_eq!(open()?.get(2)?, Some(shard(2)));
    Ok(())
}
