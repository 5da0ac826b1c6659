"""Striped loads (`ckptstore.dcp.StorageReader(..., fan_out=True)`): each
byte a load needs is read from the target once, by one rank, and handed
to every other rank that needs it.

The coordinator, which sees every rank's reads, cuts the union of the
byte ranges the ranks need into stripes (`stripes._plan`: at most STRIPE
bytes, cut on chunk boundaries so that no chunk is fetched by two
readers) and gives
each stripe to one reader: a rank that needs it (the last stripe's reader
within its share, else the least loaded), unless that would load it past
its share and a stripe, when the least loaded rank reads it. A rank reads
its stripes in phases of at most STRIPE bytes (in one call, so that
neighbouring entries are fetched together); in each phase every reader
sends each rank what it needs of its stripes, point to point over the
load's own group, in messages sized as the tier's streams are (WINDOW
shared among the streams of whichever end has more); the reader's reads
are checked against the target's chunk hashes as they are read, and
where the target proves its bytes (every target now), each range goes
with its proof and its receiver checks it against the chunk hashes of
the manifest it read itself (`stripes._proofs`; on the tier, the shard's chunk
map its holder sent before the phases, taken for the content digest in
the save's record); else each message's BLAKE3 is checked where it
lands.
A rank holds, beside its targets, its phase's stripes and at most about
WINDOW bytes in transit each way: a message within one of its targets
lands there, any other in its stream's buffer. A failure on any rank (a
read, a damaged message, a delivery) fails the phase on every rank.

The local tier's loads run the same phases: a stripe of a rank's shard is
read only by a rank holding it (`readers`: its own store's, or a copy's),
from that rank's stores: the first holder that needs it, else a holder on
the node where most of the ranks needing it are (`nodes`: a node's ranks
hand bytes to each other without the network). A reader that cannot read
a stripe sound, or whose message arrives damaged, is told to every rank
at the end of the phase (`Refused`, raised on every rank), and the tier
loads again without it (`tiers._load.Load`)."""

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from ._plan import FanPlan, Part, Segment, cut
from ._proofs import Checks, Refusal, interleave, proof_lens, send_maps, split
from .._targets import Deliver, MapsTravel, Opened, Piece, Slice
from .._wire import Group, TierFailure, attempt, described


class Refused(RuntimeError):
    """Bytes of some shards could not be had sound from the ranks that read
    them: each (holder, source rank, why). Raised on every rank at the end
    of a phase, with every rank's refusals."""

    def __init__(self, what: str, refusals: Optional[List[Refusal]] = None) -> None:
        refusals = list(refusals or [])
        super().__init__(what, refusals)  # pickled by its arguments (DCP sends it)
        self.what, self.refusals = what, refusals

    def __str__(self) -> str:
        told = "; ".join(f"rank {src}'s shard as read by rank {holder}: {why}" for holder, src, why in self.refusals)
        return f"{self.what}: {told}" if told else self.what


