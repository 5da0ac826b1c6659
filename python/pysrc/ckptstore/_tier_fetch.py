"""The bytes of a tiered load (`ckptstore.dcp.Tiers.load`), streamed:
each shard is served by its first sound holder in messages of bounded
size, read from the holder's store range by range and landed straight in
the loading rank's targets, so that no rank holds a shard, nor what it
asked for, whole beside the state."""

import warnings
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import numpy as np

from ._errors import Error
from ._tier_wire import Group, TierFailure

WINDOW = 64 << 20
"""Bytes a rank has in flight each way: what it reads for the ranks it
serves, and what lands in its buffers, one message a stream at a time
(shared among its streams)."""

LEAST = 64 << 10
"""A stream's least message size (a rank serving or served by more than
WINDOW / LEAST ranks holds LEAST bytes a stream)."""

# (source rank, entry, first byte, length) of a stored entry.
Piece = Tuple[int, str, int, int]

# Fill each (entry, start, array) with bytes of rank `src`'s shard (of the
# content digest given) from this rank's stores, every chunk hash-checked;
# raises (`Error`, `OSError`, `ValueError`) if no store here holds it sound.
ReadOf = Callable[[int, str, List[Tuple[str, int, np.ndarray]]], None]

# (index of a piece in a stream, offset in the piece, length)
Segment = Tuple[int, int, int]


class ShardsLost(Error):
    """No surviving rank holds some shard of the step being loaded (or
    every holder's copy failed its hash check)."""


