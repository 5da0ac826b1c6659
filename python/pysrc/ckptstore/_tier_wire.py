"""How the ranks of a tiered job talk (`ckptstore.dcp.Tiers`): small
objects gathered by every rank, and bytes sent rank to rank in pieces of
at most 64 MiB, over a gloo group of the tier's own (no shared file
system is assumed). Every byte that crosses is hash-checked by its
receiver against the sender's BLAKE3."""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from . import CorruptError
from ._ckptstore import hash_arrays

PIECE = 64 << 20
"""Bytes sent in one message."""


class Group:
    """The tier's ranks: a gloo group over every rank of the job, or this
    process alone (no `torch.distributed`)."""

    def __init__(self, group: Optional[Any], rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's `obj`, by rank (a collective)."""
        if self.group is None:
            return [obj]
        out: List[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any, src: int) -> Any:
        """Rank `src`'s `obj` on every rank (a collective)."""
        if self.group is None:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def exchange(
        self,
        sends: Sequence[Tuple[int, Sequence[np.ndarray]]],
        receives: Sequence[Tuple[int, Sequence[np.ndarray]]],
    ) -> Dict[int, Sequence[np.ndarray]]:
        """Send each (rank, arrays) of `sends` (1-D uint8 arrays) and fill
        each (rank, arrays) of `receives` (writable C-contiguous 1-D uint8
        arrays of the sizes sent) from that rank: the arrays filled, by
        rank, each checked against the BLAKE3 its sender computed. Every
        rank calls it (the hashes are gathered), with its own lists; the
        lists of two ranks must agree (what one sends, the other
        receives, in the same order)."""
        sends = [(dst, [_contiguous(a) for a in arrays]) for dst, arrays in sends]
        digests = {dst: hash_arrays(list(arrays)) for dst, arrays in sends}
        told = self.gather(digests)
        got = dict(receives)
        works = []
        for src, arrays in got.items():
            for a in arrays:
                works.extend(self._pieces(torch.from_numpy(a), src, dist.irecv))
        for dst, arrays in sends:
            for a in arrays:
                works.extend(self._pieces(torch.from_numpy(a), dst, dist.isend))
        for w in works:
            w.wait()
        for src, arrays in got.items():
            expected = told[src].get(self.rank, [])
            if hash_arrays(arrays) != expected:
                raise CorruptError(f"bytes sent by rank {src} to rank {self.rank} arrived damaged (BLAKE3 differs)")
        return got

    def _pieces(self, t: torch.Tensor, peer: int, op: Any) -> List[Any]:
        return [op(t[at : at + PIECE], peer, group=self.group) for at in range(0, int(t.numel()), PIECE)]


def _contiguous(a: np.ndarray) -> np.ndarray:
    """`a`'s bytes as a 1-D array torch can send: itself, or a copy if it
    is not C-contiguous or not writable."""
    flat = a.reshape(-1).view(np.uint8)
    if flat.flags.c_contiguous and flat.flags.writeable:
        return flat
    return np.array(flat, dtype=np.uint8, copy=True)
