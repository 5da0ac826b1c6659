"""The plan of a striped load (`stripes._run`): the stripes of the union of
the byte ranges every rank needs, who reads each, and in which phase;
what each reader sends each rank, in messages both ends cut alike
(`cut`, `message_size`). Pure: it reads and sends nothing; the
coordinator runs it over every rank's needs, and each rank is sent its
own `FanPlan`."""

from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from ..._ckptstore import CHUNK_BYTES
from .._targets import Piece

STRIPE = 32 * CHUNK_BYTES
"""The most bytes one reader reads in one phase (whole chunks; a load of
less than STRIPE a rank reads stripes of its share)."""

WINDOW = 64 << 20
"""Bytes a rank has in flight each way in a phase, one message a stream at
a time (shared among its streams)."""

LEAST = 64 << 10
"""A stream's least message size (a rank sending to or taking from more
than WINDOW / LEAST ranks holds LEAST bytes a stream)."""

# (index of a range in a stream, offset in the range, length)
Segment = Tuple[int, int, int]


def message_size(sender_streams: int, receiver_streams: int) -> int:
    """The size of a stream's messages: WINDOW shared by the streams of
    whichever end has more."""
    return max(LEAST, WINDOW // max(1, sender_streams, receiver_streams))


def cut(lengths: Sequence[int], size: int) -> Iterator[List[Segment]]:
    """The messages of a stream of ranges of `lengths`, one after the
    other, cut every `size` bytes (the last message shorter)."""
    message: List[Segment] = []
    room = size
    for i, n in enumerate(lengths):
        at = 0
        while at < n:
            take = min(room, n - at)
            message.append((i, at, take))
            at, room = at + take, room - take
            if room == 0:
                yield message
                message, room = [], size
    if message:
        yield message


@dataclass(frozen=True)
class Part:
    """What passes between a reader and a rank in one phase: the ranges of
    the reader's stripes the rank needs, in order, in messages of `size`
    bytes (the last shorter), which both ends cut alike."""

    peer: int
    ranges: List[Piece]
    size: int


@dataclass(frozen=True)
class Phase:
    """One rank's part of one phase: the stripes it reads (maybe none), what
    of them the rank needs itself, what it sends to each peer, what it
    takes from each."""

    reads: List[Piece]
    keep: List[Piece]
    sends: List[Part]
    takes: List[Part]


@dataclass(frozen=True)
class FanPlan:
    """One rank's phases (every rank has as many)."""

    phases: List[Phase]


def plan(
    needs: Sequence[Sequence[Piece]],
    readers: Optional[Mapping[int, Sequence[int]]] = None,
    nodes: Optional[Sequence[int]] = None,
) -> List[FanPlan]:
    """Every rank's phases, for ranks needing `needs` (by rank); where
    `readers` is given, a stripe of source rank S's shard is read by one
    of `readers[S]` (raises `ValueError` if there is none); where `nodes`
    (each rank's node) is given, a stripe no rank that needs it may read
    is read on the node where most of its ranks are, if a rank there may."""
    world = len(needs)
    wanted = [_merged(pieces) for pieces in needs]
    union = _merged([(src, entry, a, b - a) for w in wanted for (src, entry), rs in w.items() for a, b in rs])
    total = sum(b - a for rs in union.values() for a, b in rs)
    # Stripes of a rank's share, in whole chunks, at most STRIPE: a small
    # load is spread over the ranks too.
    share = -(-total // max(1, world))
    size = min(STRIPE, max(CHUNK_BYTES, -(-share // CHUNK_BYTES) * CHUNK_BYTES))
    stripes = _stripes(union, size)
    fair = total // max(1, world) + size
    load = [0] * world
    read_by: List[List[Tuple[Piece, Dict[int, List[Piece]]]]] = [[] for _ in range(world)]
    reader = -1
    for stripe in stripes:
        who = {r: parts for r in range(world) if (parts := _within(wanted[r], stripe))}
        pool = _pool(readers, stripe[0], world)
        # Where only some ranks may read a shard (the tier's holders, each
        # reading its own disk), the first of them that needs the stripe
        # (its own store's rank first) reads it, whatever its share.
        # Otherwise a rank that needs it and may read it: the last
        # stripe's reader goes on within its share (neighbouring entries
        # are then fetched together), else the least loaded.
        holding = [] if readers is None else [r for r in readers.get(stripe[0], []) if r in who]
        if holding:
            reader = holding[0]
        else:
            eligible = [r for r in who if r in pool] or _nearest(pool, who, nodes)
            if reader not in eligible or load[reader] + stripe[3] > share:
                reader = min(eligible, key=lambda r: (load[r], r))
            if load[reader] + stripe[3] > fair:
                reader = min(pool, key=lambda r: (load[r], r))
        load[reader] += stripe[3]
        read_by[reader].append((stripe, who))
    batches = [_batches(own) for own in read_by]
    phases: List[List[Phase]] = [[] for _ in range(world)]
    for j in range(max((len(b) for b in batches), default=0)):
        mine = [own[j] if j < len(own) else [] for own in batches]
        for rank, phase in enumerate(_phase(mine)):
            phases[rank].append(phase)
    return [FanPlan(p) for p in phases]


def _nearest(pool: Set[int], who: Mapping[int, object], nodes: Optional[Sequence[int]]) -> List[int]:
    """The ranks of `pool` on the node where most of the ranks `who` are
    (all of `pool` if `nodes` is not known or no rank of it is there)."""
    if nodes is None:
        return sorted(pool)
    count: Dict[int, int] = {}
    for r in who:
        count[nodes[r]] = count.get(nodes[r], 0) + 1
    best = max((count.get(nodes[r], 0) for r in pool), default=0)
    return sorted(r for r in pool if best == 0 or count.get(nodes[r], 0) == best)


def _pool(readers: Optional[Mapping[int, Sequence[int]]], src: int, world: int) -> Set[int]:
    """The ranks that may read source rank `src`'s shard."""
    if readers is None:
        return set(range(world))
    pool = {r for r in readers.get(src, []) if 0 <= r < world}
    if not pool:
        raise ValueError(f"no rank may read rank {src}'s shard")
    return pool


def _phase(batches: List[List[Tuple[Piece, Dict[int, List[Piece]]]]]) -> List[Phase]:
    """Every rank's part of one phase in which each rank reads its
    `batches` (the stripes, with who needs what of them)."""
    world = len(batches)
    to: List[Dict[int, List[Piece]]] = [{} for _ in range(world)]  # by reader, then rank
    for reader, batch in enumerate(batches):
        for _, who in batch:
            for r, ranges in who.items():
                to[reader].setdefault(r, []).extend(ranges)
    outs = [sum(1 for r in parts if r != reader) for reader, parts in enumerate(to)]
    ins = [0] * world
    for reader, parts in enumerate(to):
        for r in parts:
            ins[r] += r != reader
    takes: List[List[Part]] = [[] for _ in range(world)]
    sends: List[List[Part]] = [[] for _ in range(world)]
    for reader, parts in enumerate(to):
        for r, ranges in parts.items():
            if r != reader:
                size = message_size(outs[reader], ins[r])
                sends[reader].append(Part(r, ranges, size))
                takes[r].append(Part(reader, ranges, size))
    return [
        Phase([s for s, _ in batches[rank]], to[rank].get(rank, []), sends[rank], takes[rank]) for rank in range(world)
    ]


def _batches(own: List[Tuple[Piece, Dict[int, List[Piece]]]]) -> List[List[Tuple[Piece, Dict[int, List[Piece]]]]]:
    """A reader's stripes in phases of at most STRIPE bytes (one at least)."""
    out: List[List[Tuple[Piece, Dict[int, List[Piece]]]]] = []
    size = 0
    for stripe in own:
        if not out or size + stripe[0][3] > STRIPE:
            out.append([])
            size = 0
        out[-1].append(stripe)
        size += stripe[0][3]
    return out


def _merged(pieces: Sequence[Piece]) -> Dict[Tuple[int, str], List[Tuple[int, int]]]:
    """The byte ranges `pieces` cover, by (source rank, entry): sorted,
    disjoint, not touching."""
    spans: Dict[Tuple[int, str], List[Tuple[int, int]]] = {}
    for src, entry, start, n in pieces:
        if n > 0:
            spans.setdefault((src, entry), []).append((start, start + n))
    out: Dict[Tuple[int, str], List[Tuple[int, int]]] = {}
    for key, ranges in spans.items():
        merged: List[Tuple[int, int]] = []
        for a, b in sorted(ranges):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        out[key] = merged
    return out


def _stripes(union: Dict[Tuple[int, str], List[Tuple[int, int]]], size: int) -> List[Piece]:
    """The ranges of `union` cut into stripes on multiples of `size` from
    each entry's start, in (source rank, entry, start) order."""
    out: List[Piece] = []
    for (src, entry), ranges in sorted(union.items()):
        for a, b in ranges:
            while a < b:
                end = min(b, (a // size + 1) * size)
                out.append((src, entry, a, end - a))
                a = end
    return out


def _within(ranges: Dict[Tuple[int, str], List[Tuple[int, int]]], stripe: Piece) -> List[Piece]:
    """The parts of `ranges` inside `stripe`, in order."""
    src, entry, start, n = stripe
    end = start + n
    return [
        (src, entry, max(a, start), min(b, end) - max(a, start))
        for a, b in ranges.get((src, entry), [])
        if a < end and b > start
    ]
