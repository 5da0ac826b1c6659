"""The seam under ckptstore.dcp's writer and reader. A target is where a
save's shards go and a load's bytes come from: a bucket (any number of
ranks), a local store (one process), or a rank's store on the node-local
tier with its peers behind it (`tiers._save.TierShard`,
`tiers._load.TierSource`). The writer and the reader ask a target only
what `SaveTarget`, `LoadTarget` and `Opened` say; nothing in them depends
on its kind."""

import os
from typing import (
    Any, Callable, Dict, Hashable, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable
)

import numpy as np

from .._ckptstore import DCP_METADATA, HfExport, SaveRecord
from .._convert import step_number
from ._document import torch_dtype
from ._rank_local import RANK_METADATA
from .._remote import Remote
from .._store import Store
from .._store import open as open_store
from ._wire import Group

METADATA = DCP_METADATA
"""The entry of the coordinator's shard that holds DCP's metadata."""

UserTarget = Union[str, "os.PathLike[str]", Store]
"""What a user names as a target: a bucket URL, a store's path, an open
store."""

Piece = Tuple[int, str, int, int]
"""Bytes of a stored entry: (rank, entry, start, length)."""

Slice = Tuple[bytes, int, int, int]
"""Where bytes of an entry lie in a chunk of the target: (the chunk's
BLAKE3 hash, its length, the start and end of the bytes in it)."""

Deliver = Callable[[int, np.ndarray], None]
"""Takes piece `i`'s bytes, once they are read and checked."""

BATCH_BYTES = 64 << 20
"""Bytes of stored boxes read at once by a load (not straight into place)."""


def batches(pieces: Sequence[Piece], dest: Dict[int, np.ndarray]) -> List[List[int]]:
    """The pieces without memory of their own (`dest`), in batches of
    about BATCH_BYTES: a load holds the state and one batch, not a second
    copy."""
    out: List[List[int]] = []
    size = BATCH_BYTES
    for i, piece in enumerate(pieces):
        if i in dest:
            continue
        if size >= BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(i)
        size += piece[3]
    return out


def read_in_batches(
    pieces: Sequence[Piece],
    dest: Dict[int, np.ndarray],
    deliver: Deliver,
    fill: Callable[[List[int], List[np.ndarray]], List[int]],
) -> None:
    """Read `pieces` as a target's `Opened.read` does: those with memory of
    their own (`dest`) in one call, the rest in `batches`; `fill(batch,
    arrays)` fills the arrays of the pieces `batch` and returns those it
    filled, each then handed to `deliver`."""
    direct = [i for i in range(len(pieces)) if i in dest]
    runs = [(direct, lambda: [dest[i] for i in direct])] + [
        (batch, lambda batch=batch: [np.empty(pieces[i][3], dtype=np.uint8) for i in batch])
        for batch in batches(pieces, dest)
    ]
    for batch, arrays_of in runs:
        if not batch:
            continue
        arrays = dict(zip(batch, arrays_of()))  # a batch's buffers, made when it is read
        for i in fill(batch, [arrays[i] for i in batch]):
            deliver(i, arrays[i])


class Put(NamedTuple):
    """A shard put into a target: its name there ("" where shards have
    none), and the bytes it added and found already stored."""

    shard: str
    bytes_new: int
    bytes_reused: int


