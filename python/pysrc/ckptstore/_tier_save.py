"""A save on the node-local tier (`ckptstore.dcp.Tiers.save`): each rank
commits its shard into its own store, sends copies to its peers, who
commit them, and once every shard and copy is durable every rank writes
the step's record."""

import dataclasses
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.futures import Future

from . import CommitInfo, Store, Tensor, _dcp_json
from ._cost import SaveCost
from ._staging import Hashes
from ._dcp_json import Where
from ._tier_layout import Record
from ._tier_wire import Group, TierFailure, attempt
from ._dcp_write import StorageWriter

Values = Dict[str, Any]


class ShardWriter(StorageWriter):
    """DCP's storage writer of a tiered save: each rank's write items go
    into `store` as step `step` (a store of its own: the coordinator's
    too, DCP's metadata going into the step's record instead). Not sent to
    other processes (thread mode only)."""

    def __init__(self, store: Store, step: int, hashes: Optional[Hashes] = None) -> None:
        super().__init__(target=store, step=step)
        self._hashes = dict(hashes or {})  # of a staged state's tensors
        self.store = store
        self.values: Values = {}
        self.metadata_json = ""
        self.info: Optional[CommitInfo] = None

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        world = len(plans)
        return [dataclasses.replace(p, storage_data=(i, world)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[_storage.WriteResult]]":
        if isinstance(plan.storage_data, tuple):
            self._rank, self._world = plan.storage_data
        values: Values = {}
        written = [self._resolve(item, planner, values) for item in plan.items]
        self.info = self.store.save(self._step, values, replace=True)
        self.values = values
        results = [_storage.WriteResult(index, size, Where(self._rank, name)) for index, size, name in written]
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: List[List[_storage.WriteResult]]) -> None:
        storage: Dict[MetadataIndex, Where] = {}
        for per_rank in results:
            for r in per_rank:
                storage[r.index] = r.storage_data
        metadata.storage_data = storage
        self.metadata_json = _dcp_json.to_json(metadata)


def entry_bytes(value: Any) -> np.ndarray:
    """A shard entry's bytes as a 1-D uint8 array (no copy for a tensor)."""
    if isinstance(value, Tensor):
        return np.asarray(value.data).reshape(-1).view(np.uint8)
    if isinstance(value, np.ndarray):
        return value.reshape(-1).view(np.uint8)
    return np.frombuffer(bytearray(value), dtype=np.uint8)


def header(values: Values) -> List[Tuple[str, str, List[int], int]]:
    """(name, store dtype or "" for bytes, shape, bytes) of each entry."""
    out = []
    for name, v in sorted(values.items()):
        if isinstance(v, Tensor):
            out.append((name, v.dtype, list(v.shape), int(entry_bytes(v).size)))
        else:
            out.append((name, "", [], int(entry_bytes(v).size)))
    return out


def rebuilt(head: List[Tuple[str, str, List[int], int]], arrays: Sequence[np.ndarray]) -> Values:
    """The entries a header and its received bytes describe."""
    out: Values = {}
    for (name, dtype, shape, _), data in zip(head, arrays):
        out[name] = Tensor(dtype, shape, data) if dtype else data.tobytes()
    return out


def send_copies(
    group: Group, sources: List[int], holders: List[int], values: Values
) -> Tuple[Dict[int, Values], List[Dict[str, int]]]:
    """Send this rank's shard `values` to `holders` and receive the shards
    of `sources`: (the shards received by source rank, every rank's entry
    sizes). A failure on any rank (before a byte is sent) is raised on
    every rank."""
    head, failure = attempt(lambda: header(values))
    heads = group.gather(head)
    if head is None or any(h is None for h in heads):
        group.check(failure, "sending copies")
    mine, failure = attempt(lambda: [entry_bytes(values[name]) for name, _, _, _ in head or []])
    buffers, failed = attempt(lambda: [(src, [np.empty(n, dtype=np.uint8) for _, _, _, n in heads[src]]) for src in sources])
    got = group.exchange(
        [] if mine is None else [(h, mine) for h in holders],
        [] if buffers is None else buffers,
        failure or failed,
    )
    copies = {src: rebuilt(heads[src], got[src]) for src in sources}
    sizes = [{name: n for name, _, _, n in h} for h in heads]
    return copies, sizes


def agree(
    group: Group, step: int, digest: str, copy_digests: Dict[int, str], failure: str, metadata: str, seq: int
) -> Tuple[List[str], str, int, int]:
    """The collective after the commits: every rank's shard digest, the
    coordinator's metadata and clock, and the save's place in the order of
    saves (one more than the newest any rank recorded, `seq` being this
    rank's); raises on every rank if any rank failed or a copy differs
    from its shard."""
    told = group.gather((digest, copy_digests, failure, metadata, time.time_ns(), seq))
    problems = [f"rank {r}: {t[2]}" for r, t in enumerate(told) if t[2]]
    digests = [t[0] for t in told]
    for holder, t in enumerate(told):
        for src, d in t[1].items():
            if d != digests[src]:
                problems.append(f"rank {holder}'s copy of rank {src}'s shard differs from it")
    if problems:
        raise TierFailure(f"step {step} was not committed on the local tier: " + "; ".join(problems))
    return digests, told[0][3], told[0][4], max(t[5] for t in told) + 1


def record_of(
    step: int, saved_at: int, per_node: int, digests: List[str], copies: List[List[int]],
    sizes: List[Dict[str, int]], upload: bool, metadata: str, cost: SaveCost, seq: int,
) -> Record:
    return Record(
        step=step,
        saved_at=saved_at,
        seq=seq,
        ranks_per_node=per_node,
        digests=tuple(digests),
        copies=tuple(tuple(c) for c in copies),
        sizes=tuple(sizes),
        upload=upload,
        metadata=metadata,
        cost={k: v for k, v in dataclasses.asdict(cost).items() if k != "step"},
    )
