"""The node-local tier on disk (`ckptstore.dcp.Tiers`): which node holds
which ranks and whose copies; and a node's directory, whose every byte
and rule is Rust's (`ckptstore::tier`, through `_ckptstore.tier_*`):

    rank-RRRRR.ckpt            rank R's own shards, one store step per step
    copies-of-RRRRR.ckpt       copies of rank R's shards kept on this node
    records/step-SSSSSSSSSSSSSSSSSSSS.rank-RRRRR.json
                               rank R's record of step S (written last)
    records/step-SSSSSSSSSSSSSSSSSSSS.in-bucket
                               step S (the save the file names) is whole
                               in the bucket

A record is written by every rank only after every rank's shard and every
copy is durable, so one record anywhere proves its save complete; the
shards' content digests in it tell a shard or copy of that save from one
of another save of the same step. The format is in docs/design.md.
"""

import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

from ._ckptstore import (
    tier_in_bucket,
    tier_mark_in_bucket,
    tier_records,
    tier_remove_record,
    tier_retain,
    tier_store_path,
    tier_stores,
    tier_write_record,
)


@dataclass(frozen=True)
class Topology:
    """`world` ranks on nodes of `per_node` ranks: node `i` holds ranks
    `i*per_node .. i*per_node+per_node-1` (the last node may hold fewer)."""

    world: int
    per_node: int

    @property
    def nodes(self) -> int:
        return -(-self.world // self.per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.per_node, min(self.world, (node + 1) * self.per_node))

    def holders(self, src: int, peers: int) -> List[int]:
        """The ranks that keep copies of rank `src`'s shards: the rank in
        the same place on each of the next `peers` nodes (as many as there
        are other nodes)."""
        node, place = self.node_of(src), src % self.per_node
        out = []
        for j in range(1, min(peers, self.nodes - 1) + 1):
            ranks = self.ranks_of((node + j) % self.nodes)
            out.append(ranks[place % len(ranks)])
        return out

    def sources(self, holder: int, peers: int) -> List[int]:
        """The ranks whose copies `holder` keeps."""
        return [src for src in range(self.world) if holder in self.holders(src, peers)]


def node_directory(local: str, node: int) -> str:
    return local.replace("{node}", str(node))


def own_store(directory: str, rank: int) -> str:
    return tier_store_path(directory, "own", rank)


def copy_store(directory: str, src: int) -> str:
    return tier_store_path(directory, "copy", src)


def stores_in(directory: str) -> List[Tuple[str, int, str]]:
    """The stores in a node's directory: (kind "own" or "copy", the rank
    whose shards it holds, path), in name order."""
    return tier_stores(directory)


@dataclass(frozen=True)
class Record:
    """That save `saved_at` of `step` is complete on the local tier: every
    rank's shard (content digest `digests[r]`) and every copy (`copies[r]`:
    the ranks keeping rank r's) was durable. Read and written by
    `ckptstore::tier`, which checks it. DCP's metadata and the entries'
    sizes are in the coordinator's shard; a record of 0.4.0 (format 1)
    carries them (`metadata`, `sizes[r]`)."""

    step: int
    saved_at: int
    ranks_per_node: int
    digests: Tuple[str, ...]
    copies: Tuple[Tuple[int, ...], ...]
    upload: bool
    sizes: Optional[Tuple[Dict[str, int], ...]] = None
    metadata: Optional[str] = None
    # What the save cost the rank that wrote this record (SaveCost's
    # fields), if it says.
    cost: Optional[Dict[str, float]] = None
    # The save's place in the order of saves (0 in records of 0.4.0).
    seq: int = 0

    @property
    def world_size(self) -> int:
        return len(self.digests)

    @property
    def key(self) -> Tuple[int, int]:
        """Which save of which step."""
        return (self.step, self.saved_at)

    def fields(self) -> Tuple[Any, ...]:
        """The record as `_ckptstore.tier_*` takes it."""
        return (
            self.step, self.saved_at, self.seq, self.ranks_per_node, list(self.digests),
            [list(c) for c in self.copies], None if self.sizes is None else list(self.sizes), self.upload,
            self.metadata, self.cost,
        )

    @staticmethod
    def of(fields: Tuple[Any, ...]) -> "Record":
        step, saved_at, seq, per_node, digests, copies, sizes, upload, metadata, cost = fields
        return Record(
            step=step, saved_at=saved_at, ranks_per_node=per_node, digests=tuple(digests),
            copies=tuple(tuple(c) for c in copies), sizes=None if sizes is None else tuple(sizes), upload=upload,
            metadata=metadata, cost=cost, seq=seq,
        )


def write_record(directory: str, rank: int, record: Record) -> None:
    """Rank `rank`'s record, written durably and atomically."""
    tier_write_record(directory, rank, record.fields())


def remove_record(directory: str, step: int, rank: int) -> None:
    """Remove rank `rank`'s record of `step` (and the step's in-bucket mark)."""
    tier_remove_record(directory, step, rank)


def mark_in_bucket(directory: str, record: Record) -> None:
    tier_mark_in_bucket(directory, record.key)


def in_bucket(directory: str, record: Record) -> bool:
    """Whether the bucket holds this save of the step whole (as far as this
    node was told)."""
    return bool(tier_in_bucket(directory, record.key))


def kept_steps(directory: str, rank: int, keep: int) -> Set[int]:
    """The steps rank `rank` keeps after a save: those of its `keep` saves
    made last and of those still to be uploaded."""
    return set(tier_retain(directory, rank, keep))


def records_in(directory: str, rank: Optional[int] = None) -> Dict[Tuple[int, int], Record]:
    """The records in a node's directory (of rank `rank` only, if given),
    by save; a refused one is skipped with a warning (another rank's copy
    of the same record, or an older step, serves)."""
    found, refused = tier_records(directory, rank)
    for why in refused:
        warnings.warn(f"ckptstore.dcp.Tiers: {why}; skipped", stacklevel=2)
    records = [Record.of(f) for f in found]
    return {r.key: r for r in records}