class Opened(Protocol):
    """One save of a step, opened for reading."""

    commit: Optional[str]
    """The save read (so that every rank reads the same); None where a
    step has one save at a time."""

    def metadata(self) -> bytes:
        """DCP's metadata, as `METADATA` holds it."""

    def rank_metadata(self, rank: int) -> Optional[Tuple[int, bytes]]:
        """Where the step is a rank-local save's: its world size, and the
        DCP metadata rank `rank` saved (`_rank_local.RANK_METADATA`; for a
        rank beyond its world, the metadata of rank `rank` modulo it).
        None for a save with collectives."""

    def length(self, rank: int, entry: str) -> int:
        """Bytes of `entry` of rank `rank`'s shard."""

    def read(
        self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], deliver: Deliver, failure: Optional[BaseException]
    ) -> None:
        """Hand each piece's bytes to `deliver(i, data)`, every chunk
        hash-checked first; piece `i` with memory `dest[i]` (writable, of
        its length, sharing memory with no other) is read into it. A
        `failure` (this rank could not plan its reads) is raised, after the
        target's collectives where it has some (every rank joins them)."""

    proves: bool
    """Whether bytes read from it carry proofs against its own chunk
    hashes, with which a rank handed them by another checks them
    (`slices`, `read_proving`)."""

    def slices(self, pieces: Sequence[Piece]) -> List[List[Slice]]:
        """Where each piece's bytes lie in its chunks, in order (where it
        `proves`)."""

    def read_proving(self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], proved: Sequence[Piece]) -> List[bytes]:
        """Read each piece into `dest` (every piece has one), and return
        for each of `proved` (ranges within the pieces) the proofs of its
        `slices`, back to back (where it `proves`)."""


@runtime_checkable
class MapsTravel(Protocol):
    """An opened target whose ranks do not all hold every shard's chunk
    map (the local tier): a rank that hands bytes of a shard sends the
    shard's map first to each rank it hands them to, which checks it
    against the save's content digest before it checks bytes by it."""

    def chunk_map(self, src: int) -> Union[bytes, str]:
        """Rank `src`'s shard's chunk map, from this rank's stores, as bytes
        to send; or why there is none here."""

    def learn_map(self, src: int, sent: Union[bytes, str]) -> Optional[str]:
        """Take rank `src`'s shard's chunk map as a peer sent it; why it is
        refused (None where it is taken)."""


class SaveTarget(Protocol):
    """Where ckptstore.dcp's writer puts a save's shards."""

    description: str
    """How messages name it."""

    many_ranks: bool
    """Whether a save of several ranks may go to it."""

    sendable: bool
    """Whether a writer or reader over it may be sent to another process
    (pickled as its arguments)."""

    pool_key: Hashable
    """The key of the staged copies saves to it reuse, in this process."""

    def committed(self, step: int) -> bool:
        """Whether `step` is complete in it."""

    def put_data(self, step: int, rank: int, world: int, values: Mapping[str, Any]) -> Put:
        """Store the data of rank `rank`'s shard ahead of it, where the
        shard itself follows later (the coordinator's, beside the others')."""

    def put(
        self, step: int, rank: int, world: int, values: Mapping[str, Any], record: Optional[SaveRecord], replace: bool
    ) -> Put:
        """Store rank `rank`'s shard of `step`, durably; `record`, how it
        was saved (a staged save's cost), goes with the step."""

    def layout_entries(self, sizes: List[Dict[str, int]]) -> Dict[str, bytes]:
        """Entries the coordinator's shard holds beside DCP's metadata,
        from every rank's entry sizes."""

    def finish(
        self,
        step: int,
        rank: int,
        world: int,
        values: Mapping[str, Any],
        record: Optional[SaveRecord],
        replace: bool,
        shards: List[str],
    ) -> Put:
        """The coordinator's end of a save: store its shard as `put` does,
        then complete `step` with exactly `shards` (by rank; this rank's
        entry is the shard just stored)."""


@runtime_checkable
class RankLocalTarget(Protocol):
    """A save target that takes DCP's rank-local saves of several ranks
    (a bucket)."""

    def finish_local(
        self, step: int, rank: int, world: int, values: Mapping[str, Any], record: Optional[SaveRecord], save: str
    ) -> Put:
        """A rank's end of a rank-local save `save` (an identity alike on
        its ranks): store its shard durably; `step` is complete once every
        rank's shard of `save` is stored, and never with another save's."""


