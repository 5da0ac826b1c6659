"""How the ranks of a tiered job talk (`ckptstore.dcp.Tiers`): small
objects gathered by every rank, and bytes sent rank to rank in pieces of
at most 64 MiB, over a gloo group of the tier's own (no shared file
system is assumed). Every byte that crosses is hash-checked by its
receiver against the sender's BLAKE3."""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from . import CorruptError
from ._ckptstore import hash_arrays

PIECE = 64 << 20
"""Bytes sent in one message."""

T = TypeVar("T")


class TierFailure(RuntimeError):
    """A tiered save or load failed on some rank: raised on every rank of
    the job at the same collective, so that the ranks stay in step and the
    `Tiers` object keeps working."""


def attempt(work: Callable[[], T]) -> Tuple[Optional[T], Optional[BaseException]]:
    """Run this rank's local work between two collectives: its result, or
    the exception it raised (any `Exception`: a `MemoryError` as much as an
    `OSError`), to be told to the other ranks rather than leave them waiting
    in a collective this rank skips."""
    try:
        return work(), None
    except Exception as e:  # noqa: BLE001 - every failure is told to every rank
        return None, e


def described(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


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

    def failures(self, mine: Optional[BaseException]) -> List[str]:
        """Every rank's failure at this point ("rank R: Type: message"),
        empty if none failed (a collective: one integer per rank, and the
        messages gathered only when some rank failed)."""
        if self.group is None:
            return [] if mine is None else [f"rank 0: {described(mine)}"]
        flag = torch.tensor([0 if mine is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not int(flag.item()):
            return []
        told = self.gather("" if mine is None else f"rank {self.rank}: {described(mine)}")
        return [t for t in told if t]

    def check(self, mine: Optional[BaseException], what: str) -> None:
        """Raise on every rank if any rank failed (a collective): this
        rank's own exception where it failed, else a `TierFailure` naming
        every rank's."""
        told = self.failures(mine)
        if not told:
            return
        if mine is not None:
            raise mine
        raise TierFailure(f"{what}: " + "; ".join(told))

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
        failure: Optional[BaseException] = None,
    ) -> Dict[int, Sequence[np.ndarray]]:
        """Send each (rank, arrays) of `sends` (1-D uint8 arrays) and fill
        each (rank, arrays) of `receives` (writable C-contiguous 1-D uint8
        arrays of the sizes sent) from that rank: the arrays filled, by
        rank, each checked against the BLAKE3 its sender computed. Every
        rank calls it (the hashes are gathered), with its own lists; the
        lists of two ranks must agree (what one sends, the other
        receives, in the same order). `failure`: this rank could not make
        its lists; it is raised on every rank before a byte is sent, as is
        a failure to prepare the bytes to send."""

        def prepare() -> Tuple[List[Tuple[int, List[np.ndarray]]], Dict[int, Any]]:
            if failure is not None:
                raise failure
            ready = [(dst, [_contiguous(a) for a in arrays]) for dst, arrays in sends]
            return ready, {dst: hash_arrays(list(arrays)) for dst, arrays in ready}

        prepared, failed = attempt(prepare)
        told = self.gather(None if prepared is None else prepared[1])
        if prepared is None or any(t is None for t in told):
            # A rank could not prepare its part: nothing is sent, and every
            # rank raises here (the check cannot pass: some rank failed).
            self.check(failed, "sending bytes between ranks")
            raise TierFailure("sending bytes between ranks failed")
        ready = prepared[0]
        got = dict(receives)
        works = []
        for src, arrays in got.items():
            for a in arrays:
                works.extend(self._pieces(torch.from_numpy(a), src, dist.irecv))
        for dst, ready_arrays in ready:
            for a in ready_arrays:
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
