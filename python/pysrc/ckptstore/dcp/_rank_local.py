"""DCP's rank-local mode (`dcp.save(..., use_collectives=False)`) over a
bucket: each rank commits its own shard, with its own metadata, naming
the save it belongs to; the bucket completes the step once every rank's
shard of that save is there (`ShardUpload::RankLocal`). Here: the save's
identity, which the ranks agree on without a collective, and the global
view a load at another world size builds from the ranks' metadata."""

import enum
import math
import os
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from .._ckptstore import DCP_RANK_METADATA
from ._document import from_json

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

RANK_METADATA = DCP_RANK_METADATA
"""The entry of each rank's shard of a rank-local save that holds that
rank's DCP metadata (its own items only). A step saved with collectives
holds `METADATA` in its coordinator's shard instead: a reader that knows
only that finds no metadata in a rank-local step and refuses it."""



class SaveKind(enum.Enum):
    """How a step's DCP metadata was saved."""

    COLLECTIVE = "collective"
    """With collectives: the coordinator's document holds every item."""
    RANK_LOCAL = "rank_local"
    """Rank-locally: each rank's document (`RANK_METADATA`) holds its own
    items."""


@dataclass(frozen=True)
class SavedMetadata:
    """What a rank reads of a save's DCP metadata: how the save was made,
    the world size it was saved at, and the document this rank reads (the
    coordinator's; of a rank-local save, its own: that of the saved rank
    `dist rank` modulo `world`)."""

    kind: SaveKind
    world: int
    document: bytes

    def read_whole(self, rank_local: bool) -> bool:
        """Whether a load reads every saved rank's document to build the
        global view: a rank-local save loaded at another world size, or
        with `rank_local` off."""
        same_world = self.world == world()[1] > 1
        return self.kind is SaveKind.RANK_LOCAL and not (same_world and rank_local)

    def own_rank(self) -> int:
        """The saved rank whose document this rank read."""
        return world()[0] % self.world


@dataclass(frozen=True)
class LoadedMetadata:
    """The metadata a load plans from, and whether it is this rank's own
    (a rank-local save at its own world size: the rank reads only its own
    shard)."""

    metadata: Metadata
    own: bool


def load_metadata(saved: SavedMetadata, rank_local: bool, docs: Callable[[], List[bytes]]) -> LoadedMetadata:
    """The metadata a load of `saved` plans from: the coordinator's; of a
    rank-local save, this rank's own where it is read rank-locally, else
    every saved rank's (`docs()`, by rank) merged."""
    if saved.kind is SaveKind.COLLECTIVE:
        return LoadedMetadata(from_json(saved.document), own=False)
    if not saved.read_whole(rank_local):
        return LoadedMetadata(from_json(saved.document), own=True)
    return LoadedMetadata(merged([from_json(doc) for doc in docs()]), own=False)


_NONCE_KEY = "ckptstore/rank-local/job"
_lock = threading.Lock()
_nonce: Dict[int, str] = {}
_counts: Dict[Tuple[str, Hashable, int], int] = {}


