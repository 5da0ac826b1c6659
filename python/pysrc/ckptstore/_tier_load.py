"""A load from the node-local tier (`ckptstore.dcp.Tiers.load`): what
every rank holds, the newest save that the surviving stores can restore
whole, and DCP's reads served from each rank's own stores or, over the
tier's group, from the ranks that hold the shards or their copies."""

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from . import Error, Tensor, _dcp_json
from ._dcp_json import Where
from ._dcp_read import StorageReader, _memory_of
from ._ckptstore import tier_evaluate, tier_holders, tier_pick
from ._tier_layout import Record, records_in
from ._tier_wire import Group, attempt

# (kind "own" or "copy", source rank, step, content digest)
Holding = Tuple[str, int, int, str]

# Rank `src`'s shard (content digest given) from this rank's stores, by
# entry, the entries named in the mapping read into those Tensors' memory.
ShardOf = Callable[[int, str, Dict[str, Tensor]], Dict[str, np.ndarray]]


class ShardsLost(Error):
    """No surviving rank holds some shard of the step being loaded (or
    every holder's copy failed its hash check)."""


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
    and entry sizes as given, every read item's bytes from `shard_of`
    (this rank's stores) or from the rank serving that shard."""

    def __init__(
        self, group: Group, choice: Choice, shard_of: ShardOf, metadata: str, sizes: List[Dict[str, int]]
    ) -> None:
        super().__init__(target="the local tier", step=choice.record.step)
        self._group, self._choice, self._shard_of = group, choice, shard_of
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
        batch, into = ([], {}) if planned is None else planned
        pieces = [piece for _, piece, _, _ in batch]
        self._put(batch, fetch(self._group, self._choice, self._shard_of, pieces, into, failed), planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _plan(self, plan: LoadPlan, planner: LoadPlanner) -> Tuple[List[Any], Dict[int, Tuple[str, Tensor]]]:
        """(item, piece, box, target) of each read item; and the whole
        stored entries whose target is a plain tensor of the same dtype and
        size, read into its memory when this rank serves them."""
        self._follow(plan.storage_data)
        batch = []
        into: Dict[int, Tuple[str, Tensor]] = {}
        for i, item in enumerate(plan.items):
            piece, box = self._piece(item, self._where[item.storage_index])
            target = None if item.type == LoadItemType.BYTE_IO else planner.resolve_tensor(item).detach()
            batch.append((item, piece, box, target))
            dest = None if target is None else _memory_of(target, piece, box)
            whole = piece[2] == 0 and piece[3] == self._length(self._where[item.storage_index])
            if dest is not None and whole and not _dcp_json.json_dtype(target.dtype).startswith("torch."):  # type: ignore[union-attr]
                into[i] = (piece[1], Tensor(_dcp_json.json_dtype(target.dtype), list(target.shape), dest))  # type: ignore[union-attr]
        return batch, into


def fetch(
    group: Group,
    choice: Choice,
    shard_of: ShardOf,
    pieces: List[Tuple[int, str, int, int]],
    into: Dict[int, Tuple[str, Tensor]],
    failure: Optional[BaseException] = None,
) -> List[np.ndarray]:
    """The bytes of each (source rank, entry, start, length) of `pieces`
    (a collective). Each shard is served by its first holder, which learns
    only the requests addressed to it (point to point); a holder whose
    shard fails its checks (damaged, gone, unreadable) says so, and the
    next one serves it; any other failure on any rank (`failure`, this
    rank's planning; a `MemoryError` reading a shard) fails the call on
    every rank. A piece `into` names (a whole entry) is read into that
    Tensor's memory when this rank serves its shard."""
    step = choice.record.step
    group.check(failure, f"loading step {step} from the local tier")
    wanted = sorted({p[0] for p in pieces if p[3] > 0})
    refused: Set[Tuple[int, int]] = set()  # (holder, source rank), known to every rank
    loaded: Dict[int, Dict[str, np.ndarray]] = {}
    while True:
        server = {src: next((h for h in choice.holders.get(src, []) if (h, src) not in refused), None) for src in wanted}
        lost = [src for src in wanted if server[src] is None]
        group.check(
            ShardsLost(f"step {step}: no surviving rank holds a sound copy of the shards of ranks {lost}") if lost else None,
            f"loading step {step} from the local tier",
        )
        asked: Dict[int, List[int]] = {}
        for i, p in enumerate(pieces):
            if p[3] > 0 and server[p[0]] != group.rank:
                asked.setdefault(server[p[0]], []).append(i)  # type: ignore[arg-type]
        requests: Dict[int, List[Tuple[int, str, int, int]]] = group.send_to_some(
            {s: [pieces[i] for i in idx] for s, idx in asked.items()}
        )
        serving = {p[0] for p in pieces if p[3] > 0 and server[p[0]] == group.rank}
        serving |= {p[0] for reqs in requests.values() for p in reqs}
        mine: List[Tuple[int, str]] = []
        fatal: Optional[BaseException] = None
        for src in sorted(serving):
            if fatal is None and src not in loaded:
                mine_into = {entry: t for i, (entry, t) in into.items() if pieces[i][0] == src}
                try:
                    loaded[src] = shard_of(src, choice.record.digests[src], mine_into)
                except (Error, OSError, ValueError) as e:
                    mine.append((src, str(e)))
                except Exception as e:  # noqa: BLE001 - raised on every rank
                    fatal = e
        group.check(fatal, f"loading step {step} from the local tier")
        told = group.gather_if_any(mine or None)
        if not told:
            break
        for rank, fails in told:
            for src, why in fails:
                refused.add((rank, src))
                if group.rank == 0:
                    warnings.warn(
                        f"ckptstore.dcp.Tiers: rank {src}'s shard of step {step} as held by "
                        f"rank {rank} is refused ({why}); another holder serves it",
                        stacklevel=2,
                    )

    # A whole entry asked of another rank arrives in its target's memory.
    def buffer(i: int) -> np.ndarray:
        if i in into:
            return np.asarray(into[i][1].data).reshape(-1).view(np.uint8)
        return np.empty(pieces[i][3], dtype=np.uint8)

    sends, cannot_send = attempt(lambda: [(q, [_slice(loaded, p) for p in reqs]) for q, reqs in requests.items()])
    receives, cannot_receive = attempt(lambda: [(s, [buffer(i) for i in idx]) for s, idx in asked.items()])
    got = group.exchange(sends or [], receives or [], cannot_send or cannot_receive)
    out: List[np.ndarray] = [np.empty(0, dtype=np.uint8)] * len(pieces)
    for i, p in enumerate(pieces):
        if p[3] > 0 and server[p[0]] == group.rank:
            out[i] = _slice(loaded, p)
    for s, idx in asked.items():
        for i, data in zip(idx, got[s]):
            out[i] = data
    return out


def _slice(loaded: Dict[int, Dict[str, np.ndarray]], piece: Tuple[int, str, int, int]) -> np.ndarray:
    src, entry, start, n = piece
    whole = loaded[src].get(entry)
    if whole is None:
        raise ValueError(f"rank {src}'s shard has no entry {entry!r}")
    flat = whole.reshape(-1).view(np.uint8)
    if start + n > flat.size:
        raise ValueError(f"{entry!r}: bytes {start}..{start + n} are outside rank {src}'s entry of {flat.size}")
    return flat[start : start + n]