class LoadTarget(Protocol):
    """Where ckptstore.dcp's reader reads a save."""

    description: str
    """How messages name it."""

    sendable: bool
    """Whether a reader over it may be sent to another process (pickled as
    its arguments)."""

    fans_out: bool
    """Whether a load of it at several ranks reads each byte once, by one
    rank that hands it on (`stripes._run`): where its reads are ranged."""

    readers: Optional[Dict[int, List[int]]]
    """The ranks that may read each source rank's shard in such a load
    (the local tier's holders); None: any rank."""

    nodes: Optional[List[int]]
    """Each rank's node, where the target knows it (the local tier's
    layout): a stripe no rank needing it may read is read on the node of
    the ranks that need it. None: not known."""

    group: Optional[Group]
    """The group such a load exchanges over (the local tier's own); None:
    the reader makes one of its own."""

    def latest(self) -> Optional[int]:
        """Its newest complete step."""

    def open(self, step: int, commit: Optional[str]) -> Opened:
        """`step` (exactly `commit`, if given) opened for reading; raises
        FileNotFoundError if it is not complete there."""


Target = Union["Bucket", "LocalStore"]
"""The targets a user names."""


def target_of(target: UserTarget) -> Target:
    """The target a user's argument names."""
    if is_bucket_url(target):
        return Bucket(str(target))
    return LocalStore(target)


def save_target(target: Union[UserTarget, SaveTarget], compress: bool = False) -> SaveTarget:
    """The target a writer's argument names (a user's, or the tier's);
    `compress`: a bucket's chunks stored compressed (no other target
    compresses)."""
    if compress:
        if not is_bucket_url(target):
            raise ValueError(
                f"compress=True: only a bucket URL stores chunks compressed, not {describe_any(target)}"
            )
        return Bucket(str(target), compress=True)
    return target_of(target) if isinstance(target, (str, os.PathLike, Store)) else target


def load_target(target: Union[UserTarget, LoadTarget]) -> LoadTarget:
    """The target a reader's argument names (a user's, or the tier's)."""
    return target_of(target) if isinstance(target, (str, os.PathLike, Store)) else target


def is_bucket_url(target: Any) -> bool:
    """Whether `target` is a bucket URL (`s3://`, `file://`)."""
    return isinstance(target, str) and target.split("://", 1)[0] in ("s3", "file")


# One Remote per bucket URL in a process (and per compression setting): it
# remembers where the chunks it wrote lie in the bucket's packs, so a save
# of unchanged tensors uploads nothing and asks nothing per chunk. Keyed by
# process too: a forked child opens its own.
_REMOTES: Dict[Tuple[int, str, bool], Remote] = {}


def remote_of(url: str, compress: bool = False) -> Remote:
    """This process's `Remote` of bucket `url` (storing new chunks
    compressed or not)."""
    key = (os.getpid(), str(url), bool(compress))
    found = _REMOTES.get(key)
    if found is None:
        found = _REMOTES[key] = Remote(str(url), compress=bool(compress))
    return found


def describe_any(target: Any) -> str:
    """How messages name a writer's target, whatever it is."""
    if isinstance(target, (str, os.PathLike, Store)):
        return describe(target)
    return str(getattr(target, "description", type(target).__name__))


def describe(target: UserTarget) -> str:
    """How messages name a user's target."""
    return str(target) if not isinstance(target, Store) else "the store"


def check_sendable(sender: object, target: Union[SaveTarget, LoadTarget]) -> None:
    """Refuse to send `sender` (a writer or reader, pickled as its
    arguments) to another process where its target cannot go there."""
    if not target.sendable:
        raise TypeError(
            f"a {type(sender).__name__} over a local store cannot be sent to another process "
            "(dcp.async_save in process mode): use a bucket URL, or thread mode"
        )


def is_step_id(checkpoint_id: Any) -> bool:
    """Whether `checkpoint_id` is a step number (DCP's checkpoint id for
    ckptstore.dcp)."""
    try:
        step_number(checkpoint_id)
        return True
    except (TypeError, ValueError):
        return False


