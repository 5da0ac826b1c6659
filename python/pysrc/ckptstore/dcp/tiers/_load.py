"""A load from the node-local tier (`ckptstore.dcp.Tiers.load`): what
every rank holds, the newest save that the surviving stores can restore
whole, and DCP's reads striped as a bucket's are (`stripes._run`), each
stripe read by a rank holding that shard (its own store, or a copy) from
its stores and handed to the ranks that need it."""

import json
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, TypeVar, Union

import numpy as np
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ..._ckptstore import ChunkMap, Range, TierDir, TierHolding
from ..._errors import CorruptError, Error
from ..._store import Store
from .._rank_local import SavedMetadata, SaveKind
from .._reader import StorageReader
from .._bucket import remote_of
from .._targets import METADATA, Deliver, Opened, Piece, Slice, read_in_batches
from .._wire import Group, TierFailure, attempt, described
from ..stripes._proofs import Refusal
from ..stripes._run import Refused
from ._layout import Held, Holding, Record, records_in
from ._node import Node
from ._save import SIZES

__all__ = [
    "Choice", "Load", "MapOf", "ReadOf", "ShardsLost", "TierSource", "choose", "chunk_map_held", "layout_of",
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
    tier: TierDir,
    held: List[Holding],
    step: Optional[int],
    failure: Optional[BaseException] = None,
) -> Tuple[Optional[Choice], str, List[int]]:
    """The save made last (of `step`, if given) that the job can restore
    whole from the local tier, by the records of every node's directory
    (`ckptstore::tier` evaluates and picks); why a save made after it
    cannot be (or ""); and the steps of those saves, the last made first.
    `failure`: this rank could not survey its stores (raised on all)."""
    group.check(failure, "loading from the local tier")
    gathered = enumerate(group.gather(held))
    holdings = [TierHolding(rank, kind, src, s, d) for rank, hs in gathered for kind, src, s, d in hs]
    # The ranks of a node read the same records: each save once per rank.
    reports = group.gather(list({(e.step, e.saved_at): e for e in tier.evaluate(holdings)}.values()))
    best, newer = TierDir.pick([e for r in reports for e in r], step)
    why = ""
    if newer:
        why = f"step {newer[0].step} on the local tier lacks every copy of the shards of ranks {newer[0].missing}"
    steps = list(dict.fromkeys(e.step for e in newer))
    if best is None:
        return None, why, steps
    key = (best.step, best.saved_at)
    src = min(r for r, evals in enumerate(reports) if any((e.step, e.saved_at) == key and not e.missing for e in evals))
    record = group.broadcast(records_in(tier).get(key) if group.rank == src else None, src)
    holders = record.holders(holdings)
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
        self.step: int = choice.record.step

    def latest(self) -> Optional[int]:
        return self._choice.record.step

    def open(self, step: Optional[int], commit: Optional[str]) -> Opened:
        if step is not None and step != self._choice.record.step:
            raise FileNotFoundError(f"the local tier's load reads step {self._choice.record.step}, not {step}")
        return self

    def saved_metadata(self, rank: int) -> SavedMetadata:
        # The tier saves with its own collectives.
        return SavedMetadata(SaveKind.COLLECTIVE, len(self._sizes), self._metadata.encode())

    def rank_document(self, rank: int) -> bytes:
        raise ValueError(f"step {self._choice.record.step} of the local tier is not a rank-local save")

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
        return [self._map(src).slices([Range(entry, start, n)])[0] for src, entry, start, n in pieces]

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