def message_size(sender_streams: int, receiver_streams: int) -> int:
    """The size of a stream's messages: WINDOW shared by the streams of
    whichever end has more."""
    return max(LEAST, WINDOW // max(1, sender_streams, receiver_streams))


def cut(lengths: Sequence[int], size: int) -> Iterator[List[Segment]]:
    """The messages of a stream of pieces of `lengths`, one after the
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


class Serving:
    """What this rank reads from its stores in one pass of a fetch, for
    itself and for the ranks it serves: the shards it could not read and
    why, and a failure that stops it (any other exception)."""

    def __init__(self, read_of: ReadOf, digests: Sequence[str]) -> None:
        self._read_of, self._digests = read_of, digests
        self.failed: Dict[int, str] = {}
        self.fatal: Optional[BaseException] = None

    def read(self, src: int, reads: List[Tuple[str, int, np.ndarray]]) -> bool:
        """Fill `reads` from rank `src`'s shard; False if it cannot be."""
        if self.fatal is not None or src in self.failed:
            return False
        try:
            self._read_of(src, self._digests[src], reads)
            return True
        except (Error, OSError, ValueError) as e:
            self.failed[src] = str(e)
        except Exception as e:  # noqa: BLE001 - raised on every rank
            self.fatal = e
        return False


class Serve:
    """The stream of what rank `peer` asked of this rank (`pieces`, in its
    order), read message by message into one buffer."""

    def __init__(self, peer: int, serving: Serving, pieces: List[Piece], size: int) -> None:
        self.peer, self._serving, self._pieces = peer, serving, pieces
        self._messages = cut([p[3] for p in pieces], size)
        self._buffer = np.empty(min(size, sum(p[3] for p in pieces)), dtype=np.uint8)

    def next(self) -> Optional[Tuple[np.ndarray, bool]]:
        segments = next(self._messages, None)
        if segments is None:
            self._buffer = np.empty(0, dtype=np.uint8)
            return None
        data = self._buffer[: sum(n for _, _, n in segments)]
        by_src: Dict[int, List[Tuple[str, int, np.ndarray]]] = {}
        at = 0
        for i, offset, n in segments:
            src, entry, start, _ = self._pieces[i]
            by_src.setdefault(src, []).append((entry, start + offset, data[at : at + n]))
            at += n
        sound = [self._serving.read(src, reads) for src, reads in by_src.items()]
        return data, all(sound)


class Take:
    """The stream of what this rank asked of rank `peer` (its pieces
    `asked`, in order): a message that lies within one piece with a
    target (`dest`) lands there; any other lands in the stream's buffer
    and is copied on. A piece whose bytes all landed sound is delivered;
    a piece of an unsound message is `bad` (asked again), and the holder
    of a damaged message is told to every rank (`refusals`)."""

    def __init__(self, peer: int, asked: List[int], fetch: "Fetch", size: int) -> None:
        self.peer, self._asked, self._fetch = peer, asked, fetch
        lengths = [fetch.pieces[i][3] for i in asked]
        self._messages = cut(lengths, size)
        self._size = min(size, sum(lengths))
        self._segments: List[Segment] = []
        self._got: Dict[int, int] = {}
        self._direct: Optional[np.ndarray] = None
        self._scratch: Optional[np.ndarray] = None

    def next(self) -> Optional[int]:
        segments = next(self._messages, None)
        if segments is None:
            self._scratch = None
            return None
        self._segments = segments
        self._direct = None
        if len(segments) == 1:
            j, offset, n = segments[0]
            dest = self._fetch.dest.get(self._asked[j])
            if dest is not None:
                self._direct = dest[offset : offset + n]
        return sum(n for _, _, n in segments)

    def buffer(self) -> np.ndarray:
        if self._direct is not None:
            return self._direct
        # One buffer for the stream, its bytes copied on as each message lands.
        if self._scratch is None:
            self._scratch = np.empty(self._size, dtype=np.uint8)
        return self._scratch[: sum(n for _, _, n in self._segments)]

    def landed(self, data: np.ndarray, why: Optional[str], unread: bool) -> None:
        fetch = self._fetch
        at = 0
        for j, offset, n in self._segments:
            i = self._asked[j]
            if why is not None:
                fetch.spoil(i)
                if not unread:
                    fetch.refusals.append((self.peer, fetch.pieces[i][0], why))
            elif i not in fetch.bad:
                if self._direct is None:
                    fetch.place(i)[offset : offset + n] = data[at : at + n]
                self._got[i] = self._got.get(i, 0) + n
                if self._got[i] == fetch.pieces[i][3]:
                    fetch.deliver(i)
            at += n


class Fetch:
    """One rank's part of a fetch: its pieces, where each lands, and what
    became of them."""

    def __init__(
        self, pieces: List[Piece], dest: Dict[int, np.ndarray], deliver: Callable[[int, np.ndarray], None]
    ) -> None:
        self.pieces, self.dest, self._deliver = pieces, dest, deliver
        self.done: Set[int] = set()
        self.bad: Set[int] = set()
        self.refusals: List[Tuple[int, int, str]] = []
        self.failure: Optional[BaseException] = None
        self._held: Dict[int, np.ndarray] = {}

    def place(self, i: int) -> np.ndarray:
        """Where piece `i`'s bytes go: its target, or a buffer of its own
        (held until it is delivered)."""
        dest = self.dest.get(i)
        if dest is None:
            dest = self._held.get(i)
            if dest is None:
                dest = self._held[i] = np.empty(self.pieces[i][3], dtype=np.uint8)
        return dest

    def spoil(self, i: int) -> None:
        self.bad.add(i)
        self._held.pop(i, None)

    def deliver(self, i: int) -> None:
        data = self.place(i)
        self._held.pop(i, None)
        self.done.add(i)
        try:
            self._deliver(i, data)
        except Exception as e:  # noqa: BLE001 - raised on every rank
            self.failure = self.failure or e

    def read_here(self, serving: Serving, local: List[int]) -> None:
        """Read the pieces `local` from this rank's stores: those with a
        target straight into it, the others in batches of about WINDOW
        bytes."""
        direct = [i for i in local if i in self.dest]
        for batch in _batches(direct, self.pieces, None) + _batches(
            [i for i in local if i not in self.dest], self.pieces, WINDOW
        ):
            by_src: Dict[int, List[int]] = {}
            for i in batch:
                by_src.setdefault(self.pieces[i][0], []).append(i)
            for src, idx in by_src.items():
                reads = [(self.pieces[i][1], self.pieces[i][2], self.place(i)) for i in idx]
                ok = serving.read(src, reads)
                for i in idx:
                    self.deliver(i) if ok else self.spoil(i)


def _batches(idx: List[int], pieces: List[Piece], limit: Optional[int]) -> List[List[int]]:
    out: List[List[int]] = []
    size = 0
    for i in idx:
        if not out or (limit is not None and size + pieces[i][3] > limit and size > 0):
            out.append([])
            size = 0
        out[-1].append(i)
        size += pieces[i][3]
    return out


def fetch(
    group: Group,
    holders: Dict[int, List[int]],
    digests: Sequence[str],
    step: int,
    read_of: ReadOf,
    pieces: List[Piece],
    dest: Dict[int, np.ndarray],
    deliver: Callable[[int, np.ndarray], None],
    failure: Optional[BaseException] = None,
) -> None:
    """Hand each of `pieces` (this rank's, of step `step`) to `deliver`
    with its bytes (in its `dest`, where given: a writable array of its
    length in the target's memory), a collective. Each shard is served by
    its first holder that can (`holders`, by source rank); a holder that
    cannot read it sound, or whose bytes arrive damaged, is refused, on
    every rank, and the next one serves what is left. Any other failure
    on any rank (`failure`, this rank's planning; a `MemoryError`; one
    raised by `deliver`) fails the call on every rank."""
    what = f"loading step {step} from the local tier"
    group.check(failure, what)
    mine = Fetch(pieces, dest, deliver)
    for i, p in enumerate(pieces):
        if p[3] == 0:
            mine.deliver(i)
    pending = [i for i, p in enumerate(pieces) if p[3] > 0]
    refused: Set[Tuple[int, int]] = set()  # (holder, source rank), known to every rank
    while True:
        server = {src: next((h for h in holders.get(src, []) if (h, src) not in refused), None) for src in {pieces[i][0] for i in pending}}
        lost = sorted(src for src, h in server.items() if h is None)
        group.check(
            ShardsLost(f"step {step}: no surviving rank holds a sound copy of the shards of ranks {lost}") if lost else None,
            what,
        )
        asked: Dict[int, List[int]] = {}
        for i in pending:
            asked.setdefault(server[pieces[i][0]], []).append(i)  # type: ignore[arg-type]
        local = asked.pop(group.rank, [])
        requests: Dict[int, Tuple[int, List[Piece]]] = group.send_to_some(
            {s: (len(asked), [pieces[i] for i in idx]) for s, idx in asked.items()}
        )
        sizes = {r: message_size(len(requests), n) for r, (n, _) in requests.items()}
        told_sizes: Dict[int, int] = group.send_objects(list(sizes.items()), list(asked))
        serving = Serving(read_of, digests)
        mine.bad, mine.refusals = set(), []
        mine.read_here(serving, local)
        broke = group.stream(
            [Serve(r, serving, reqs, sizes[r]) for r, (_, reqs) in requests.items()],
            [Take(s, idx, mine, told_sizes[s]) for s, idx in asked.items()],
        )
        group.check(serving.fatal or mine.failure or broke, what)
        refusals = list(dict.fromkeys(mine.refusals)) + [(group.rank, src, why) for src, why in serving.failed.items()]
        pending = [i for i in pending if i not in mine.done]
        told = group.gather_if_any(refusals or None)
        if not told:
            break
        _refuse(refused, [r for _, rs in told for r in rs], step, group.rank == 0)
    if pending:
        raise TierFailure(f"{what}: {len(pending)} pieces were never served")


def _refuse(refused: Set[Tuple[int, int]], told: List[Tuple[int, int, str]], step: int, warn: bool) -> None:
    for holder, src, why in told:
        if (holder, src) in refused:
            continue
        refused.add((holder, src))
        if warn:
            warnings.warn(
                f"ckptstore.dcp.Tiers: rank {src}'s shard of step {step} as held by "
                f"rank {holder} is refused ({why}); another holder serves it",
                stacklevel=3,
            )