class _Landing:
    """Where the bytes of ranges land in this rank's pieces: each range is
    copied into every piece it overlaps (its target, or a buffer held until
    delivered), and a piece whose bytes have all landed is delivered (a
    failure to deliver is kept, to be raised on every rank)."""

    def __init__(self, pieces: List[Piece], dest: Dict[int, np.ndarray], deliver: Deliver) -> None:
        self.pieces, self.dest, self._deliver = pieces, dest, deliver
        self.done: Set[int] = set()
        self.failure: Optional[BaseException] = None
        self._held: Dict[int, np.ndarray] = {}
        self._by_entry: Dict[Tuple[int, str], List[int]] = {}
        self._got: Dict[int, int] = {}
        for i, (src, entry, _, n) in enumerate(pieces):
            if n == 0:
                self._hand(i)
            else:
                self._by_entry.setdefault((src, entry), []).append(i)

    def direct(self, ranges: List[Piece]) -> Optional[np.ndarray]:
        """The target memory one range lands in whole, where it lies within
        exactly one piece that has a target."""
        if len(ranges) != 1:
            return None
        src, entry, a, n = ranges[0]
        over = [i for i in self._by_entry.get((src, entry), []) if _overlap(self.pieces[i], a, n)]
        if len(over) != 1 or over[0] not in self.dest:
            return None
        _, _, start, length = self.pieces[over[0]]
        if a < start or a + n > start + length:
            return None
        return self.dest[over[0]][a - start : a - start + n]

    def land(self, ranges: List[Piece], data: np.ndarray) -> None:
        at = 0
        for src, entry, a, n in ranges:
            for i in self._by_entry.get((src, entry), []):
                _, _, start, length = self.pieces[i]
                x, y = max(a, start), min(a + n, start + length)
                if x >= y:
                    continue
                into = self._place(i)[x - start : y - start]
                source = data[at + x - a : at + y - a]
                if into.ctypes.data != source.ctypes.data:
                    into[:] = source
                self._got[i] = self._got.get(i, 0) + (y - x)
                if self._got[i] == length:
                    self._hand(i)
            at += n

    def _place(self, i: int) -> np.ndarray:
        """Where piece `i`'s bytes go: its target, or a buffer of its own
        (held until it is delivered)."""
        dest = self.dest.get(i)
        if dest is None:
            dest = self._held.get(i)
            if dest is None:
                dest = self._held[i] = np.empty(self.pieces[i][3], dtype=np.uint8)
        return dest

    def _hand(self, i: int) -> None:
        data = self._place(i)
        self._held.pop(i, None)
        self.done.add(i)
        try:
            self._deliver(i, data)
        except Exception as e:  # noqa: BLE001 - raised on every rank
            self.failure = self.failure or e


def _overlap(piece: Piece, a: int, n: int) -> bool:
    return piece[2] < a + n and a < piece[2] + piece[3]


class _Read:
    """A phase's stripes, read into one buffer in one call; a range of them
    as a view."""

    def __init__(self, opened: Opened, stripes: List[Piece], proved: Optional[List[Piece]]) -> None:
        self.data = np.empty(sum(s[3] for s in stripes), dtype=np.uint8)
        self._at: Dict[Tuple[int, str], List[Tuple[int, int, int]]] = {}
        dest: Dict[int, np.ndarray] = {}
        off = 0
        for k, (src, entry, start, n) in enumerate(stripes):
            self._at.setdefault((src, entry), []).append((start, start + n, off))
            dest[k] = self.data[off : off + n]
            off += n
        self.proofs: List[bytes] = []
        if proved is None:
            opened.read(stripes, dest, lambda i, d: None, None)
        else:
            self.proofs = opened.read_proving(stripes, dest, proved)

    def view(self, piece: Piece) -> np.ndarray:
        src, entry, a, n = piece
        start, _, off = next(s for s in self._at[(src, entry)] if s[0] <= a < s[1])
        return self.data[off + a - start : off + a - start + n]

    def message(self, ranges: List[Piece]) -> np.ndarray:
        views = [self.view(r) for r in ranges]
        return views[0] if len(views) == 1 else np.concatenate(views)


def _sub(ranges: List[Piece], segments: List[Segment]) -> List[Piece]:
    """The parts of `ranges` a message's `segments` carry."""
    return [(ranges[i][0], ranges[i][1], ranges[i][2] + at, n) for i, at, n in segments]


