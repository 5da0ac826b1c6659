//! Commits, in three parts: a plan with no database ([`Plan`]), staging
//! (large commits only), and the one transaction that makes the step.

use std::collections::BTreeMap;
use std::time::Instant;

use super::CheckpointStore;
use crate::checkpoint::Incoming;
use crate::db::{Db, TxnKind};
use crate::engine::hashing::{with_hashes, with_known_hashes};
use crate::engine::plan::{Borrowed, Plan, Streamed};
use crate::format::layout::{split, PACK_BELOW};
use crate::format::manifest::Hash;
#[cfg(doc)]
use crate::Error;
use crate::{CommitInfo, GradientCheckpoint, Result, Tensor, TensorRef};

/// The most new chunk bytes one transaction writes: 3/8 of the page
/// cache. redb keeps a transaction's new pages in a write buffer of half
/// its cache, and pages it must evict before the commit it reads back and
/// writes again at the commit (to fill in their checksums); the other
/// eighth is room for the b-tree pages. A commit with more stages its
/// chunks in transactions of this size first.
fn part_bytes(settings: &crate::options::Settings) -> usize {
    settings.cache_size / 8 * 3
}

impl CheckpointStore {
    /// Store `ckpt` under `ckpt.step` in one write transaction.
    ///
    /// When it returns `Ok`, the step is complete and (with the default
    /// [`Durability::Immediate`](crate::Durability::Immediate)) on disk.
    /// Unchanged chunks already in the store are referenced, not rewritten.
    /// The store's retention policy, if any, runs in the same transaction.
    ///
    /// # Errors
    /// [`Error::InvalidCheckpoint`] for a non-finite metric (nothing is
    /// written); [`Error::StepExists`] if the step is stored already (nothing
    /// is changed; use [`replace`](Self::replace)); [`Error::ReadOnly`] on a
    /// read-only store; [`Error::Storage`] when redb or the disk fails, after
    /// which the store reopens its file on the next call. After an I/O error
    /// the step may or may not have been committed (the error can strike
    /// after the commit point); it is never partial: `get` tells.
    pub fn commit(&self, ckpt: &GradientCheckpoint) -> Result<CommitInfo> {
        put(&self.db, ckpt, &Borrowed::new(), false, Caller::Foreground)
    }

    /// Store `ckpt`, replacing the step of the same number if it is stored,
    /// in one write transaction.
    ///
    /// ```
    /// # use ckptstore::{CheckpointStore, ComputationGraphStore, GradientCheckpoint};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let first = GradientCheckpoint::new(ComputationGraphStore::new(), 5);
    /// store.commit(&first)?;
    /// let second = first.clone().with_loss_cid("cid_new_loss");
    /// assert!(store.commit(&second).is_err());
    /// store.replace(&second)?;
    /// assert_eq!(store.get(5)?, Some(second));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn replace(&self, ckpt: &GradientCheckpoint) -> Result<CommitInfo> {
        put(&self.db, ckpt, &Borrowed::new(), true, Caller::Foreground)
    }

    /// [`commit`](Self::commit) `ckpt` with the tensors `tensors` added,
    /// whose bytes are hashed and written from where they lie: no copy of
    /// them is made. For state that lives in buffers the caller owns (the
    /// Python package commits numpy arrays and torch tensors this way).
    ///
    /// ```
    /// use std::collections::BTreeMap;
    /// use ckptstore::{CheckpointStore, ComputationGraphStore, Dtype, GradientCheckpoint, TensorRef};
    /// # let dir = tempfile::tempdir()?;
    /// # let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    /// let weights: Vec<f32> = vec![0.5; 1 << 16];
    /// let bytes: Vec<u8> = weights.iter().flat_map(|w| w.to_le_bytes()).collect();
    /// let mut tensors = BTreeMap::new();
    /// tensors.insert("w".to_owned(), TensorRef::new(Dtype::F32, vec![256, 256], &bytes)?);
    /// let ckpt = GradientCheckpoint::new(ComputationGraphStore::new(), 1);
    /// store.commit_borrowed(&ckpt, &tensors)?;
    /// let w = store.get_tensor(1, "w")?.expect("stored");
    /// assert_eq!((w.shape, w.data), (vec![256, 256], bytes));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// As [`commit`](Self::commit); [`Error::InvalidCheckpoint`] if a name
    /// of `tensors` is also a blob or tensor of `ckpt`.
    pub fn commit_borrowed(
        &self,
        ckpt: &GradientCheckpoint,
        tensors: &BTreeMap<String, TensorRef<'_>>,
    ) -> Result<CommitInfo> {
        self.put_borrowed(ckpt, tensors, false)
    }

    /// [`replace`](Self::replace) with borrowed tensors, as
    /// [`commit_borrowed`](Self::commit_borrowed): the step of the same
    /// number, if stored, is replaced in the same write transaction, so a
    /// crash leaves either the old step or the new one.
    ///
    /// # Errors
    /// As [`commit_borrowed`](Self::commit_borrowed), without
    /// [`Error::StepExists`](crate::Error::StepExists).
    pub fn replace_borrowed(
        &self,
        ckpt: &GradientCheckpoint,
        tensors: &BTreeMap<String, TensorRef<'_>>,
    ) -> Result<CommitInfo> {
        self.put_borrowed(ckpt, tensors, true)
    }

    fn put_borrowed(
        &self,
        ckpt: &GradientCheckpoint,
        tensors: &BTreeMap<String, TensorRef<'_>>,
        replace: bool,
    ) -> Result<CommitInfo> {
        crate::engine::plan::check_borrowed(ckpt, tensors)?;
        put(&self.db, ckpt, tensors, replace, Caller::Foreground)
    }
}