class Bucket:
    """A bucket: shards uploaded by every rank, the coordinator's commit
    naming exactly them."""

    many_ranks = True
    sendable = True
    fans_out = True
    readers: Optional[Dict[int, List[int]]] = None
    nodes: Optional[List[int]] = None
    group: Optional[Group] = None

    def __init__(self, url: str, compress: bool = False) -> None:
        self.url = self.description = url
        self.compress = bool(compress)
        self.pool_key: Hashable = url

    @property
    def _remote(self) -> Remote:
        # Looked up at each use, not kept: a process forked after this
        # target was made uses a Remote of its own.
        return remote_of(self.url, self.compress)

    def committed(self, step: int) -> bool:
        return self._remote.open_global(step) is not None

    def latest(self) -> Optional[int]:
        return self._remote.latest_step()

    def put_data(self, step: int, rank: int, world: int, values: Mapping[str, Any]) -> Put:
        info = self._remote.upload_shard(step, rank, world, values, data_only=True)
        return Put(info.shard, info.bytes_uploaded, info.bytes_skipped)

    def put(
        self, step: int, rank: int, world: int, values: Mapping[str, Any], record: Optional[SaveRecord], replace: bool
    ) -> Put:
        info = self._remote.upload_shard(step, rank, world, values, record=record)
        return Put(info.shard, info.bytes_uploaded, info.bytes_skipped)

    def layout_entries(self, sizes: List[Dict[str, int]]) -> Dict[str, bytes]:
        return {}

    def finish(
        self,
        step: int,
        rank: int,
        world: int,
        values: Mapping[str, Any],
        record: Optional[SaveRecord],
        replace: bool,
        shards: List[str],
    ) -> Put:
        missing = [r for r, s in enumerate(shards) if not s and r != rank]
        if missing:
            raise ValueError(f"step {step}: no shard reported by ranks {missing}")
        # One lock cycle: the coordinator's shard, then the commit.
        info = self._remote.upload_shard(step, rank, world, values, record=record, commit=shards)
        return Put(info.shard, info.bytes_uploaded, info.bytes_skipped)

    def finish_local(
        self, step: int, rank: int, world: int, values: Mapping[str, Any], record: Optional[SaveRecord], save: str
    ) -> Put:
        info = self._remote.commit_shard(step, rank, world, values, record, save)
        return Put(info.shard, info.bytes_uploaded, info.bytes_skipped)

    def open(self, step: int, commit: Optional[str]) -> Opened:
        return OpenedBucket(self._remote, step, commit, self.url)

    def consolidate(self, step: int, path: "os.PathLike[str] | str", prefix: Optional[str]) -> List[str]:
        return self._remote.consolidate(step, path, prefix)

    def export_hf(
        self, step: int, directory: "os.PathLike[str] | str", max_shard_size: "int | str", prefix: Optional[str], dtype: Any
    ) -> HfExport:
        return self._remote.export_hf(step, directory, max_shard_size, prefix, dtype)


