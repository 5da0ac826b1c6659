"""The node-local tier on disk (`ckptstore.dcp.Tiers`): which node holds
which ranks and whose copies; and a node's directory, whose every byte
and rule is Rust's (`ckptstore::tier`, through `_ckptstore.TierDir` and
`TierRecord`):

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
from typing import Dict, List, Optional, Set, Tuple

from ..._ckptstore import TierDir, TierRecord
from ..._store import Store

Record = TierRecord
"""That save `saved_at` of `step` is complete on the local tier: every
rank's shard (content digest `digests[r]`) and every copy (`copies[r]`:
the ranks keeping rank r's) was durable. Made, read and written by
`ckptstore::tier`, which checks it. DCP's metadata and the entries'
sizes are in the coordinator's shard; a record of 0.4.0 (format 1)
carries them (`metadata`, `sizes[r]`)."""

__all__ = ["Held", "Holding", "Record", "TierDir", "Topology", "kept_steps", "node_directory", "records_in", "write_record"]

# This rank's stores: (kind "own" or "copy", the rank whose shards it
# holds, the store).
Held = List[Tuple[str, int, Store]]

# (kind "own" or "copy", source rank, step, content digest)
Holding = Tuple[str, int, int, str]


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


def records_in(tier: TierDir, rank: Optional[int] = None) -> Dict[Tuple[int, int], Record]:
    """The records in a node's directory (of rank `rank` only, if given),
    by save; a refused one is skipped with a warning (another rank's copy
    of the same record, or an older step, serves)."""
    found, refused = tier.records(rank)
    for why in refused:
        warnings.warn(f"ckptstore.dcp.Tiers: {why}; skipped", stacklevel=2)
    return {r.key: r for r in found}


def write_record(tier: TierDir, rank: int, record: Record) -> None:
    """Rank `rank`'s record of a save, written durably and atomically: a
    save's last write, after which the save is complete here."""
    tier.write_record(rank, record)


def kept_steps(tier: TierDir, records: List[Record], keep: int) -> Set[int]:
    """The steps a rank whose records are `records` keeps after a save:
    those of its `keep` saves made last and of those still to be
    uploaded."""
    return set(tier.retain(records, keep))