class Load:
    """The tier's loads, over `group`: from the local tier where the
    surviving ranks' stores hold every shard of the step (each rank
    reading its share of its node's stores, `Node.survey`), else from
    `bucket` (None: the local tier alone), with a warning that says why."""

    def __init__(self, node: Node, group: Group, bucket: Optional[str]) -> None:
        self._node, self._group, self._bucket = node, group, bucket

    def run(self, state: Dict[str, Any], wanted: Optional[int]) -> int:
        """Restore `state` from step `wanted` (the newest if None); the
        step restored."""
        rank = self._node.rank
        surveyed, failed = attempt(self._node.survey)
        opened = [] if surveyed is None else surveyed[0]
        try:
            # A rank that could not survey its stores fails the load on
            # every rank (choose's first collective).
            held = [] if surveyed is None else surveyed[1]
            choice, why, newer = choose(self._group, self._node.tier, held, wanted, failed)
            if choice is not None and newer and self._bucket is not None:
                # A newer save is broken here: the bucket may hold it whole.
                whole = self._in_bucket(newer)
                if whole is not None:
                    return self._from_bucket(state, whole, why)
            if choice is not None:
                if why and rank == 0:
                    warnings.warn(f"ckptstore.dcp.Tiers: {why}; restoring step {choice.record.step}", stacklevel=3)
                try:
                    self._from_tier(state, choice, opened)
                    return choice.record.step
                except (CheckpointException, ShardsLost) as e:
                    if self._bucket is None:
                        raise
                    why = f"the local tier could not serve step {choice.record.step} ({_first_line(e)})"
        finally:
            for _, _, store in opened:
                store.close()
        return self._from_bucket(state, wanted, why)

    def _from_tier(self, state: Dict[str, Any], choice: Choice, opened: Held) -> None:
        """Load `choice` from the local tier: a striped load whose stripes
        each holder reads from its stores; a holder that could not serve a
        shard sound is refused, with a warning, and the load runs again
        without it (every rank learns the same refusals at the same point)."""
        step, rank, topo = choice.record.step, self._node.rank, self._node.topology
        metadata, sizes = self._layout(choice, opened)
        read_of: ReadOf = lambda src, d, reads, proved: read_held(opened, src, step, d, reads, proved)  # noqa: E731
        map_of: MapOf = lambda src, d: chunk_map_held(opened, src, step, d)  # noqa: E731
        refused: Set[Tuple[int, int]] = set()  # (holder, source rank)
        nodes = [topo.node_of(r) for r in range(self._group.world)]
        while True:
            source = TierSource(self._group, choice, read_of, map_of, metadata, sizes, refused, nodes)
            lost = sorted(src for src, hs in (source.readers or {}).items() if not hs)
            if lost:
                raise ShardsLost(f"step {step}: no surviving rank holds a sound copy of the shards of ranks {lost}")
            try:
                self._dcp_load(state, StorageReader(source))
                return
            except CheckpointException as e:
                told = {k: why for k, why in refusals(e).items() if k not in refused}
                if not told:
                    raise
                for (holder, src), why in told.items():
                    if rank == 0:
                        warnings.warn(
                            f"ckptstore.dcp.Tiers: rank {src}'s shard of step {step} as held by "
                            f"rank {holder} is refused ({why}); another holder serves it",
                            stacklevel=4,
                        )
                refused |= set(told)

    def _from_bucket(self, state: Dict[str, Any], wanted: Optional[int], why: str) -> int:
        what = "no step" if wanted is None else f"no step {wanted}"
        if self._bucket is None:
            raise FileNotFoundError(f"{what} is whole on the local tier {self._node.dir}" + (f": {why}" if why else ""))
        bucket = self._bucket

        def find() -> Optional[int]:
            remote = remote_of(bucket)
            if wanted is None:
                return remote.latest_step()
            return wanted if remote.open_global(wanted) is not None else None

        found, failed = attempt(find) if self._node.rank == 0 else (None, None)
        found, failure = self._group.broadcast((found, None if failed is None else described(failed)), 0)
        if failure is not None:
            if failed is not None:
                raise failed
            raise TierFailure(f"rank 0 could not read {bucket}: {failure}")
        if found is None:
            raise FileNotFoundError(f"{what} is whole on the local tier nor in {bucket}" + (f" ({why})" if why else ""))
        if self._node.rank == 0:
            warnings.warn(
                f"ckptstore.dcp.Tiers: {why or what + ' is whole on the local tier'}; loading step {found} from {bucket}",
                stacklevel=4,
            )
        self._dcp_load(state, StorageReader(bucket, found))
        return int(found)

    def _layout(self, choice: Choice, opened: Held) -> Tuple[str, List[Dict[str, int]]]:
        """DCP's metadata and every rank's entry sizes of the save to
        restore: from its record (0.4.0's), else read from rank 0's shard
        by the first rank holding it that can, and broadcast (every rank's
        DCP planner needs the metadata; nothing else goes to every rank)."""
        record = choice.record
        if record.metadata is not None and record.sizes is not None:
            return record.metadata, list(record.sizes)
        problems = []
        for holder in choice.holders.get(0, []):
            got, failed = attempt(lambda: layout_of(opened, record)) if self._node.rank == holder else (None, None)
            got, why = self._group.broadcast((got, None if failed is None else described(failed)), holder)
            if got is not None:
                return got  # type: ignore[no-any-return]
            problems.append(f"rank {holder}: {why}")
        raise ShardsLost(
            f"step {record.step}: no rank could read DCP's metadata from rank 0's shard ({'; '.join(problems) or 'none holds it'})"
        )

    def _in_bucket(self, steps: List[int]) -> Optional[int]:
        """The first of `steps` that the bucket holds whole (rank 0 asks,
        every rank is told; a bucket that cannot be read holds none, with
        a warning)."""
        bucket = self._bucket
        assert bucket is not None

        def find() -> Optional[int]:
            remote = remote_of(bucket)
            return next((s for s in steps if remote.open_global(s) is not None), None)

        found, failed = attempt(find) if self._node.rank == 0 else (None, None)
        if failed is not None:
            warnings.warn(f"ckptstore.dcp.Tiers: {bucket} cannot be read ({described(failed)})", stacklevel=4)
        return self._group.broadcast(found, 0)  # type: ignore[no-any-return]

    def _dcp_load(self, state: Dict[str, Any], reader: Any) -> None:
        group = self._group.group
        dcp_load(state, storage_reader=reader, process_group=group, no_dist=group is None)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