class OpenedBucket:
    """A global step of a bucket: the shards a load takes boxes from, each
    read when first used, in ranged reads of neighbouring bytes."""

    def __init__(self, remote: Remote, step: int, commit: Optional[str], url: str) -> None:
        self._remote = remote
        opened = remote.open_global(step, commit)
        if opened is None:
            if commit is None:
                raise FileNotFoundError(f"{url} has no complete step {step}")
            raise FileNotFoundError(
                f"{url} no longer holds the save of step {step} this load chose (commit {commit}): "
                "the step was saved again or removed meanwhile; load again"
            )
        self._opened = opened
        self.commit: Optional[str] = opened.commit
        self._by_rank: Dict[int, Dict[str, Tuple[Optional[str], Optional[List[int]], int]]] = {}
        self._step, self._url = step, url
        self._document: Optional[bytes] = None  # DCP's metadata, once read

    def _entries(self, rank: int) -> Dict[str, Tuple[Optional[str], Optional[List[int]], int]]:
        """Rank `rank`'s entries, its shard read once."""
        found = self._by_rank.get(rank)
        if found is None:
            found = self._by_rank[rank] = self._remote.entries(self._opened, rank)
        return found

    def _global_document(self) -> Optional[bytes]:
        """DCP's metadata of a save with collectives (rank 0's shard, read
        once: what every load of such a step reads first); None for a
        rank-local save (told by rank 0's shard) or no DCP save."""
        if self._document is None:
            self._document = self._remote.dcp_metadata(self._opened)
        return self._document

    def metadata(self) -> bytes:
        metadata = self._global_document()
        if metadata is None:
            raise ValueError(f"step {self._step} of {self._url} was not saved by ckptstore.dcp")
        return metadata

    def rank_metadata(self, rank: int) -> Optional[Tuple[int, bytes]]:
        # A step saved with collectives costs its load nothing more here.
        if self._global_document() is not None:
            return None
        world = self._opened.world_size
        rank %= world
        found = self._entries(rank).get(RANK_METADATA)
        if found is None:
            return None
        read = self._remote.read_pieces(self._opened, [(rank, RANK_METADATA, 0, found[2])])
        return world, read[0].tobytes()

    def length(self, rank: int, entry: str) -> int:
        return self._entries(rank)[entry][2]

    def read(
        self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], deliver: Deliver, failure: Optional[BaseException]
    ) -> None:
        if failure is not None:
            raise failure
        # Pieces with memory of their own in one call (no copy is held, so
        # the bucket gets as many ranges in flight as it takes).

        def fill(batch: List[int], arrays: List[np.ndarray]) -> List[int]:
            self._remote.read_pieces_into(self._opened, [pieces[i] for i in batch], arrays)
            return batch

        read_in_batches(pieces, dest, deliver, fill)

    proves = True

    def slices(self, pieces: Sequence[Piece]) -> List[List[Slice]]:
        return self._remote.slices(self._opened, pieces)

    def read_proving(self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], proved: Sequence[Piece]) -> List[bytes]:
        return self._remote.read_pieces_proving(self._opened, pieces, [dest[i] for i in range(len(pieces))], proved)


class LocalStore:
    """A local store (a path, opened and closed around each use, or an open
    `Store`): one process's step, committed in one transaction."""

    many_ranks = False
    sendable = False
    fans_out = True
    readers: Optional[Dict[int, List[int]]] = None
    nodes: Optional[List[int]] = None
    group: Optional[Group] = None

    def __init__(self, target: Union[str, "os.PathLike[str]", Store]) -> None:
        self._target = target
        self.description = describe(target)
        self.pool_key: Hashable = id(target) if isinstance(target, Store) else os.fspath(target)

    def _use(self, read_only: bool = False) -> "_Using":
        return _Using(self._target, read_only)

    def committed(self, step: int) -> bool:
        with self._use() as store:
            return step in store.steps()

    def latest(self) -> Optional[int]:
        with self._use(read_only=True) as store:
            return store.latest_step()

    def put_data(self, step: int, rank: int, world: int, values: Mapping[str, Any]) -> Put:
        return Put("", 0, 0)  # the step is committed whole, by `put`

    def put(
        self, step: int, rank: int, world: int, values: Mapping[str, Any], record: Optional[SaveRecord], replace: bool
    ) -> Put:
        with self._use() as store:
            info = store.save(step, values, replace=replace, record=record)
        return Put("", info.bytes_written, info.bytes_reused)

    def layout_entries(self, sizes: List[Dict[str, int]]) -> Dict[str, bytes]:
        return {}

    def finish(
        self,
        step: int,
        rank: int,
        world: int,
        values: Mapping[str, Any],
        record: Optional[SaveRecord],
        replace: bool,
        shards: List[str],
    ) -> Put:
        # One process: its shard, committed, is the step.
        return self.put(step, rank, world, values, record, replace)

    def open(self, step: int, commit: Optional[str]) -> Opened:
        return OpenedLocal(self, step, commit)

    def consolidate(self, step: int, path: "os.PathLike[str] | str", prefix: Optional[str]) -> List[str]:
        with self._use(read_only=True) as store:
            if step not in store:
                raise FileNotFoundError(f"{self.description} has no step {step}")
            return store.consolidate(step, path, prefix)

    def export_hf(
        self, step: int, directory: "os.PathLike[str] | str", max_shard_size: "int | str", prefix: Optional[str], dtype: Any
    ) -> HfExport:
        with self._use(read_only=True) as store:
            return store.export_hf(step, directory, max_shard_size, prefix, dtype)


