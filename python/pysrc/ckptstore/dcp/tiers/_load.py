"""A load from the node-local tier (`ckptstore.dcp.Tiers.load`): what
every rank holds, the newest save that the surviving stores can restore
whole, and DCP's reads striped as a bucket's are (`stripes._run`), each
stripe read by a rank holding that shard (its own store, or a copy) from
its stores and handed to the ranks that need it."""

import json
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, TypeVar, Union

import numpy as np
from torch.distributed.checkpoint.api import CheckpointException

from ..._ckptstore import ChunkMap, TierDir, tier_holders, tier_pick
from ..._errors import CorruptError, Error
from ..stripes._run import Refused
from ..stripes._proofs import Refusal
from ..._store import Store
from .._targets import METADATA, Deliver, Opened, Piece, Slice, read_in_batches
from ._layout import Record, records_in
from ._save import SIZES
from .._wire import Group

__all__ = [
    "Choice", "Held", "Holding", "MapOf", "ReadOf", "ShardsLost", "TierSource", "choose", "chunk_map_held", "layout_of",
    "read_held", "refusals",
]

# Fill each (entry, start, array) with bytes of rank `src`'s shard (of the
# content digest given) from this rank's stores, every chunk hash-checked,
# and return the proofs of each (entry, start, length) of the last list
# (`Store.read_ranges_proving`); raises (`Error`, `OSError`, `ValueError`)
# if no store here holds it sound.
ReadOf = Callable[[int, str, List[Tuple[str, int, np.ndarray]], List[Tuple[str, int, int]]], List[bytes]]

# Rank `src`'s shard's chunk map (of the content digest given) from this
# rank's stores (`Store.chunk_map`); raises as `ReadOf` does.
MapOf = Callable[[int, str], bytes]


# This rank's stores: (kind "own" or "copy", the rank whose shards it
# holds, the store).
Held = List[Tuple[str, int, Store]]


class ShardsLost(Error):
    """No surviving rank holds some shard of the step being loaded (or
    every holder's copy failed its hash check)."""


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
    tier: TierDir,
    held: List[Holding],
    step: Optional[int],
    failure: Optional[BaseException] = None,
) -> Tuple[Optional[Choice], str, List[int]]:
    """The save made last (of `step`, if given) that the job can restore
    whole from the local tier, by the records of every node's directory
    (`ckptstore::tier` evaluates and picks); why a save made after it
    cannot be (or ""); and the steps of those saves, the last made first.
    `failure`: this rank could not survey its stores (raised on every
    rank)."""
    group.check(failure, "loading from the local tier")
    holdings = [(rank, kind, src, s, d) for rank, hs in enumerate(group.gather(held)) for kind, src, s, d in hs]
    # The ranks of a node read the same records: each save once per rank.
    reports = group.gather(list({tuple(e[1]): e for e in tier.evaluate(holdings)}.values()))
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
    record = group.broadcast(records_in(tier).get(key) if group.rank == src else None, src)  # type: ignore[arg-type]
    holders = tier_holders(record, holdings)
    return Choice(record, dict(enumerate(holders))), why, steps


