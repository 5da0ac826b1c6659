"""A load from the node-local tier (`ckptstore.dcp.Tiers.load`): what
every rank holds, the newest save that the surviving stores can restore
whole, and DCP's reads served from each rank's own stores or, over the
tier's group, from the ranks that hold the shards or their copies."""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ._ckptstore import tier_evaluate, tier_holders, tier_pick
from ._targets import Deliver, Opened, Piece
from ._tier_fetch import ReadOf, ShardsLost, fetch
from ._tier_layout import Record, records_in
from ._tier_wire import Group

__all__ = ["Choice", "Holding", "ReadOf", "ShardsLost", "TierSource", "choose"]

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


class TierSource:
    """The local tier as the target of one load (`ckptstore.dcp.StorageReader`
    over it): the chosen save, its metadata and entry sizes as given, and
    each piece read from `read_of` (this rank's stores) or streamed from
    the rank serving that shard (`fetch`, collectives every rank joins)."""

    description = "the local tier"
    sendable = False
    fans_out = False  # its reads are the tier's own collectives
    commit: Optional[str] = None

    def __init__(
        self, group: Group, choice: Choice, read_of: ReadOf, metadata: str, sizes: List[Dict[str, int]]
    ) -> None:
        self._group, self._choice, self._read_of = group, choice, read_of
        self._metadata, self._sizes = metadata, sizes

    def latest(self) -> Optional[int]:
        return self._choice.record.step

    def open(self, step: int, commit: Optional[str]) -> Opened:
        if step != self._choice.record.step:
            raise FileNotFoundError(f"the local tier's load reads step {self._choice.record.step}, not {step}")
        return self

    def metadata(self) -> bytes:
        return self._metadata.encode()

    def length(self, rank: int, entry: str) -> int:
        sizes = self._sizes
        if not 0 <= rank < len(sizes) or entry not in sizes[rank]:
            raise ValueError(f"step {self._choice.record.step}: rank {rank} stored no entry {entry!r}")
        return sizes[rank][entry]

    def read(
        self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], deliver: Deliver, failure: Optional[BaseException]
    ) -> None:
        record = self._choice.record
        fetch(self._group, self._choice.holders, record.digests, record.step, self._read_of, list(pieces), dest, deliver, failure)