/// Who waits for a commit, which decides the threads it may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Caller {
    /// The caller of `commit`: the store's `threads`.
    Foreground,
    /// The background committer: the store's `background_threads`.
    Background,
}

/// Store `ckpt` and the tensors `borrowed` (whose names are none of
/// `ckpt`'s): plan it, hash its chunks (on the threads `caller` may use)
/// while the transactions write, stage its chunks first if there are many.
pub(crate) fn put(
    db: &Db,
    ckpt: &GradientCheckpoint,
    borrowed: &Borrowed<'_>,
    replace: bool,
    caller: Caller,
) -> Result<CommitInfo> {
    let start = Instant::now();
    ckpt.validate()?;
    let plan = Plan::with_borrowed(ckpt, borrowed);
    let stage_above = part_bytes(db.settings());
    let threads = match caller {
        Caller::Foreground => db.settings().threads,
        Caller::Background => db.settings().background_threads,
    };
    // With pack files, a large commit's chunks never enter redb's pages:
    // no staging is needed.
    let chunk_bytes = plan.chunk_bytes();
    let packs = db.packs(chunk_bytes);
    let mut info = with_known_hashes(&plan.pieces, &plan.known, threads, |hashes| {
        if chunk_bytes > stage_above && !packs {
            commit_staged(db, &plan, replace, hashes, stage_above)
        } else {
            commit_once(
                db,
                &plan,
                replace,
                hashes,
                Ending {
                    staged: false,
                    packs,
                },
            )
        }
    })?;
    info.duration = start.elapsed();
    Ok(info)
}

/// How the transaction that makes a step ends what came before it.
#[derive(Clone, Copy)]
struct Ending {
    /// It ends a staging.
    staged: bool,
    /// Its new chunks go to a pack file.
    packs: bool,
}

/// The transaction that makes the step (and applies the store's retention
/// policy).
fn commit_once(
    db: &Db,
    plan: &Plan<'_>,
    replace: bool,
    hashes: &mut dyn Iterator<Item = Hash>,
    Ending { staged, packs }: Ending,
) -> Result<CommitInfo> {
    let step = plan.step();
    let what = || format!("committing step {step}");
    let policy = &db.settings().retention;
    db.write("commit", &what, TxnKind::Whole, |engine| {
        if packs {
            engine.pack_new_chunks()?;
        }
        let info = engine.put(plan, hashes, replace, policy)?;
        if staged {
            engine.end_staging()?;
        }
        Ok(info)
    })
}

/// Write the new chunks in transactions of up to `part_bytes` each, as
/// staged chunks that no step uses, then make the step. A failure deletes
/// what was staged (or, after a crash, the next writable open does).
fn commit_staged(
    db: &Db,
    plan: &Plan<'_>,
    replace: bool,
    hashes: &mut dyn Iterator<Item = Hash>,
    part_bytes: usize,
) -> Result<CommitInfo> {
    let step = plan.step();
    let what = || format!("committing step {step}");
    let _one_staging_at_a_time = db.staging()?;
    let mut staged = Vec::with_capacity(plan.pieces.len());
    let check = !replace;
    let result = stage(
        db,
        step,
        &plan.pieces,
        check,
        hashes,
        part_bytes,
        &mut staged,
    )
    .and_then(|healed| {
        // Staged: the chunks are in redb already, none go to a pack file.
        let ending = Ending {
            staged: true,
            packs: false,
        };
        let mut info = commit_once(db, plan, replace, &mut staged.iter().copied(), ending)?;
        info.chunks_healed += healed;
        Ok(info)
    });
    if result.is_err() {
        // Best effort: what is left is deleted at the next writable open.
        let _ = db.write("commit", &what, TxnKind::Whole, |engine| {
            engine.unstage(&staged)
        });
    }
    result
}

