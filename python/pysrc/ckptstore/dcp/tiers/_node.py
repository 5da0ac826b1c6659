"""A rank's part of its node's directory of the local tier
(`ckptstore.dcp.Tiers`): where it is, the stores the rank keeps open,
what the rank's share of the node's stores holds, and retention."""

import os
import threading
import warnings
from datetime import timedelta
from typing import Dict, List, Optional, Set, Tuple

import torch.distributed as dist

from ..._ckptstore import TierDir
from ..._errors import Error
from ..._store import Store
from ..._store import open as open_store
from .._wire import DEFAULT_TIMEOUT, Group
from ._layout import Held, Holding, Record, Topology, kept_steps, node_directory


class Node:
    """Rank `rank`'s view of its node's directory (`local`, `{node}` in it
    replaced by the node's index) in a job of `topology`, its shards
    copied to `peers` ranks, keeping the `keep` newest complete saves."""

    def __init__(self, local: str, topology: Topology, rank: int, peers: int, keep: int) -> None:
        self.topology, self.rank, self.peers, self.keep = topology, rank, peers, keep
        self.dir = node_directory(local, topology.node_of(rank))
        self.tier = TierDir(self.dir)
        os.makedirs(self.dir, exist_ok=True)
        self._stores: Dict[str, Store] = {}
        self._lock = threading.Lock()

    def store(self, path: str) -> Store:
        """The store at `path`, kept open; opened again if its file is gone
        (a node's directory emptied under the job)."""
        with self._lock:
            found = self._stores.get(path)
            if found is not None and not os.path.exists(path):
                found.close()
                found = None
            if found is None:
                found = self._stores[path] = open_store(path)
            return found

    def own(self) -> Store:
        """This rank's own store."""
        return self.store(self.tier.store_path("own", self.rank))

    def close_stores(self) -> None:
        with self._lock:
            stores, self._stores = self._stores, {}
        for s in stores.values():
            s.close()

    def retain(self, records: Dict[Tuple[int, int], Record]) -> None:
        """Keep the `keep` complete saves made last among this rank's
        `records` (in the order of saves, not of step numbers: the save
        that just completed is always kept) and those still to be
        uploaded; remove every other step from this rank's stores, and
        retire the records of each step removed: this rank's, and those
        here of ranks this node no longer holds (another layout's)."""
        keep = kept_steps(self.tier, list(records.values()), self.keep)
        paths = [self.tier.store_path("own", self.rank)]
        paths += [self.tier.store_path("copy", src) for src in self.topology.sources(self.rank, self.peers)]
        removed: Set[int] = {step for step, _ in records if step not in keep}
        for path in paths:
            if not os.path.exists(path):
                continue
            store = self.store(path)
            for s in store.steps():
                if s not in keep:
                    store.remove(s)
                    removed.add(s)
        ranks = list(self.topology.ranks_of(self.topology.node_of(self.rank)))
        self.tier.retire(sorted(removed), self.rank, ranks)

    def survey(self) -> Tuple[Held, List[Holding]]:
        """This rank's share of its node's stores (each store of the
        directory goes to one rank of the node), opened, and what they
        hold."""
        ranks = self.topology.ranks_of(self.topology.node_of(self.rank))
        opened: Held = []
        held: List[Holding] = []
        try:
            for i, found in enumerate(self.tier.stores()):
                kind, src, path = found.kind, found.rank, found.path
                if ranks[i % len(ranks)] != self.rank:
                    continue
                try:
                    store = open_store(path)
                    for s in store.steps():
                        digest = store.content_digest(s)
                        if digest:
                            held.append((kind, src, s, digest))
                except (Error, OSError) as e:
                    warnings.warn(f"ckptstore.dcp.Tiers: {path} cannot be read ({e}); its shards are not used", stacklevel=4)
                    continue
                opened.append((kind, src, store))
        except BaseException:
            for _, _, store in opened:
                store.close()
            raise
        return opened, held


def join(
    local: str, peers: int, keep: int, ranks_per_node: Optional[int], timeout: Optional[timedelta]
) -> Tuple[Node, Group, Group]:
    """This rank's node of the tier at `local` and the tier's two groups of
    every rank, the saves' and the uploads' (made here, with `timeout`:
    collectives every rank makes). A node holds `ranks_per_node` ranks
    (default `LOCAL_WORLD_SIZE`, else 1)."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        wait = DEFAULT_TIMEOUT if timeout is None else timeout
        group = Group(dist.new_group(backend="gloo", timeout=wait), rank, world)
        uploads = Group(dist.new_group(backend="gloo", timeout=wait), rank, world)
    else:
        group = uploads = Group(None, 0, 1)
    per_node = ranks_per_node if ranks_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if per_node < 1:
        raise ValueError(f"Tiers(ranks_per_node={per_node}): at least 1")
    topology = Topology(group.world, per_node)
    others = topology.nodes - 1
    if peers > others and group.rank == 0:
        warnings.warn(
            f"ckptstore.dcp.Tiers: peers={peers} but the job has {others} other node(s): "
            + ("a single node keeps no copies" if others == 0 else f"copies go to {others}"),
            stacklevel=3,
        )
    return Node(local, topology, group.rank, peers, keep), group, uploads
