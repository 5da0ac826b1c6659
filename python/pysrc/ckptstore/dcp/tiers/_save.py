"""A save on the node-local tier (`ckptstore.dcp.Tiers.save`): each rank
commits its shard into its own store (the coordinator's with DCP's
metadata and every rank's entry sizes), sends copies to its peers, who
commit them, and once every shard and copy is durable every rank writes
the step's record. What a rank receives from the tier's collectives is a
fixed-size entry per rank of the job; headers and bytes go point to
point to the ranks that keep the copies."""

import dataclasses
import json
import time
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..._ckptstore import CommitInfo, SaveRecord, Tensor
from ..._store import Store
from ..._cost import SaveCost
from .._targets import Put
from ._layout import Record
from .._wire import Group, TierFailure, attempt

Values = Dict[str, Any]


SIZES = ".tier/sizes.json"
"""The entry of the coordinator's shard that holds every rank's entry
sizes (JSON: a list by rank of {entry: bytes}); not uploaded."""


class TierShard:
    """A rank's own store on the local tier as the target of one save
    (`ckptstore.dcp.StorageWriter` over it, thread mode only): the rank's
    shard is committed into `store` as the step, the coordinator's with
    DCP's metadata and every rank's entry sizes (`SIZES`), written once,
    in one shard; the shard's entries are kept (`values`) for the copies
    to peers. The save is the tier's to complete (its records), not this
    target's."""

    description = "the local tier"
    many_ranks = True
    sendable = False
    rank_local = False  # the tier keeps its own protocol

    def __init__(self, store: Store) -> None:
        self.store = store
        self.pool_key: Hashable = id(store)
        self.values: Values = {}
        self.info: Optional[CommitInfo] = None

    def committed(self, step: int) -> bool:
        return False  # a tier's save replaces its step (overwrite)

    def put_data(self, step: int, rank: int, world: int, values: Mapping[str, Any]) -> Put:
        return Put("", 0, 0)  # the shard is committed whole, by `put`

    def put(
        self, step: int, rank: int, world: int, values: Mapping[str, Any], record: Optional[SaveRecord], replace: bool
    ) -> Put:
        self.values = dict(values)
        self.info = self.store.save(step, values, replace=True)
        return Put("", self.info.bytes_written, self.info.bytes_reused)

    def layout_entries(self, sizes: List[Dict[str, int]]) -> Dict[str, bytes]:
        return {SIZES: json.dumps(sizes, separators=(",", ":")).encode()}

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
        # Committed as any rank's shard: every rank records the save once
        # every shard and copy is durable (`agree`, `Tiers`).
        return self.put(step, rank, world, values, record, replace)

    def finish_local(
        self, step: int, rank: int, world: int, values: Mapping[str, Any], record: Optional[SaveRecord], save: str
    ) -> Put:
        raise NotImplementedError(f"{self.description} takes no rank-local save")


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


def send_copies(group: Group, sources: List[int], holders: List[int], values: Values) -> Dict[int, Values]:
    """Send this rank's shard `values` to `holders` and receive the shards
    of `sources` (headers and bytes point to point): the shards received,
    by source rank. A failure on any rank (before a byte is sent) is
    raised on every rank."""
    head, failure = attempt(lambda: header(values))
    group.check(failure, "sending copies")
    heads = group.send_objects([(h, head) for h in holders], sources)
    mine, failure = attempt(lambda: [entry_bytes(values[name]) for name, _, _, _ in head or []])
    buffers, failed = attempt(lambda: [(src, [np.empty(n, dtype=np.uint8) for _, _, _, n in heads[src]]) for src in sources])
    got = group.exchange(
        [] if mine is None else [(h, mine) for h in holders],
        [] if buffers is None else buffers,
        failure or failed,
    )
    return {src: rebuilt(heads[src], got[src]) for src in sources}


# A rank's entry in `agree`: its shard's digest (32 bytes), whether it
# failed (1 byte), the newest `seq` it recorded and its clock (8 bytes
# each, little-endian).
_ENTRY = 49


def agree(
    group: Group, step: int, digest: str, copy_digests: Dict[int, str], failure: str, seq: int
) -> Tuple[List[str], int, int]:
    """The collective after the commits, a fixed-size entry per rank:
    every rank's shard digest, the coordinator's clock, and the save's
    place in the order of saves (one more than the newest any rank
    recorded, `seq` being this rank's). Raises on every rank if any rank
    failed or a copy differs from its shard."""
    entry = np.zeros(_ENTRY, dtype=np.uint8)
    if digest and not failure:
        entry[:32] = np.frombuffer(bytes.fromhex(digest), dtype=np.uint8)
    entry[32] = 1 if failure else 0
    entry[33:41] = np.frombuffer(seq.to_bytes(8, "little"), dtype=np.uint8)
    entry[41:49] = np.frombuffer(time.time_ns().to_bytes(8, "little"), dtype=np.uint8)
    told = group.gather_fixed(entry)
    digests = [bytes(t[:32]).hex() for t in told]
    problem = failure
    if not problem and not any(t[32] for t in told):
        differ = [src for src, d in copy_digests.items() if d != digests[src]]
        if differ:
            problem = f"its copies of ranks {differ}' shards differ from them"
    failed = None if not problem else TierFailure(problem)
    group.check(failed, f"step {step} was not committed on the local tier")
    saved_at = int.from_bytes(bytes(told[0][41:49]), "little")
    newest = max(int.from_bytes(bytes(t[33:41]), "little") for t in told)
    return digests, saved_at, newest + 1


def record_of(
    step: int, saved_at: int, per_node: int, digests: List[str], copies: List[List[int]],
    upload: bool, cost: SaveCost, seq: int,
) -> Record:
    return Record(
        step=step,
        saved_at=saved_at,
        seq=seq,
        ranks_per_node=per_node,
        digests=list(digests),
        copies=[list(c) for c in copies],
        upload=upload,
        cost={k: v for k, v in dataclasses.asdict(cost).items() if k != "step"},
    )