/// Stage `pieces` (of step `step`) in transactions of up to `part_bytes`;
/// with `check_exists`, the first refuses a stored step. Returns the
/// chunks healed (written again: their pack file was lost).
fn stage(
    db: &Db,
    step: u64,
    pieces: &[&[u8]],
    check_exists: bool,
    hashes: &mut dyn Iterator<Item = Hash>,
    part_bytes: usize,
    staged: &mut Vec<Hash>,
) -> Result<u64> {
    let what = || format!("committing step {step}");
    let mut rest = pieces;
    let mut first = check_exists;
    let mut healed = 0;
    while !rest.is_empty() {
        let mut n = 1;
        let mut bytes = rest[0].len();
        while n < rest.len() && bytes + rest[n].len() <= part_bytes {
            bytes += rest[n].len();
            n += 1;
        }
        let (part, tail) = rest.split_at(n);
        let packs = db.packs(bytes);
        db.write("commit", &what, TxnKind::Part, |engine| {
            if first && engine.has_step(step)? {
                return Err(crate::Error::StepExists { step });
            }
            if packs {
                engine.pack_new_chunks()?;
            }
            engine.stage(part, hashes, staged)
        })
        .map(|n| healed += n)?;
        first = false;
        rest = tail;
    }
    Ok(healed)
}

impl CheckpointStore {
    /// Commit `ckpt`'s metadata with blobs and tensors `read` gives one at
    /// a time, in the order of `incoming` (see [`put_streamed`]).
    #[cfg(feature = "remote")]
    pub(crate) fn commit_streamed(
        &self,
        ckpt: GradientCheckpoint,
        incoming: &[Incoming],
        read: &mut dyn FnMut(&Incoming) -> Result<Vec<u8>>,
    ) -> Result<CommitInfo> {
        put_streamed(&self.db, ckpt, incoming, read)
    }
}

/// Commit `ckpt` (its metadata; its blobs and tensors come from `read`,
/// one at a time, in the order of `incoming`) without holding more than a
/// part's worth of large blobs and tensors (and the largest one) in
/// memory: large ones are staged a part at a time, hashed on every core,
/// small ones are kept and packed with the step.
pub(crate) fn put_streamed(
    db: &Db,
    mut ckpt: GradientCheckpoint,
    incoming: &[Incoming],
    read: &mut dyn FnMut(&Incoming) -> Result<Vec<u8>>,
) -> Result<CommitInfo> {
    let start = Instant::now();
    let step = ckpt.step;
    let part_bytes = part_bytes(db.settings());
    let _one_staging_at_a_time = db.staging()?;
    let mut staged = Vec::new();
    let mut streamed = Vec::new();
    let mut healed = 0;
    let result = (|| {
        // Streamed tensors keep their type in the checkpoint, without data
        // (added once the checkpoint's own data has been validated).
        let mut hollow = Vec::new();
        let mut batch: Vec<(&Incoming, Vec<u8>)> = Vec::new();
        let mut batch_bytes = 0;
        for entry in incoming {
            let data = read(entry)?;
            if data.len() < PACK_BELOW {
                entry.place(&mut ckpt, data)?;
                continue;
            }
            if let Some((dtype, shape)) = &entry.tensor {
                let tensor = Tensor {
                    dtype: *dtype,
                    shape: shape.clone(),
                    data: Vec::new(),
                };
                hollow.push((entry.name.clone(), tensor));
            }
            batch_bytes += data.len();
            batch.push((entry, data));
            if batch_bytes >= part_bytes {
                let part = std::mem::take(&mut batch);
                healed += stage_batch(db, step, &part, &mut staged, &mut streamed)?;
                batch_bytes = 0;
            }
        }
        healed += stage_batch(db, step, &batch, &mut staged, &mut streamed)?;
        ckpt.validate()?;
        ckpt.tensors.extend(hollow);
        let plan = Plan::with_streamed(&ckpt, &streamed);
        let mut hashes = plan.pieces.iter().map(|p| *blake3::hash(p).as_bytes());
        let ending = Ending {
            staged: true,
            packs: db.packs(plan.chunk_bytes()),
        };
        commit_once(db, &plan, false, &mut hashes, ending)
    })();
    if result.is_err() {
        // Best effort: what is left is deleted at the next writable open.
        let what = || format!("committing step {step}");
        let _ = db.write("commit", &what, TxnKind::Whole, |engine| {
            engine.unstage(&staged)
        });
    }
    let mut info = result?;
    info.duration = start.elapsed();
    info.chunks_healed += healed;
    Ok(info)
}

/// Stage the large blobs and tensors of `batch` (hashed on every core),
/// recording each as streamed; the first staging of a step refuses a
/// stored step. Returns the chunks healed.
fn stage_batch(
    db: &Db,
    step: u64,
    batch: &[(&Incoming, Vec<u8>)],
    staged: &mut Vec<Hash>,
    streamed: &mut Vec<Streamed>,
) -> Result<u64> {
    if batch.is_empty() {
        return Ok(0);
    }
    let pieces: Vec<&[u8]> = batch.iter().flat_map(|(_, data)| split(data)).collect();
    let first = staged.len();
    let healed = with_hashes(&pieces, db.settings().threads, |hashes| {
        let part_bytes = part_bytes(db.settings());
        stage(db, step, &pieces, first == 0, hashes, part_bytes, staged)
    })?;
    let mut at = first;
    for (entry, data) in batch {
        let n = split(data).count();
        streamed.push(Streamed {
            name: entry.name.clone(),
            len: data.len() as u64,
            hashes: staged[at..at + n].to_vec(),
            typed: entry.tensor.is_some(),
        });
        at += n;
    }
    Ok(healed)
}