def world() -> Tuple[int, int]:
    """(this process's rank, the world size) of the default process group;
    (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_identity(target: Hashable, step: int) -> str:
    """The identity of this process's next rank-local save of `step` to
    `target`, alike on every rank of the job that makes the same saves:
    the job's nonce (agreed once per process through the process group's
    store, no collective) and how many saves of the step to the target
    this process began. A save that died leaves its count used on every
    rank that began it, so the next save of the step is told apart."""
    nonce = _job_nonce()
    with _lock:
        key = (nonce, target, step)
        count = _counts.get(key, 0) + 1
        _counts[key] = count
    return f"{nonce}/{target!r}/{step}/{count}"


def _job_nonce() -> str:
    """A nonce of this job: the first a rank offers through the default
    store, under a key that a relaunch by torchelastic (same store, next
    restart) does not share."""
    group = dist.distributed_c10d._get_default_store()  # noqa: SLF001 (the pg's own store)
    with _lock:
        found = _nonce.get(id(group))
        if found is not None:
            return found
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    key = f"{_NONCE_KEY}/{run}/{restart}"
    agreed = group.compare_set(key, "", uuid.uuid4().hex).decode()
    with _lock:
        _nonce[id(group)] = agreed
    return agreed


_LANDED_KEY = "ckptstore/rank-local/landed"


RENDEZVOUS_FLAG = "CKPT_RANK_LOCAL_RENDEZVOUS"
"""Set to 0, a rank-local save's ranks complete its step by listing the
bucket's shards (`ShardUpload.RankLocal`: requests per rank that grow with
the ranks landing at once) rather than through the job's rendezvous store
(`announce`, the default)."""


def rendezvous() -> Optional["Store"]:
    """The job's rendezvous store (the default process group's), where a
    rank-local save's ranks tell each other their shards; None without a
    process group of several ranks, or with `RENDEZVOUS_FLAG` set to 0."""
    if os.environ.get(RENDEZVOUS_FLAG, "1") == "0":
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    store: "Store" = dist.distributed_c10d._get_default_store()  # noqa: SLF001 (the pg's own store)
    return store


_recovered: Dict[str, bool] = {}


def first_save_to(url: str) -> bool:
    """Whether this is this process's first rank-local save to `url` (a
    relaunch's rank 0 then completes the steps a completing rank that
    died left whole but uncommitted: `Remote.complete_landed`)."""
    with _lock:
        first = url not in _recovered
        _recovered[url] = True
    return first


def announce(store: "Store", save: str, rank: int, world: int, shard: str) -> Optional[List[str]]:
    """Tell the ranks of rank-local save `save` (of `world` ranks) that
    rank `rank`'s shard `shard` has landed: a `set` of its name and an `add`
    to the save's count, through `store`. The rank whose `add` completes
    the count gets every rank's shard name, by rank (one `multi_get`), and
    writes the step's commit; every other rank gets None and goes on. No
    rank waits for another, and none lists the bucket."""
    key = f"{_LANDED_KEY}/{save}"
    store.set(f"{key}/{rank}", shard)
    if store.add(f"{key}/count", 1) != world:
        return None
    names = store.multi_get([f"{key}/{r}" for r in range(world)])
    return [bytes(n).decode() for n in names]


def forget(store: "Store", save: str, world: int) -> None:
    """Delete the keys of rank-local save `save` (of `world` ranks) from
    `store`, once its step is committed: the job's store does not grow
    with its saves. Only the rank that completed the save calls this; no
    rank reads them after."""
    key = f"{_LANDED_KEY}/{save}"
    for r in range(world):
        store.delete_key(f"{key}/{r}")
    store.delete_key(f"{key}/count")


def hand_on(
    group: "dist.ProcessGroup",
    opened: Tuple[Any, Any],
    saved: int,
    part: Dict[int, bytes],
    failure: Optional[BaseException],
    what: str,
) -> Optional[List[bytes]]:
    """One `all_gather_object` over `group` (the load's: every member
    calls this at once, DCP reading metadata on every rank before its
    first collective) of what each member opened (`opened`: step and
    commit), the metadata documents it read of the `saved` ranks of a
    rank-local save (`part`, by rank) and its failure, if any. Raises a
    member's failure on every member; returns every saved rank's
    document, by rank, where the members opened the same save and their
    parts cover every rank, else None (each then reads what it needs
    itself: a member opened another save of the step, saved again
    meanwhile, or the step is not read whole)."""
    parts: List[Any] = [None] * dist.get_world_size(group)
    told = None if failure is None else f"{type(failure).__name__}: {failure}"
    dist.all_gather_object(parts, (opened, told, part), group=group)
    if failure is not None:
        raise failure
    for member, (_, failed, _) in enumerate(parts):
        if failed is not None:
            raise RuntimeError(f"{what}: member {member} of the load's process group failed: {failed}")
    docs: Dict[int, bytes] = {}
    for other, _, got in parts:
        if other != opened:
            return None
        docs.update(got)
    if saved == 0 or sorted(docs) != list(range(saved)):
        return None
    return [docs[r] for r in range(saved)]


def merged(ranks: List[Metadata]) -> Metadata:
    """The global metadata of a rank-local save, from each rank's (by
    rank): every rank's chunks of each tensor, each stored box found where
    the first rank holding it stored it (a replicated tensor is in every
    rank's shard)."""
    state: Dict[str, Any] = {}
    storage: Dict[MetadataIndex, Any] = {}
    planner: Dict[str, Any] = {}
    for rank, md in enumerate(ranks):
        for fqn, m in md.state_dict_metadata.items():
            state[fqn] = _merge(state.get(fqn), m, fqn, rank)
        for index, where in md.storage_data.items():
            storage.setdefault(index, where)
        planner.update(md.planner_data or {})
    return Metadata(
        state_dict_metadata=state,
        planner_data=planner or None,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=ranks[0].version if ranks else None,
    )


def _merge(have: Any, m: Any, fqn: str, rank: int) -> Any:
    """`have` (the earlier ranks' metadata of `fqn`) with rank `rank`'s `m`."""
    if have is None:
        if isinstance(m, TensorStorageMetadata):
            return TensorStorageMetadata(m.properties, m.size, list(m.chunks))
        return m
    if isinstance(have, BytesStorageMetadata) and isinstance(m, BytesStorageMetadata):
        return have
    if not (isinstance(have, TensorStorageMetadata) and isinstance(m, TensorStorageMetadata)):
        raise ValueError(f"{fqn}: rank {rank} saved it as another kind of item than the ranks before it")
    if m.size != have.size or m.properties.dtype != have.properties.dtype:
        raise ValueError(
            f"{fqn}: rank {rank} saved it as {m.properties.dtype} {list(m.size)}, "
            f"the ranks before it as {have.properties.dtype} {list(have.size)}"
        )
    known = {tuple(c.offsets) for c in have.chunks}
    have.chunks.extend(
        ChunkStorageMetadata(c.offsets, c.sizes) for c in m.chunks if tuple(c.offsets) not in known
    )
    return have


def check_covered(plan: LoadPlan, planner: Any, own: Metadata, description: str) -> None:
    """Refuse a rank-local load that would leave part of a tensor unread:
    this rank's own boxes must cover each of its tensors the saved step
    holds (a state sharded otherwise than when it was saved, at the same
    world size). The planner's state is DCP's default planners'."""
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, dict):
        return
    covered: Dict[str, int] = {}
    for item in plan.items:
        if item.type == LoadItemType.TENSOR:
            covered[item.dest_index.fqn] = covered.get(item.dest_index.fqn, 0) + math.prod(item.lengths)
    short = []
    for fqn, value in state.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        if fqn in own.state_dict_metadata and isinstance(local, torch.Tensor):
            if covered.get(fqn, 0) != local.numel():
                short.append(f"{fqn} ({covered.get(fqn, 0)} of {local.numel()} elements)")
    if short:
        raise ValueError(
            f"this rank's shard of the rank-local save in {description} does not hold all of "
            f"{', '.join(short[:3])}{' ...' if len(short) > 3 else ''}: the state is sharded otherwise "
            "than when it was saved; StorageReader(..., rank_local=False) reads every rank's shard"
        )
