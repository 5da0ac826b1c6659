//! A global step read piece by piece: a reader that needs a few byte
//! ranges of a few entries (a DCP load at another world size) fetches only
//! the chunks those ranges overlap, each hash-checked, and nothing of the
//! other entries or shards. Opening a step reads its commit's manifest
//! (the list of its shards); a shard's manifest is read the first time one
//! of its entries is, so a rank of a load reads the shards it needs, not
//! every rank's.

use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;

use crate::engine::slices::ChunkSlice;
use crate::format::manifest::Hash;
use crate::remote::format::layout::{Commit, ShardName};
use crate::remote::format::manifest::{RemoteBlob, RemoteManifest, RemotePlace};
use crate::remote::format::stored::Stored;
use crate::remote::read::local::{place, Regions};
use crate::remote::read::restore::{blob_chunks, packed_want, Want};
use crate::remote::read::step::CommitBody;
use crate::remote::read::Reader;
use crate::{Error, Result};

/// One entry of a shard, as [`Remote::entries`](crate::Remote::entries) lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EntryInfo {
    /// Its length in bytes.
    pub len: u64,
    /// A tensor's dtype name and shape; `None` for an untyped blob.
    pub tensor: Option<(String, Vec<u64>)>,
}

/// A complete step opened for reads of parts of its entries
/// ([`Remote::open_global`](crate::Remote::open_global)): its commit's manifest, and each shard's
/// manifest (checked against its hash) once one of its entries is asked
/// for. A step pushed from one store reads as a global step of one rank.
#[derive(Clone, Debug)]
pub struct GlobalStep {
    step: u64,
    /// The name of the commit object it was opened from.
    commit: String,
    /// Each rank's shard, by rank: its name, and its manifest once read.
    ids: Vec<Option<ShardName>>,
    shards: Vec<OnceLock<RemoteManifest>>,
    /// The bucket's collection mark when it was opened: what its shards
    /// say of the packs is remembered under it.
    mark: Option<Vec<u8>>,
}

/// A byte range of one entry of one rank's shard: `(rank, name, offset,
/// len)`.
pub type Piece<'a> = (u32, &'a str, u64, u64);

impl GlobalStep {
    /// The step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The commit it was opened from (the name of its commit object):
    /// readers that must read one save agree on it, and open exactly it
    /// with [`Remote::open_global_commit`](crate::Remote::open_global_commit).
    pub fn commit(&self) -> &str {
        &self.commit
    }

    /// Its number of shards (ranks).
    pub fn world_size(&self) -> u32 {
        u32::try_from(self.shards.len()).unwrap_or(u32::MAX)
    }

    /// Rank `rank`'s shard manifest, if read.
    fn shard(&self, rank: u32) -> Option<&RemoteManifest> {
        self.shards.get(usize::try_from(rank).ok()?)?.get()
    }

    fn blob(&self, piece: &Piece<'_>) -> Result<&RemoteBlob> {
        let (rank, name, offset, len) = *piece;
        let step = self.step;
        let blob = self
            .shard(rank)
            .and_then(|m| m.blobs.get(name))
            .ok_or_else(|| Error::InvalidCheckpoint {
                step,
                reason: format!("rank {rank}'s shard has no entry {name:?}"),
            })?;
        if offset.checked_add(len).is_none_or(|end| end > blob.len) {
            return Err(Error::InvalidCheckpoint {
                step,
                reason: format!(
                    "bytes {offset}..+{len} of {name:?} (rank {rank}): it has {}",
                    blob.len
                ),
            });
        }
        Ok(blob)
    }
}

