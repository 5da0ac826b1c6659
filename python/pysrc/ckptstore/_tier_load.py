"""A load from the node-local tier (`ckptstore.dcp.Tiers.load`): what
every rank holds, the newest save that the surviving stores can restore
whole, and DCP's reads served from each rank's own stores or, over the
tier's group, from the ranks that hold the shards or their copies."""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from . import _dcp_json
from ._dcp_json import Where
from ._dcp_read import StorageReader, _memory_of
from ._ckptstore import tier_evaluate, tier_holders, tier_pick
from ._tier_fetch import ReadOf, ShardsLost, fetch
from ._tier_layout import Record, records_in
from ._tier_wire import Group, attempt

__all__ = ["Choice", "Holding", "ReadOf", "ShardsLost", "TierReader", "choose"]

# (kind "own" or "copy", source rank, step, content digest)
Holding = Tuple[str, int, int, str]


@dataclass(frozen=True)
class Choice:
    """The save to restore and, for each of its ranks' shards, the ranks
    of this job holding it (its own store first, then copies)."""

    record: Record
    holders: Dict[int, List[int]]


def choose(
    group: Group,
    directory: str,
    held: List[Holding],
    step: Optional[int],
    failure: Optional[BaseException] = None,
) -> Tuple[Optional[Choice], str, List[int]]:
    """The save made last (of `step`, if given) that the job can restore
    whole from the local tier, by the records of every node's `directory`
    (`ckptstore::tier` evaluates and picks); why a save made after it
    cannot be (or ""); and the steps of those saves, the last made first.
    `failure`: this rank could not survey its stores (raised on every
    rank)."""
    group.check(failure, "loading from the local tier")
    holdings = [(rank, kind, src, s, d) for rank, hs in enumerate(group.gather(held)) for kind, src, s, d in hs]
    # The ranks of a node read the same records: each save once per rank.
    reports = group.gather(list({tuple(e[1]): e for e in tier_evaluate(directory, holdings)}.values()))
    best, newer = tier_pick([e for r in reports for e in r], step)
    why = ""
    if newer:
        _, (s, _), missing = newer[0]
        why = f"step {s} on the local tier lacks every copy of the shards of ranks {list(missing)}"
    steps = list(dict.fromkeys(key[0] for _, key, _ in newer))
    if best is None:
        return None, why, steps
    key = tuple(best[1])
    src = min(r for r, evals in enumerate(reports) if any(tuple(e[1]) == key and not e[2] for e in evals))
    record = group.broadcast(records_in(directory).get(key) if group.rank == src else None, src)  # type: ignore[arg-type]
    holders = tier_holders(record.fields(), holdings)
    return Choice(record, dict(enumerate(holders))), why, steps


class TierReader(StorageReader):
    """DCP's storage reader of a tiered load: the chosen save's metadata
    and entry sizes as given, every read item's bytes from `read_of`
    (this rank's stores) or streamed from the rank serving that shard,
    each straight into its target where the target holds the stored box
    as it is (a plain contiguous CPU tensor of its dtype)."""

    def __init__(
        self, group: Group, choice: Choice, read_of: ReadOf, metadata: str, sizes: List[Dict[str, int]]
    ) -> None:
        super().__init__(target="the local tier", step=choice.record.step)
        self._group, self._choice, self._read_of = group, choice, read_of
        self._metadata_json, self._sizes = metadata, sizes

    def read_metadata(self) -> Metadata:
        md = _dcp_json.from_json(self._metadata_json.encode())
        self._resolved, self._commit = self._choice.record.step, None
        self._where, self._metadata = md.storage_data, md
        return md

    def _length(self, where: Where) -> int:
        sizes = self._sizes
        if not 0 <= where.rank < len(sizes) or where.entry not in sizes[where.rank]:
            raise ValueError(f"step {self._choice.record.step}: rank {where.rank} stored no entry {where.entry!r}")
        return sizes[where.rank][where.entry]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        # This rank's reads are planned before the collectives of `fetch`,
        # which every rank joins (also one with nothing to read, or one
        # whose planning failed: its failure is raised on every rank).
        planned, failed = attempt(lambda: self._plan(plan, planner))
        batch, dest = ([], {}) if planned is None else planned
        record = self._choice.record
        fetch(
            self._group,
            self._choice.holders,
            record.digests,
            record.step,
            self._read_of,
            [piece for _, piece, _, _ in batch],
            dest,
            lambda i, data: self._put([batch[i]], [data], planner),
            failed,
        )
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _plan(self, plan: LoadPlan, planner: LoadPlanner) -> Tuple[List[Any], Dict[int, np.ndarray]]:
        """(item, piece, box, target) of each read item; and, by item, the
        target's memory where its piece lands as it is stored."""
        self._follow(plan.storage_data)
        batch = []
        dest: Dict[int, np.ndarray] = {}
        for i, item in enumerate(plan.items):
            piece, box = self._piece(item, self._where[item.storage_index])
            target = None if item.type == LoadItemType.BYTE_IO else planner.resolve_tensor(item).detach()
            batch.append((item, piece, box, target))
            memory = None if target is None else _memory_of(target, piece, box)
            if memory is not None:
                dest[i] = memory
        return batch, dest