class _Send:
    """The messages of a phase to one peer: its ranges of the stripes, cut
    at its part's size (None: the read failed, and the peer learns it,
    unsound); where the target proves its bytes, each range's proof
    (`proofs`, of its `slices`) goes before it."""

    def __init__(
        self,
        part: Part,
        read: Optional[_Read],
        slices: Optional[List[List[Slice]]] = None,
        proofs: Sequence[bytes] = (),
    ) -> None:
        self.peer, self._read, self._ranges = part.peer, read, part.ranges
        self.proves = slices is not None
        lengths = [r[3] for r in part.ranges]
        # Writable copies (torch sends no read-only array without a warning).
        self._proofs = [np.frombuffer(bytearray(p), dtype=np.uint8) for p in proofs] if slices is not None else None
        if slices is not None:
            lengths = interleave(proof_lens(slices), lengths)
        self._messages = cut(lengths, part.size)

    def next(self) -> Optional[Tuple[np.ndarray, bool]]:
        segments = next(self._messages, None)
        if segments is None:
            return None
        if self._read is None:
            return np.zeros(sum(n for _, _, n in segments), dtype=np.uint8), False
        if self._proofs is None:
            return self._read.message(_sub(self._ranges, segments)), True
        parts = [
            self._proofs[i // 2][at : at + n]
            if i % 2 == 0
            else self._read.view(_sub(self._ranges, [(i // 2, at, n)])[0])
            for i, at, n in segments
        ]
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), True


class _Take:
    """The messages of a phase from one peer, cut as its sender cuts them:
    a message that lies within one of this rank's targets lands there, any
    other in the stream's one buffer (of at most the part's size), copied
    on as it lands."""

    def __init__(
        self, part: Part, landing: _Landing, refusals: List[Refusal], slices: Optional[List[List[Slice]]] = None
    ) -> None:
        self.peer, self._ranges, self._landing = part.peer, part.ranges, landing
        self._refusals = refusals
        self.proves = slices is not None
        lengths = [r[3] for r in part.ranges]
        self._checks = None if slices is None else Checks(part.ranges, slices)
        if slices is not None:
            lengths = interleave(proof_lens(slices), lengths)
        self._messages = cut(lengths, part.size)
        self._most = min(part.size, sum(lengths))
        self._scratch: Optional[np.ndarray] = None
        self._segments: List[Segment] = []
        self._carried: List[Piece] = []
        self._size = 0
        self._direct: Optional[np.ndarray] = None

    def next(self) -> Optional[int]:
        segments = next(self._messages, None)
        if segments is None:
            self._scratch = None
            self._refuse_failed()
            return None
        self._segments = segments
        self._size = sum(n for _, _, n in segments)
        if self._checks is None:
            self._carried = _sub(self._ranges, segments)
            self._direct = self._landing.direct(self._carried)
        else:
            # A message with a proof in it lands in the buffer.
            data = [(i // 2, at, n) for i, at, n in segments if i % 2 == 1]
            self._carried = _sub(self._ranges, data)
            self._direct = self._landing.direct(self._carried) if len(data) == len(segments) else None
        return self._size

    def buffer(self) -> np.ndarray:
        if self._direct is not None:
            return self._direct
        if self._scratch is None:
            self._scratch = np.empty(self._most, dtype=np.uint8)
        return self._scratch[: self._size]

    def landed(self, data: np.ndarray, why: Optional[str], unread: bool) -> None:
        # A message its sender could not read: the sender tells why.
        if why is None and self._checks is None:
            self._landing.land(self._carried, data)
        elif why is None:
            self._check(data)
        elif not unread:
            for src in dict.fromkeys(r[0] for r in self._carried):
                self._refusals.append((self.peer, src, why))

    def _check(self, data: np.ndarray) -> None:
        """Land a proving stream's message: proofs to the checks, bytes
        where they go and to the checks."""
        assert self._checks is not None
        at = 0
        for i, start, n in self._segments:
            part = data[at : at + n]
            if i % 2 == 0:
                self._checks.proof(i // 2, part)
            else:
                self._landing.land(_sub(self._ranges, [(i // 2, start, n)]), part)
                self._checks.data(i // 2, part)
            at += n

    def _refuse_failed(self) -> None:
        """Refuse, once the stream is done, each range that failed its
        check (as a damaged message is)."""
        if self._checks is None:
            return
        for r in sorted(self._checks.failed):
            why = self._checks.why(r)
            if why is not None:
                self._refusals.append((self.peer, self._ranges[r][0], why))


def run(
    group: Group,
    opened: Opened,
    fan: FanPlan,
    pieces: Sequence[Piece],
    dest: Dict[int, np.ndarray],
    deliver: Deliver,
    failure: Optional[BaseException],
    what: str,
) -> None:
    """Hand each of `pieces` (this rank's) to `deliver` with its bytes (in
    its `dest`, where given), reading from `opened` only the stripes `fan`
    gives this rank: a collective of every rank of `group`. Any rank's
    failure (`failure`, its planning) fails the call on every rank; bytes
    a reader could not read sound (`opened` raised `Refused`) or that
    arrived damaged raise `Refused` on every rank, with every rank's."""
    slices: Dict[int, List[List[Slice]]] = {}  # by the id of a part
    if isinstance(opened, MapsTravel):
        _send_maps(group, opened, fan, failure, what)
    if opened.proves and failure is None:
        try:
            parts = [part for phase in fan.phases for part in phase.sends + phase.takes]
            every = opened.slices([r for part in parts for r in part.ranges])
            slices = dict(zip(map(id, parts), split(every, [len(p.ranges) for p in parts])))
        except Exception as e:  # noqa: BLE001 - raised on every rank
            failure = e
    group.check(failure, what)
    landing = _Landing(list(pieces), dest, deliver)
    for phase in fan.phases:
        read: Optional[_Read] = None
        error: Optional[BaseException] = None
        refusals: List[Refusal] = []
        proved = [r for part in phase.sends for r in part.ranges] if opened.proves else None
        if phase.reads:
            try:
                read = _Read(opened, phase.reads, proved)
                for kept in phase.keep:
                    landing.land([kept], read.view(kept))
            except Refused as e:
                read, refusals = None, list(e.refusals)
            except Exception as e:  # noqa: BLE001 - raised on every rank
                read, error = None, e
        proofs = split(read.proofs, [len(p.ranges) for p in phase.sends]) if read and read.proofs else []
        sends = [
            _Send(part, read, slices.get(id(part)), proofs[k] if proofs else [])
            for k, part in enumerate(phase.sends)
        ]
        takes = [_Take(part, landing, refusals, slices.get(id(part))) for part in phase.takes]
        broke = group.stream(sends, takes)
        _settle(group, error or landing.failure or broke, refusals, what)
    missing = len(landing.pieces) - len(landing.done)
    group.check(RuntimeError(f"{missing} pieces of this rank were in no stripe") if missing else None, what)


def _send_maps(
    group: Group, opened: MapsTravel, fan: FanPlan, failure: Optional[BaseException], what: str
) -> None:
    """Send each rank this one hands bytes to the chunk map of each shard
    whose bytes it hands it, and take those sent to this rank, before the
    phases (`stripes._proofs.send_maps`). Any rank's failure (`failure`, reading
    its maps, taking them) is raised on every rank before or after the
    point-to-point sends, never between; maps refused raise `Refused`."""
    to: Dict[int, Set[int]] = {}
    takes: Dict[int, Set[int]] = {}
    for phase in fan.phases:
        for part in phase.sends:
            to.setdefault(part.peer, set()).update(r[0] for r in part.ranges)
        for part in phase.takes:
            takes.setdefault(part.peer, set()).update(r[0] for r in part.ranges)
    srcs = sorted(set().union(*to.values()))
    maps, failed = attempt(lambda: {src: opened.chunk_map(src) for src in srcs})
    group.check(failure or failed, what)
    assert maps is not None
    refusals, failed = attempt(lambda: send_maps(group, opened, maps, to, takes))
    _settle(group, failed, refusals or [], what)


def _settle(group: Group, failure: Optional[BaseException], refusals: List[Refusal], what: str) -> None:
    """The end of a phase, on every rank (one collective): any rank's
    failure raised (this rank's own where it failed, else a `TierFailure`
    naming every rank's), else every rank's refusals (`Refused`)."""
    mine = None if failure is None and not refusals else (None if failure is None else described(failure), refusals)
    told = group.gather_if_any(mine)
    failed = [f"rank {r}: {f}" for r, (f, _) in told if f is not None]
    if failure is not None:
        raise failure
    if failed:
        raise TierFailure(f"{what}: " + "; ".join(failed))
    if told:
        raise Refused(what, list(dict.fromkeys(x for _, (_, rs) in told for x in rs)))