class TierSource:
    """The local tier as the target of one load (`ckptstore.dcp.StorageReader`
    over it): the chosen save, its metadata and entry sizes as given, and
    each piece read from `read_of` (this rank's stores). At several ranks
    the load is striped over the tier's group, each stripe of a shard read
    by one of its holders not `refused` (by source rank, in the order of
    `Choice.holders`), on the node of the ranks needing it where one is
    there (`nodes`: each rank's node). A rank handed bytes of a shard it
    may not hold checks them against that shard's chunk map, sent by the
    holder (`map_of`) and taken only for the save's content digest in the
    record (`_targets.MapsTravel`)."""

    description = "the local tier"
    sendable = False
    fans_out = True

    def __init__(
        self,
        group: Group,
        choice: Choice,
        read_of: ReadOf,
        map_of: MapOf,
        metadata: str,
        sizes: List[Dict[str, int]],
        refused: Set[Tuple[int, int]],
        nodes: List[int],
    ) -> None:
        self.group: Optional[Group] = group
        self._rank, self._choice, self._read_of, self._map_of = group.rank, choice, read_of, map_of
        self._maps: Dict[int, ChunkMap] = {}
        self._metadata, self._sizes = metadata, sizes
        self.readers: Optional[Dict[int, List[int]]] = {
            src: [h for h in hs if (h, src) not in refused] for src, hs in choice.holders.items()
        }
        self.nodes: Optional[List[int]] = nodes
        self.commit: Optional[str] = None

    def latest(self) -> Optional[int]:
        return self._choice.record.step

    def open(self, step: int, commit: Optional[str]) -> Opened:
        if step != self._choice.record.step:
            raise FileNotFoundError(f"the local tier's load reads step {self._choice.record.step}, not {step}")
        return self

    def metadata(self) -> bytes:
        return self._metadata.encode()

    def rank_metadata(self, rank: int) -> Optional[Tuple[int, bytes]]:
        return None  # the tier saves with its own collectives

    def length(self, rank: int, entry: str) -> int:
        sizes = self._sizes
        if not 0 <= rank < len(sizes) or entry not in sizes[rank]:
            raise ValueError(f"step {self._choice.record.step}: rank {rank} stored no entry {entry!r}")
        return sizes[rank][entry]

    def read(
        self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], deliver: Deliver, failure: Optional[BaseException]
    ) -> None:
        """Read `pieces` from this rank's stores (those without memory of
        their own in batches); raises `Refused` naming each shard no store
        here could read sound."""
        if failure is not None:
            raise failure
        record = self._choice.record
        refusals: List[Refusal] = []
        failed: Set[int] = set()

        def fill(batch: List[int], arrays: List[np.ndarray]) -> List[int]:
            filled: List[int] = []
            by_src: Dict[int, List[Tuple[int, np.ndarray]]] = {}
            for i, a in zip(batch, arrays):
                by_src.setdefault(pieces[i][0], []).append((i, a))
            for src, places in by_src.items():
                if src in failed:
                    continue
                try:
                    self._read_of(src, record.digests[src], [(pieces[i][1], pieces[i][2], a) for i, a in places], [])
                except (Error, OSError, ValueError) as e:
                    failed.add(src)
                    refusals.append((self._rank, src, str(e)))
                    continue
                filled += [i for i, _ in places]
            return filled

        read_in_batches(pieces, dest, deliver, fill)
        if refusals:
            raise Refused(f"loading step {record.step} from the local tier", refusals)

    proves = True

    def chunk_map(self, src: int) -> Union[bytes, str]:
        record = self._choice.record
        try:
            sent = self._map_of(src, record.digests[src])
            # This rank's slices of what it sends come from the same map.
            self._maps.setdefault(src, ChunkMap(record.step, sent, record.digests[src]))
        except (Error, OSError, ValueError) as e:
            return str(e)
        return sent

    def learn_map(self, src: int, sent: Union[bytes, str]) -> Optional[str]:
        if isinstance(sent, str):
            return sent
        record = self._choice.record
        try:
            self._maps.setdefault(src, ChunkMap(record.step, sent, record.digests[src]))
        except (Error, ValueError) as e:
            return str(e)
        return None

    def _map(self, src: int) -> ChunkMap:
        """Rank `src`'s shard's chunk map: as a peer sent it, else from this
        rank's stores."""
        found = self._maps.get(src)
        if found is None:
            record = self._choice.record
            found = self._maps[src] = ChunkMap(record.step, self._map_of(src, record.digests[src]), record.digests[src])
        return found

    def slices(self, pieces: Sequence[Piece]) -> List[List[Slice]]:
        return [self._map(src).slices([(entry, start, n)])[0] for src, entry, start, n in pieces]

    def read_proving(self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], proved: Sequence[Piece]) -> List[bytes]:
        """Read `pieces` into `dest` (one array each) and prove `proved`,
        shard by shard; raises `Refused` naming each shard no store here
        could read sound."""
        record = self._choice.record
        proofs: Dict[int, bytes] = {}
        refusals: List[Refusal] = []
        for src in dict.fromkeys(p[0] for p in pieces):
            mine = [k for k, p in enumerate(proved) if p[0] == src]
            reads = [(p[1], p[2], dest[i]) for i, p in enumerate(pieces) if p[0] == src]
            try:
                made = self._read_of(src, record.digests[src], reads, [proved[k][1:] for k in mine])
            except (Error, OSError, ValueError) as e:
                refusals.append((self._rank, src, str(e)))
                continue
            proofs.update(zip(mine, made))
        if refusals:
            raise Refused(f"loading step {record.step} from the local tier", refusals)
        return [proofs[k] for k in range(len(proved))]


