"""The bucket as Python sees it: `ckptstore.Remote` (steps pushed from
stores, global steps of multi-rank jobs) and `ckptstore.Shard` (one
rank's side of them)."""

import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import _hf
from ._ckptstore import (
    MAX_WORLD_SIZE,
    ChunkSlice,
    CommitInfo,
    EntryInfo,
    HfExport,
    Piece,
    PushReport,
    RawGlobalStep,
    RawRemote,
    SaveRecord,
    ShardId,
    ShardInfo,
    ShardStatus,
    ShardUpload,
    ShardValues,
    StepInfo,
    StoreStep,
    VerifyReport,
)
from ._convert import Checkpoint, Value, checkpoint_of, metrics_of, optional_step, split_state, step_number
from ._store import Handle, Store, raw_store


def pieces_of(pieces: Sequence[Tuple[int, str, int, int]]) -> List[Piece]:
    """Each (rank, entry, offset, length) as the core's `Piece`."""
    return [Piece(int(r), e, int(at), int(n)) for r, e, at, n in pieces]


def values_of(
    state: Mapping[str, Value], metrics: Optional[Mapping[str, float]] = None, record: Optional[SaveRecord] = None
) -> ShardValues:
    """`state` (arrays and bytes-like blobs), `metrics` and `record` as a
    shard write's source."""
    tensors, blobs = split_state(state)
    return ShardValues(tensors, blobs, metrics_of(metrics), record)