class OpenedLocal:
    """A local store's step, read in ranges: only the chunks holding a
    piece's bytes, each hash-checked, and only from the save opened (its
    content digest is the commit every rank reads). Every rank opens the
    store, so a rank handed bytes checks them against the chunk hashes of
    the manifest it read itself."""

    def __init__(self, target: LocalStore, step: int, commit: Optional[str]) -> None:
        self._target, self._step = target, step
        with target._use(read_only=True) as store:
            digest, info = store.content_digest(step), store.info(step)
            if digest is None or info is None:
                raise FileNotFoundError(f"{target.description} has no step {step}")
            if commit is not None and digest != commit:
                raise FileNotFoundError(f"step {step} of {target.description} was saved again while this load opened it")
            if METADATA not in info.blobs:
                raise ValueError(f"step {step} of {target.description} was not saved by ckptstore.dcp")
            self.commit: Optional[str] = digest
            self._lengths = dict(info.blobs)
            for name, (dtype, shape) in info.tensors.items():
                self._lengths[name] = torch_dtype(dtype, name).itemsize * int(np.prod(shape, dtype=np.int64))
            self._metadata = np.empty(self._lengths[METADATA], dtype=np.uint8)
            self._fill(store, [(METADATA, 0, self._metadata)])

    def _fill(self, store: Store, reads: List[Tuple[str, int, np.ndarray]]) -> None:
        if not store.read_ranges(self._step, reads, digest=self.commit):
            raise self._gone()

    def metadata(self) -> bytes:
        return self._metadata.tobytes()

    def rank_metadata(self, rank: int) -> Optional[Tuple[int, bytes]]:
        return None  # one process's save

    def length(self, rank: int, entry: str) -> int:
        if rank != 0 or entry not in self._lengths:
            raise ValueError(f"step {self._step} of {self._target.description}: rank {rank} stored no entry {entry!r}")
        return self._lengths[entry]

    def read(
        self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], deliver: Deliver, failure: Optional[BaseException]
    ) -> None:
        if failure is not None:
            raise failure
        with self._target._use(read_only=True) as store:

            def fill(batch: List[int], arrays: List[np.ndarray]) -> List[int]:
                self._fill(store, [(pieces[i][1], pieces[i][2], a) for i, a in zip(batch, arrays)])
                return batch

            read_in_batches(pieces, dest, deliver, fill)

    proves = True

    def _ranges(self, pieces: Sequence[Piece]) -> List[Tuple[str, int, int]]:
        for rank, entry, _, _ in pieces:
            self.length(rank, entry)  # a rank or entry the step does not have: ValueError
        return [(entry, start, n) for _, entry, start, n in pieces]

    def _gone(self) -> FileNotFoundError:
        return FileNotFoundError(
            f"step {self._step} of {self._target.description} was removed or saved again while this load read it"
        )

    def slices(self, pieces: Sequence[Piece]) -> List[List[Slice]]:
        with self._target._use(read_only=True) as store:
            found = store.slices(self._step, self._ranges(pieces), digest=self.commit)
        if found is None:
            raise self._gone()
        return found

    def read_proving(self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], proved: Sequence[Piece]) -> List[bytes]:
        reads = [(entry, start, dest[i]) for i, (entry, start, _) in enumerate(self._ranges(pieces))]
        with self._target._use(read_only=True) as store:
            proofs = store.read_ranges_proving(self._step, reads, self._ranges(proved), digest=self.commit)
        if proofs is None:
            raise self._gone()
        return proofs


class _Using:
    """A local target as a context manager: an open Store is used as it is;
    a path is opened and closed around the use."""

    def __init__(self, target: Union[str, "os.PathLike[str]", Store], read_only: bool) -> None:
        self._target, self._read_only = target, read_only
        self._opened: Optional[Store] = None

    def __enter__(self) -> Store:
        if isinstance(self._target, Store):
            return self._target
        self._opened = open_store(self._target, read_only=self._read_only)
        return self._opened

    def __exit__(self, *exc: object) -> None:
        if self._opened is not None:
            self._opened.close()