impl Reader<'_> {
    /// Does the work of [`Remote::open_global`](crate::Remote::open_global).
    pub(crate) fn open_global(&self, step: u64) -> Result<Option<GlobalStep>> {
        self.open_global_where(step, None)
    }

    /// Does the work of [`Remote::open_global_commit`](crate::Remote::open_global_commit).
    pub(crate) fn open_global_commit(&self, step: u64, commit: &str) -> Result<Option<GlobalStep>> {
        self.open_global_where(step, Some(commit))
    }

    /// Does the work of [`Remote::open_latest_global`](crate::Remote::open_latest_global):
    /// the newest commits listed once (from the hinted step on, else all),
    /// the newest that checks out opened.
    pub(crate) fn open_latest_global(&self) -> Result<Option<GlobalStep>> {
        let mark = self.current_mark()?;
        let (newest, hint) = self.newest_commits()?;
        if let Some(global) = self.open_newest(newest, mark.as_ref())? {
            return Ok(Some(global));
        }
        match hint {
            Some(hint) => self.open_newest(self.commits_before(hint)?, mark.as_ref()),
            None => Ok(None),
        }
    }

    /// The newest commit of `step` whose manifest checks out (that is
    /// `only`, if given): its shards are read when first needed.
    fn open_global_where(&self, step: u64, only: Option<&str>) -> Result<Option<GlobalStep>> {
        // Read first: a collection that starts later writes a new mark, and
        // what is learnt of the packs is then forgotten by the next save.
        let mark = self.current_mark()?;
        let commits: Vec<_> = self
            .commits_of(step)?
            .into_iter()
            .filter(|c| only.is_none_or(|name| c.to_string() == name))
            .collect();
        self.open_newest(commits, mark.as_ref())
    }

    /// The newest of `commits` (ascending) whose manifest checks out,
    /// opened: its shards are read when first needed.
    fn open_newest(
        &self,
        mut commits: Vec<Commit>,
        mark: Option<&Vec<u8>>,
    ) -> Result<Option<GlobalStep>> {
        commits.reverse();
        for commit in commits {
            let (ids, shards) = match self.read_commit(commit, None)? {
                Ok(CommitBody::Single(m)) => (vec![None], vec![OnceLock::from(*m)]),
                Ok(CommitBody::Sharded(ids)) => {
                    let n = ids.len();
                    (
                        ids.into_iter().map(Some).collect(),
                        (0..n).map(|_| OnceLock::new()).collect(),
                    )
                }
                Err(_) => continue,
            };
            let global = GlobalStep {
                step: commit.step,
                commit: commit.to_string(),
                ids,
                shards,
                mark: mark.cloned(),
            };
            if let (Some(mark), Some(m)) = (&global.mark, global.shard(0)) {
                self.learn(std::slice::from_ref(m), mark)?;
            }
            return Ok(Some(global));
        }
        Ok(None)
    }

    /// Read the manifests of the shards of `ranks` that `global` has not
    /// read yet (one request each), each checked against its hash; what
    /// they say of the packs is remembered for the next save.
    ///
    /// # Errors
    /// [`Error::Corrupt`] naming the step and shard when one is missing or
    /// damaged (a step is opened on its commit's manifest alone);
    /// [`BucketError::Request`](crate::BucketError::Request) when the bucket fails.
    pub(crate) fn load_shards(
        &self,
        global: &GlobalStep,
        ranks: impl Iterator<Item = u32>,
    ) -> Result<()> {
        for rank in ranks {
            let Ok(i) = usize::try_from(rank) else {
                continue;
            };
            let (Some(Some(id)), Some(slot)) = (global.ids.get(i), global.shards.get(i)) else {
                continue;
            };
            if slot.get().is_some() {
                continue;
            }
            let m = self
                .checked_shard(global.step, id, None)?
                .map_err(|why| Error::corrupt(Some(global.step), why.to_string()))?;
            if let Some(mark) = &global.mark {
                self.learn(std::slice::from_ref(&m), mark)?;
            }
            // Another thread may have read it meanwhile: the same bytes.
            let _ = slot.set(m);
        }
        Ok(())
    }

    /// Does the work of [`Remote::entries`](crate::Remote::entries).
    pub(crate) fn entries(
        &self,
        global: &GlobalStep,
        rank: u32,
    ) -> Result<BTreeMap<String, EntryInfo>> {
        self.load_shards(global, std::iter::once(rank))?;
        let Some(m) = global.shard(rank) else {
            return Ok(BTreeMap::new());
        };
        Ok(m.blobs
            .iter()
            .map(|(name, b)| {
                let tensor = b.tensor.clone().map(|t| (t.dtype, t.shape));
                (name.clone(), EntryInfo { len: b.len, tensor })
            })
            .collect())
    }

    /// Does the work of [`Remote::read_pieces`](crate::Remote::read_pieces).
    pub(crate) fn read_pieces(
        &self,
        global: &GlobalStep,
        pieces: &[Piece<'_>],
    ) -> Result<Vec<Vec<u8>>> {
        self.load_shards(global, pieces.iter().map(|p| p.0))?;
        let mut outs: Vec<Vec<u8>> = Vec::with_capacity(pieces.len());
        for piece in pieces {
            let len = usize::try_from(piece.3).map_err(|_| Error::InvalidCheckpoint {
                step: global.step,
                reason: format!("a piece of {} bytes of {:?}", piece.3, piece.1),
            })?;
            global.blob(piece)?;
            outs.push(vec![0u8; len]);
        }
        let mut views: Vec<&mut [u8]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
        self.read_pieces_into(global, pieces, &mut views)?;
        Ok(outs)
    }

    /// Does the work of [`Remote::read_pieces_into`](crate::Remote::read_pieces_into).
    pub(crate) fn read_pieces_into(
        &self,
        global: &GlobalStep,
        pieces: &[Piece<'_>],
        outs: &mut [&mut [u8]],
    ) -> Result<()> {
        self.read_pieces_proving(global, pieces, outs, &[])
            .map(drop)
    }

    /// Does the work of [`Remote::slices`](crate::Remote::slices).
    pub(crate) fn slices(&self, global: &GlobalStep, piece: &Piece<'_>) -> Result<Vec<ChunkSlice>> {
        self.load_shards(global, std::iter::once(piece.0))?;
        let (rank, name, offset, len) = *piece;
        let mut out = Vec::new();
        for (want, from, n, at) in parts(global, rank, name, global.blob(piece)?)? {
            let (x, y) = (offset.max(from), (offset + len).min(from + n));
            if x < y {
                out.push(ChunkSlice {
                    hash: want.hash,
                    len: want.len as u64,
                    a: at + x - from,
                    b: at + y - from,
                });
            }
        }
        Ok(out)
    }

    /// Does the work of [`Remote::read_pieces_proving`](crate::Remote::read_pieces_proving).
    pub(crate) fn read_pieces_proving(
        &self,
        global: &GlobalStep,
        pieces: &[Piece<'_>],
        outs: &mut [&mut [u8]],
        proved: &[Piece<'_>],
    ) -> Result<Vec<Vec<u8>>> {
        let step = global.step;
        self.load_shards(global, pieces.iter().map(|p| p.0))?;
        if outs.len() != pieces.len()
            || pieces
                .iter()
                .zip(outs.iter())
                .any(|(p, o)| o.len() as u64 != p.3)
        {
            return Err(Error::InvalidCheckpoint {
                step,
                reason: "the buffers do not match the pieces in number or length".into(),
            });
        }
        // What each piece needs, as spans: (index in `wanted`, the span's
        // start in the entry, its length, its start in what is fetched).
        let mut wanted: Vec<Want<'_>> = Vec::new();
        let mut index: HashMap<Hash, usize> = HashMap::new();
        let mut plans: Vec<Vec<Span>> = Vec::new();
        for piece in pieces {
            let (rank, name, offset, len) = *piece;
            let mut spans = Vec::new();
            for (want, from, n, at) in parts(global, rank, name, global.blob(piece)?)? {
                if from + n > offset && from < offset + len {
                    let i = *index.entry(want.hash).or_insert_with(|| {
                        wanted.push(want);
                        wanted.len() - 1
                    });
                    spans.push((i, from, n, at));
                }
            }
            plans.push(spans);
        }
        let jobs = regions(global, pieces, &plans, wanted.len(), outs)?;
        let mut proofs = Proofs::new(self, global, proved, &index)?;
        // A `file://` bucket's chunks are read straight into place, on
        // every core; any other bucket's, and any a proof is made from,
        // are placed as they arrive and let go. (A chunk the direct read
        // does not find goes the second way.)
        let (jobs, proving): (Vec<_>, Vec<_>) =
            jobs.into_iter().partition(|(i, _)| !proofs.needs(*i));
        let mut rest = if crate::remote::read::local::direct(self) {
            crate::remote::read::local::read_into(self, step, &wanted, jobs)?
        } else {
            jobs
        };
        rest.extend(proving);
        if !rest.is_empty() {
            let some: Vec<Want<'_>> = rest.iter().map(|(i, _)| wanted[*i]).collect();
            self.fetch_each(step, &some, &mut |k, chunk| {
                proofs.make(rest[k].0, &chunk)?;
                place(step, &chunk, &mut rest[k].1)
            })?;
        }
        Ok(proofs.done())
    }
}

/// The proofs
/// [`Remote::read_pieces_proving`](crate::Remote::read_pieces_proving) makes:
/// for each range, the proof of each of its slices, made when the chunk it lies
/// in arrives (a slice of a whole chunk has an empty proof, and needs no chunk
/// bytes).
struct Proofs {
    /// By range, then slice: the proof, once made.
    made: Vec<Vec<Vec<u8>>>,
    /// By index in the wanted list: (range, slice, the slice) to prove.
    on: HashMap<usize, Vec<(usize, usize, ChunkSlice)>>,
}

impl Proofs {
    fn new(
        remote: &Reader<'_>,
        global: &GlobalStep,
        proved: &[Piece<'_>],
        index: &HashMap<Hash, usize>,
    ) -> Result<Proofs> {
        let mut made = Vec::with_capacity(proved.len());
        let mut on: HashMap<usize, Vec<(usize, usize, ChunkSlice)>> = HashMap::new();
        for (j, range) in proved.iter().enumerate() {
            let slices = remote.slices(global, range)?;
            for (k, slice) in slices.iter().enumerate() {
                let i = *index
                    .get(&slice.hash)
                    .ok_or_else(|| Error::InvalidCheckpoint {
                        step: global.step,
                        reason: format!(
                            "bytes {}..+{} of {:?} are read by no piece",
                            range.2, range.3, range.1
                        ),
                    })?;
                if !slice.is_whole() {
                    on.entry(i).or_default().push((j, k, *slice));
                }
            }
            made.push(vec![Vec::new(); slices.len()]);
        }
        Ok(Proofs { made, on })
    }

    /// Whether a proof is made from wanted chunk `i`'s bytes.
    fn needs(&self, i: usize) -> bool {
        self.on.contains_key(&i)
    }

    /// Make the proofs of the slices of wanted chunk `i`, `chunk` (checked).
    fn make(&mut self, i: usize, chunk: &[u8]) -> Result<()> {
        for (j, k, slice) in self.on.remove(&i).unwrap_or_default() {
            self.made[j][k] = crate::slice_proof(chunk, slice.a, slice.b)?;
        }
        Ok(())
    }

    fn done(self) -> Vec<Vec<u8>> {
        self.made.into_iter().map(|p| p.concat()).collect()
    }
}

/// Where part of an entry is: (index of what holds it in the wanted list,
/// the part's start in the entry, its length, its start in what is
/// fetched).
type Span = (usize, u64, u64, u64);

/// Every part of entry `name` of rank `rank`'s shard, in order: what to
/// fetch for it, its start in the entry, its length, its start in what is
/// fetched. A small blob is in the packed chunk (fetched whole); a large
/// blob's tail (format 2) is fetched alone, checked against its own hash.
fn parts<'a>(
    global: &GlobalStep,
    rank: u32,
    name: &'a str,
    blob: &RemoteBlob,
) -> Result<Vec<(Want<'a>, u64, u64, u64)>> {
    let step = global.step;
    let shard = global
        .shard(rank)
        .ok_or_else(|| Error::corrupt(Some(step), format!("no shard of rank {rank}")))?;
    let mut parts = Vec::new();
    let mut start = 0u64;
    for want in blob_chunks(shard, name, blob)? {
        parts.push((want, start, want.len as u64, 0));
        start += want.len as u64;
    }
    let packed = || {
        packed_want(shard)?.ok_or_else(|| {
            Error::corrupt(Some(step), format!("{name:?} needs absent packed bytes"))
        })
    };
    if let RemotePlace::Packed { offset } = blob.place {
        parts.push((packed()?, 0, blob.len, offset));
    }
    if let (Some((at, n)), Some(tail)) = (blob.tail_bytes(), blob.tail()) {
        // At its offset in the packed chunk, wherever that lies.
        let packed = packed()?;
        let at = packed.at.unwrap_or(0) + at;
        let object = packed.object;
        let hash = tail.hash.0;
        let len = usize::try_from(n).unwrap_or(usize::MAX);
        if packed.stored != Stored::Raw {
            // Tails are 0.4's; no writer since compresses a packed chunk
            // that holds one.
            return Err(Error::corrupt(
                Some(step),
                format!("{name:?}: a blob tail in a compressed packed chunk"),
            ));
        }
        let want = Want {
            what: name,
            object,
            at: Some(at),
            len,
            hash,
            stored: Stored::Raw,
        };
        parts.push((want, start, n, 0));
    }
    Ok(parts)
}

/// Split the pieces' buffers `outs` into the disjoint regions each wanted
/// chunk fills (`plans[p]`: the spans piece `p` needs, in entry order);
/// checks that every piece is covered exactly.
fn regions<'o>(
    global: &GlobalStep,
    pieces: &[Piece<'_>],
    plans: &[Vec<Span>],
    wanted: usize,
    outs: &'o mut [&mut [u8]],
) -> Result<Vec<(usize, Regions<'o>)>> {
    let mut by_chunk: Vec<Regions<'o>> = (0..wanted).map(|_| Vec::new()).collect();
    for ((piece, need), out) in pieces.iter().zip(plans).zip(outs.iter_mut()) {
        let (_, name, offset, len) = *piece;
        let corrupt = |why: &str| Error::corrupt(Some(global.step), format!("{name:?}: {why}"));
        let index = |x: u64| usize::try_from(x).map_err(|_| corrupt("too long to load"));
        let mut rest: &'o mut [u8] = out;
        let mut filled = 0;
        for &(i, start, n, at) in need {
            let from = offset.max(start);
            let to = (offset + len).min(start + n);
            if from != offset + filled || to < from {
                return Err(corrupt("its chunks do not cover it"));
            }
            let (region, tail) = std::mem::take(&mut rest).split_at_mut(index(to - from)?);
            let within = index(at + (from - start))?..index(at + (to - start))?;
            by_chunk[i].push((within, region));
            rest = tail;
            filled += to - from;
        }
        if filled != len {
            return Err(corrupt("its chunks do not cover it"));
        }
    }
    Ok(by_chunk.into_iter().enumerate().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn global() -> GlobalStep {
        GlobalStep {
            step: 4,
            commit: String::new(),
            ids: vec![None],
            shards: vec![OnceLock::new()],
            mark: None,
        }
    }

    /// The ranges of fetched chunk `i` that `regions` gives, with the
    /// bytes of the piece's buffer each fills (as offsets in the buffer).
    fn placed(jobs: &[(usize, Regions<'_>)], base: usize) -> Vec<(usize, usize, usize, usize)> {
        let mut out = Vec::new();
        for (i, regions) in jobs {
            for (within, region) in regions {
                let at = region.as_ptr() as usize - base;
                out.push((*i, within.start, within.end, at));
            }
        }
        out
    }

    #[test]
    fn a_piece_is_placed_from_the_chunks_that_cover_it() -> Result<()> {
        let g = global();
        // Entry "w": chunk 0 holds [0, 256), chunk 1 [256, 512); entry "s"
        // lies at 1000 in the packed chunk (2).
        let pieces: [Piece<'_>; 2] = [(0, "w", 100, 300), (0, "s", 10, 20)];
        let plans = vec![
            vec![(0, 0, 256, 0), (1, 256, 256, 0)],
            vec![(2, 0, 50, 1000)],
        ];
        let mut a = vec![0u8; 300];
        let mut b = vec![0u8; 20];
        let (base_a, base_b) = (a.as_ptr() as usize, b.as_ptr() as usize);
        let mut outs: Vec<&mut [u8]> = vec![&mut a, &mut b];
        let jobs = regions(&g, &pieces, &plans, 3, &mut outs)?;
        let mut got = placed(&jobs[..2], base_a);
        got.extend(placed(&jobs[2..], base_b));
        // Chunk 0's bytes 100..256 fill the first 156 bytes, chunk 1's
        // first 144 the rest; bytes 1010..1030 of the packed chunk fill "s".
        assert_eq!(
            got,
            vec![(0, 100, 256, 0), (1, 0, 144, 156), (2, 1010, 1030, 0)]
        );
        Ok(())
    }

    #[test]
    fn a_piece_its_chunks_do_not_cover_exactly_is_refused() {
        let g = global();
        let pieces: [Piece<'_>; 1] = [(0, "w", 0, 300)];
        for spans in [
            vec![(0, 0, 100, 0), (1, 150, 150, 0)], // a gap
            vec![(0, 0, 200, 0), (1, 100, 200, 0)], // an overlap
            vec![(0, 0, 200, 0)],                   // short
        ] {
            let mut a = vec![0u8; 300];
            let mut outs: Vec<&mut [u8]> = vec![&mut a];
            let e = regions(&g, &pieces, &[spans], 2, &mut outs).expect_err("refused");
            assert!(e.to_string().contains("do not cover"), "{e}");
        }
    }
}