class Remote:
    """A bucket: `s3://BUCKET/PREFIX` (AWS_* variables for credentials,
    endpoint, region) or `file:///DIR`. Lists, loads and pulls the steps
    stores pushed there, every chunk hash-checked; holds global steps of
    multi-rank jobs (`shard`).

    `compress`: whether chunks this remote uploads are stored compressed
    where that saves bytes (byte planes by the tensor's element width,
    zstd; bucket format 4, which builds before 0.5 cannot read); by
    default (None) they are for `s3://` and not for `file://`. Reads
    decompress whatever they find either way."""

    def __init__(self, url: str, grace_period: Optional[float] = None, *, compress: Optional[bool] = None) -> None:
        self._raw = RawRemote(str(url), grace_period, None if compress is None else bool(compress))

    @property
    def compression(self) -> bool:
        """Whether chunks this remote uploads are stored compressed where
        that saves bytes (`compress`)."""
        return self._raw.compression()

    def compressing(self, on: bool) -> "Remote":
        """This bucket, storing new chunks compressed or not (`on`), and
        sharing what this remote knows of where chunks lie: what either
        uploads or reads, the other deduplicates against. One that does
        not compress relies only on chunks stored raw (its steps stay
        readable by 0.4) and uploads raw a chunk it finds only
        compressed."""
        twin = Remote.__new__(Remote)
        twin._raw = self._raw.compressing(bool(on))
        return twin

    @property
    def url(self) -> str:
        return self._raw.url()

    def save_dir(self, step: int, path: "os.PathLike[str] | str") -> ShardInfo:
        """Commit directory `path` (any framework's checkpoint folder) as
        step `step` of the bucket: each regular file an entry, unchanged
        chunks not uploaded again; complete when this returns (a step
        already there is saved again: readers take the newer save)."""
        return self._raw.save_dir(step_number(step), os.fspath(path))

    def load_dir(self, step: int, path: "os.PathLike[str] | str") -> List[str]:
        """Write step `step` (saved by `save_dir`) into directory `path`,
        which must not exist or be empty, whole or not at all, every byte
        checked: the paths written."""
        return self._raw.load_dir(step_number(step), os.fspath(path))

    def steps(self) -> List[int]:
        """The complete steps, ascending."""
        return self._raw.steps()

    def latest_step(self) -> Optional[int]:
        return self._raw.latest_step()

    def info(self, step: int) -> Optional[StepInfo]:
        """A complete step's metadata (metrics, entries, save record), or
        None; a global step of several ranks raises ckptstore.Error (each
        rank's shard has its own: `ckpt ls URL` lists rank 0's)."""
        return self._raw.info(step_number(step))

    def load(self, step: Optional[int] = None) -> Optional[Checkpoint]:
        """A step pushed from one store (the latest if None), or None."""
        return checkpoint_of(self._raw.load(optional_step(step)))

    def push(self, store: Store) -> PushReport:
        """Upload every step of `store` the bucket lacks (`Store.push`)."""
        return self._raw.push(raw_store(store))

    def pull(self, step: int, store: Store) -> CommitInfo:
        """Copy `step` into a local store."""
        return self._raw.pull(step_number(step), raw_store(store))

    def verify(self) -> VerifyReport:
        """Hash-check every step in the bucket."""
        return self._raw.verify()

    def gc(
        self,
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
        allow_deleting_all: bool = False,
    ) -> List[int]:
        """Apply a retention policy in the bucket; the steps removed. A
        policy that keeps nothing (`keep_last=0`) needs
        `allow_deleting_all=True`."""
        return self._raw.gc(keep_last, keep_every, allow_deleting_all)

    def shards(self, step: int) -> ShardStatus:
        """Which ranks of global step `step` have landed."""
        return self._raw.shards(step_number(step))

    def owner(self) -> Optional[str]:
        """The id of the store whose run this prefix holds, or None."""
        return self._raw.owner()

    def adopt(self, store: "Store") -> None:
        """Make this prefix hold `store`'s run from now on (a store restored
        from a backup, or a run continued by a new store)."""
        self._raw.adopt(raw_store(store))

    # Global steps a coordinator completes (what ckptstore.dcp stands on).

    def upload_shard(
        self,
        step: int,
        rank: int,
        world_size: int,
        state: Mapping[str, Value],
        data_only: bool = False,
        metrics: Optional[Mapping[str, float]] = None,
        record: Optional[SaveRecord] = None,
        commit: Optional[List[str]] = None,
    ) -> ShardInfo:
        """Upload rank `rank`'s shard of global step `step` without completing
        the step; `info.shard` names it for `commit_global`. Its new chunks
        go into pack objects; chunks this Remote uploaded or loaded before
        are not uploaded again (nothing is asked of the bucket per chunk).
        With `data_only`, only its chunks (no shard yet: a later
        upload_shard of the same data through this Remote finds them).
        With `commit` (every rank's shard, by rank; this rank's entry is
        not read), the step is then completed with them as `commit_global`
        does, under the same lock: a coordinator's save in one lock cycle.
        `metrics` and `record` are the shard's (rank 0's are the step's,
        `ckpt ls`)."""
        if data_only and commit is not None:
            raise ValueError("upload_shard: data_only uploads no shard to commit")
        upload = (
            ShardUpload.ChunksOnly() if data_only
            else ShardUpload.Manifest() if commit is None
            else ShardUpload.Commit(shards=[str(s) for s in commit])
        )
        return self.write_shard(ShardId(step_number(step), int(rank), int(world_size)), upload, values_of(state, metrics, record))

    def upload_shard_from(
        self,
        store: "Store",
        step: int,
        rank: int,
        world_size: int,
        drop: Sequence[str] = (),
        blobs: Optional[Mapping[str, bytes]] = None,
    ) -> ShardInfo:
        """`upload_shard` of step `step` of `store` as it is stored (less
        the blobs named in `drop`, with `blobs` added): read, hashed and
        uploaded in Rust, its bytes never brought into Python."""
        extra = {str(k): bytes(v) for k, v in (blobs or {}).items()}
        source = StoreStep(raw_store(store), [str(d) for d in drop], extra)
        return self.write_shard(ShardId(step_number(step), int(rank), int(world_size)), ShardUpload.Manifest(), source)

    def commit_shard(
        self,
        step: int,
        rank: int,
        world_size: int,
        state: Mapping[str, Value],
        record: Optional[SaveRecord] = None,
        save: Optional[str] = None,
    ) -> ShardInfo:
        """Upload rank `rank`'s shard of global step `step` and complete the
        step if every rank's shard is there (whichever rank finds them
        writes the commit; `info.complete` says whether this call saw it
        complete). With `save` (an identity every rank of one save gives
        alike), the step completes only with shards of that save: ranks
        that never coordinate (DCP's rank-local mode) and saves of the
        step that died do not mix."""
        upload = ShardUpload.Complete() if save is None else ShardUpload.RankLocal(save=str(save))
        return self.write_shard(ShardId(step_number(step), int(rank), int(world_size)), upload, values_of(state, None, record))

    def write_shard(
        self,
        shard: ShardId,
        upload: ShardUpload,
        source: "ShardValues | StoreStep",
        announce: Optional[Callable[[str], Optional[List[str]]]] = None,
    ) -> ShardInfo:
        """Write `shard` as far as `upload` says (`ShardUpload.ChunksOnly`,
        `Manifest`, `Complete`, `RankLocal(save)`, `RankLocalShard(save)`,
        `Commit(shards)`, `CommitReported(shards)`), its bytes from
        `source`: `ShardValues` in memory (see `values_of`) or a store's
        step (`StoreStep`). With `RankLocalShard`, `announce` (given the
        shard's name once it is uploaded, the bucket's lock still held)
        tells the save's other ranks; where it answers every rank's name,
        by rank, the step's commit naming them is written in the same lock
        cycle (`info.complete`). `upload_shard`, `commit_shard` and
        `upload_shard_from` are this, spelled for common cases."""
        return self._raw.write_shard(shard, upload, source, announce)

    def commit_global(self, step: int, shards: List[str], *, reported: bool = False) -> None:
        """Complete global step `step` with exactly `shards` (each rank's
        `info.shard`, by rank), after checking each is there and hashes
        right (a request per rank, many in flight). `reported`: each name
        as its rank reported it once its upload returned, trusted and not
        read (a few requests whatever the ranks; a wrong name makes a
        commit no reader takes)."""
        self._raw.commit_global(step_number(step), [str(s) for s in shards], reported)

    def complete_landed(self) -> List[int]:
        """Complete each step whose newest save has every rank's shard here
        but no commit (a rank-local save whose completing rank died): the
        steps completed. Lists every shard of the bucket: a relaunch's
        recovery, made once, by one rank."""
        return self._raw.complete_landed()

    def open_global(self, step: Optional[int] = None, commit: Optional[str] = None) -> Optional[RawGlobalStep]:
        """Step `step` opened for reading parts of its entries (its
        commit's manifest checked; each shard's when first read): its
        newest commit whose manifest checks out, or exactly
        `commit` (an opened step's `.commit`, so that readers read one
        save); with `step` None, the newest complete step, found and
        opened in one listing of the commits. None if there is none."""
        return self._raw.open_global(optional_step(step), commit)

    def entries(self, opened: RawGlobalStep, rank: int) -> Dict[str, EntryInfo]:
        """Rank `rank`'s entries of `opened` by name (`dtype` and `shape`,
        None for a blob; `len` in bytes). Its shard's manifest is read (and
        checked) the first time: a step opens on one object, and a reader
        reads the shards it uses."""
        return self._raw.entries(opened, int(rank))

    def dcp_metadata(self, opened: RawGlobalStep) -> Optional[bytes]:
        """The DCP metadata `ckptstore.dcp` saved in `opened` (read from the
        coordinator's shard), or None if it did not save the step."""
        return self._raw.dcp_metadata(opened)

    def read_pieces(self, opened: RawGlobalStep, pieces: List[Tuple[int, str, int, int]]) -> List[np.ndarray]:
        """The bytes of each (rank, entry, offset, length) of `opened`, as
        uint8 arrays; only the chunks they overlap are fetched, each
        hash-checked."""
        return [np.asarray(b) for b in self._raw.read_pieces(opened, pieces_of(pieces))]

    def read_pieces_into(
        self, opened: RawGlobalStep, pieces: List[Tuple[int, str, int, int]], arrays: List[np.ndarray]
    ) -> None:
        """Like `read_pieces`, into `arrays` (writable, C-contiguous, one per
        piece and of its length in bytes, none sharing memory): each chunk's
        bytes are copied straight into place once checked. On an error an
        array may hold part of its piece, never bytes that failed a check."""
        self._raw.read_pieces_into(opened, pieces_of(pieces), list(arrays))

    def slices(self, opened: RawGlobalStep, pieces: Sequence[Tuple[int, str, int, int]]) -> List[List[ChunkSlice]]:
        """Where the bytes of each piece of `opened` lie in the bucket's
        chunks: its slices (`ChunkSlice`: the chunk's hash and length, the
        start and end in it), in order."""
        return self._raw.slices(opened, pieces_of(pieces))

    def read_pieces_proving(
        self,
        opened: RawGlobalStep,
        pieces: Sequence[Tuple[int, str, int, int]],
        arrays: List[np.ndarray],
        proved: Sequence[Tuple[int, str, int, int]],
    ) -> List[bytes]:
        """`read_pieces_into`, and for each of `proved` (ranges within the
        pieces) the proofs of its `slices`, back to back, made from each
        chunk once checked: a rank handed the range checks it with them
        against the bucket's hashes (`SliceCheck`)."""
        return self._raw.read_pieces_proving(opened, pieces_of(pieces), list(arrays), pieces_of(proved))

    def consolidate(self, step: int, path: "os.PathLike[str] | str", prefix: Optional[str] = None) -> List[str]:
        """Write DCP step `step` as one safetensors file of whole tensors
        (see `ckptstore.dcp.consolidate`); the names written."""
        return self._raw.consolidate(step_number(step), os.fspath(path), prefix)

    def export_hf(
        self,
        step: int,
        directory: "os.PathLike[str] | str",
        max_shard_size: "int | str" = "5GB",
        prefix: Optional[str] = None,
        dtype: Any = None,
    ) -> HfExport:
        """Write DCP step `step` into `directory` as a Hugging Face
        checkpoint (see `ckptstore.dcp.export_hf`)."""
        return _hf.export(self._raw, step_number(step), directory, max_shard_size, prefix, dtype)

    def shard(self, rank: int, world_size: int) -> "Shard":
        """Rank `rank`'s side of global steps of `world_size` ranks
        (1 to MAX_WORLD_SIZE)."""
        rank, world_size = int(rank), int(world_size)
        if not 0 < world_size <= MAX_WORLD_SIZE or not 0 <= rank < world_size:
            raise ValueError(
                f"rank {rank} of {world_size} ranks: ranks are 0..world_size, "
                f"and a world size is 1 to {MAX_WORLD_SIZE}"
            )
        return Shard(self, rank, world_size)