def read_held(
    opened: Held,
    src: int,
    step: int,
    digest: str,
    reads: List[Tuple[str, int, np.ndarray]],
    proved: List[Tuple[str, int, int]],
) -> List[bytes]:
    """Fill each (entry, start, array) of `reads` from rank `src`'s shard
    of `step` (content `digest`) in this rank's stores, its own store
    first, every chunk read hash-checked; the proofs of `proved`."""
    return _from_stores(opened, src, step, lambda store: store.read_ranges_proving(step, reads, proved, digest=digest))


def chunk_map_held(opened: Held, src: int, step: int, digest: str) -> bytes:
    """Rank `src`'s shard of `step` (content `digest`): its chunk map, from
    this rank's stores, its own store first."""
    return _from_stores(opened, src, step, lambda store: store.chunk_map(step, digest=digest))


R = TypeVar("R")


def _from_stores(opened: Held, src: int, step: int, use: Callable[[Store], Optional[R]]) -> R:
    """`use` of the first of this rank's stores of rank `src`'s shards (its
    own first) that holds the save and reads it sound."""
    problems = []
    for _, held, store in sorted(opened, key=lambda o: o[0] != "own"):
        if held != src:
            continue
        try:
            got = use(store)
        except CorruptError as e:
            problems.append(str(e))
            continue
        if got is not None:
            return got
        problems.append(f"step {step} is gone from a store of rank {src}'s shards, or is another save")
    raise CorruptError("; ".join(problems) or f"no store here holds rank {src}'s shard of step {step}")


def layout_of(opened: List[Tuple[str, int, Store]], record: Record) -> Tuple[str, List[Dict[str, int]]]:
    """DCP's metadata and the entry sizes in rank 0's shard of `record`'s
    save, from this rank's stores (hash-checked)."""
    problems = []
    for _, held, store in sorted(opened, key=lambda o: o[0] != "own"):
        if held != 0 or store.content_digest(record.step) != record.digests[0]:
            continue
        try:
            metadata, sizes = store.get_blob(record.step, METADATA), store.get_blob(record.step, SIZES)
        except CorruptError as e:
            problems.append(str(e))
            continue
        if metadata is None or sizes is None:
            problems.append(f"rank 0's shard of step {record.step} has no DCP metadata")
            continue
        return metadata.decode(), [{str(k): int(v) for k, v in s.items()} for s in json.loads(sizes)]
    raise CorruptError("; ".join(problems) or f"no store here holds rank 0's shard of step {record.step}")


def refusals(e: CheckpointException) -> Dict[Tuple[int, int], str]:
    """The refusals a load failed with (`stripes._run.Refused`, raised on every
    rank alike): why, by (holder, source rank)."""
    out: Dict[Tuple[int, int], str] = {}
    for failure in e.failures.values():
        if isinstance(failure[0], Refused):
            for holder, src, why in failure[0].refusals:
                out.setdefault((holder, src), why)
    return out
