"""The seam under ckptstore.dcp's writer and reader. A target is where a
save's shards go and a load's bytes come from: a bucket (any number of
ranks), a local store (one process), or a rank's store on the node-local
tier with its peers behind it (`tiers._save.TierShard`,
`tiers._load.TierSource`). The writer and the reader ask a target only
what `SaveTarget`, `LoadTarget` and `Opened` say; nothing in them depends
on its kind. Here: those protocols and the seam's types; the bucket
(`_bucket`), the local store (`_local`) and which of them a user's
argument names (`_choose`) each have a module of their own."""

import os
from dataclasses import dataclass
from typing import (
    Any, Callable, Dict, Hashable, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable
)

import numpy as np

from .._ckptstore import DCP_METADATA, ChunkSlice, SaveRecord, ShardUpload
from .._convert import step_number
from .._store import Store
from ._rank_local import SavedMetadata
from ._wire import Group

METADATA = DCP_METADATA
"""The entry of the coordinator's shard that holds DCP's metadata."""

UserTarget = Union[str, "os.PathLike[str]", Store]
"""What a user names as a target: a bucket URL, a store's path, an open
store."""

Piece = Tuple[int, str, int, int]
"""Bytes of a stored entry: (rank, entry, start, length)."""

Slice = ChunkSlice
"""Where bytes of an entry lie in a chunk of the target (the chunk's
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

    step: int
    """The step opened."""

    commit: Optional[str]
    """The save read (so that every rank reads the same); None where a
    step has one save at a time."""

    def saved_metadata(self, rank: int) -> SavedMetadata:
        """The save's DCP metadata as rank `rank` reads it: the
        coordinator's (`METADATA`), or of a rank-local save the document
        of rank `rank` modulo its world (`_rank_local.RANK_METADATA`).
        ValueError if the step was not saved by ckptstore.dcp."""

    def rank_document(self, rank: int) -> bytes:
        """The metadata document saved rank `rank` of a rank-local save
        wrote (ValueError if it has none)."""

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

    takes_rank_local: bool
    """Whether DCP's rank-local saves of several ranks may go to it
    (`ShardUpload.RankLocal`)."""

    def put(self, write: "ShardWrite") -> Put:
        """Store rank `write.rank`'s shard of `write.step` as far as
        `write.then` says (durably, but for `ShardUpload.ChunksOnly`)."""

    def layout_entries(self, sizes: List[Dict[str, int]]) -> Dict[str, bytes]:
        """Entries the coordinator's shard holds beside DCP's metadata,
        from every rank's entry sizes."""


Then = ShardUpload
"""How far a shard's write goes: the Rust type (`ShardUpload.ChunksOnly`:
a shard's data ahead of it, its shard following later beside the other
ranks' data; `Manifest`: a shard, durably, the coordinator completing
the step; `Commit(shards)`: the coordinator's end of a save, its shard
then the step completed with exactly `shards`, by rank; `RankLocal(save)`:
a rank's end of a rank-local save, complete once every rank's shard of
`save` is stored, never with another save's)."""


@dataclass(frozen=True)
class ShardWrite:
    """A write of rank `rank`'s shard of `step` of `world` ranks: its
    `values`, how far it goes (`then`), how it was saved (`record`, with
    the step) and whether it replaces a committed step."""

    step: int
    rank: int
    world: int
    values: Mapping[str, Any]
    then: Then
    record: Optional[SaveRecord] = None
    replace: bool = True


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

    def open(self, step: Optional[int], commit: Optional[str]) -> Opened:
        """`step` (exactly `commit`, if given; the newest complete step if
        None, found as it is opened) opened for reading; raises
        FileNotFoundError if it is not complete there."""


def is_bucket_url(target: Any) -> bool:
    """Whether `target` is a bucket URL (`s3://`, `file://`)."""
    return isinstance(target, str) and target.split("://", 1)[0] in ("s3", "file")


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