class Shard:
    """One rank's side of a multi-rank job's global steps in a bucket. Saves
    and loads like a Store (also with `ckptstore.torch`); a step becomes
    visible (`Remote.steps`, `latest_step`) once every rank saved it."""

    def __init__(self, remote: Remote, rank: int, world_size: int) -> None:
        self.remote, self.rank, self.world_size = remote, rank, world_size

    def save(
        self, step: int, state: Mapping[str, Value], metrics: Optional[Mapping[str, float]] = None
    ) -> ShardInfo:
        """Upload this rank's shard of `step`; the arrays are copied."""
        shard = ShardId(step_number(step), self.rank, self.world_size)
        return self.remote.write_shard(shard, ShardUpload.Complete(), values_of(state, metrics))

    def save_async(
        self, step: int, state: Mapping[str, Value], metrics: Optional[Mapping[str, float]] = None
    ) -> Handle:
        """Not offered: a shard is saved blocking (ValueError)."""
        raise ValueError("a shard is saved blocking: pass blocking=True")

    def load(self, step: Optional[int] = None) -> Optional[Checkpoint]:
        """This rank's shard of `step` (the latest complete step if None)."""
        return checkpoint_of(self.remote._raw.load_shard(self.rank, optional_step(step)))

    def latest_step(self) -> Optional[int]:
        return self.remote.latest_step()
