"""A save on the node-local tier (`ckptstore.dcp.Tiers.save`): each rank
commits its shard into its own store (the coordinator's with DCP's
metadata and every rank's entry sizes), sends copies to its peers, who
commit them, and once every shard and copy is durable every rank writes
the step's record. What a rank receives from the tier's collectives is a
fixed-size entry per rank of the job; headers and bytes go point to
point to the ranks that keep the copies."""

import dataclasses
import json
import os
import time
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from ..._ckptstore import CommitInfo, SaveRecord, Tensor
from ..._cost import Clock, SaveCost
from ..._staging import Hashes
from ..._store import Store
from ..._ckptstore import ShardUpload
from .._targets import Put, ShardWrite
from .._wire import Group, TierFailure, attempt, described
from .._writer import StorageWriter
from ._layout import Record, records_in, write_record
from ._node import Node

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
    takes_rank_local = False
    sendable = False

    def __init__(self, store: Store) -> None:
        self.store = store
        self.pool_key: Hashable = id(store)
        self.values: Values = {}
        self.info: Optional[CommitInfo] = None

    def committed(self, step: int) -> bool:
        return False  # a tier's save replaces its step (overwrite)

    def put(self, write: ShardWrite) -> Put:
        if isinstance(write.then, ShardUpload.ChunksOnly):
            return Put("", 0, 0)  # the shard is committed whole, by its write
        if isinstance(write.then, ShardUpload.RankLocal):
            raise NotImplementedError("the tier keeps its own protocol: no rank-local save")
        # Every shard, the coordinator's too, is committed as any rank's:
        # every rank records the save once every shard and copy is durable
        # (`agree`, `Tiers`). A tier's save replaces its step.
        self.values = dict(write.values)
        self.info = self.store.save(write.step, write.values, replace=True)
        return Put("", self.info.bytes_written, self.info.bytes_reused)

    def layout_entries(self, sizes: List[Dict[str, int]]) -> Dict[str, bytes]:
        return {SIZES: json.dumps(sizes, separators=(",", ":")).encode()}


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


class Save:
    """The tier's saves, run on the save thread over `group`: each commits
    this rank's shard on `node`, sends and commits copies, and once every
    rank agrees every shard and copy is durable, writes this rank's record
    and applies retention. Every `every`-th save is due for the bucket
    (where `uploads`); the caller runs the upload (`Upload`)."""

    def __init__(self, node: Node, group: Group, every: int, uploads: bool) -> None:
        self._node, self._group, self._every, self._uploads = node, group, every, uploads
        self._saves = 0

    def run(
        self, state: Dict[str, Any], step: int, clock: Clock, hashes: Optional[Hashes], staging: Optional[BaseException]
    ) -> Tuple[SaveCost, bool]:
        """Save `state` as `step` on every rank together (`staging`: this
        rank could not stage it; every rank raises): its cost, and whether
        an upload is due."""
        node, group = self._node, self._group
        topo, rank = node.topology, node.rank

        def prepare() -> Tuple[Store, Dict[Tuple[int, int], Record]]:
            if staging is not None:
                raise staging
            os.makedirs(node.dir, exist_ok=True)  # a node's disk may have been replaced
            own = node.own()
            # This rank vouches no more for an older save of the step.
            node.tier.remove_record(step, rank)
            # The directory, read once for this save (its order, retention).
            return own, records_in(node.tier, rank)

        # A failure on any rank fails the save on every rank, here or in
        # DCP's exchange or in `agree`, never leaving the others waiting.
        prepared, failed = attempt(prepare)
        group.check(failed, f"step {step} was not saved on the local tier")
        assert prepared is not None
        own, records = prepared
        newest = max((r.seq for r in records.values()), default=0)
        shard = TierShard(own)
        writer = StorageWriter(shard, step)
        writer.use_hashes(hashes or {})
        dcp_save(state, storage_writer=writer, process_group=group.group, no_dist=group.group is None)
        copy_digests: Dict[int, str] = {}
        infos = [shard.info] if shard.info is not None else []

        def copy() -> None:
            copies = send_copies(group, topo.sources(rank, node.peers), topo.holders(rank, node.peers), shard.values)
            for src, values in copies.items():
                store = node.store(node.tier.store_path("copy", src))
                infos.append(store.save(step, values, replace=True))
                copy_digests[src] = store.content_digest(step) or ""

        _, failed = attempt(copy)
        shard.values = {}
        digest, failure = "", "" if failed is None else described(failed)
        if failed is None:
            found, failed = attempt(lambda: own.content_digest(step) or "")
            digest, failure = found or "", "" if failed is None else described(failed)
        digests, saved_at, seq = agree(group, step, digest, copy_digests, failure, newest)
        self._saves += 1
        upload = self._uploads and self._saves % self._every == 0
        # Every shard and copy is durable: the save's cost, kept in the record.
        cost = clock.cost(step, sum(i.bytes_written for i in infos), sum(i.bytes_reused for i in infos))
        holders = [topo.holders(src, node.peers) for src in range(topo.world)]
        record = record_of(step, saved_at, topo.per_node, digests, holders, upload, cost, seq)

        # Every rank returns or every rank raises: a rank that cannot
        # record the save (or apply retention after it) fails the call on
        # every rank, and nothing is uploaded. The save is complete all the
        # same where its record was written.
        def finish() -> None:
            write_record(node.tier, rank, record)
            node.retain({**records, record.key: record})

        _, failed = attempt(finish)
        group.check(failed, f"step {step} is durable on every rank, but some rank could not record it")
        return cost, upload


def state_dicts(state: Dict[str, Any]) -> Dict[str, Any]:
    """`state` with each `Stateful` value (a model, an optimizer wrapper)
    replaced by its `state_dict()`, as DCP's save does."""
    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state.items()}
