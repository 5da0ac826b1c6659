"""The proofs of a striped load (`stripes._run`) whose target proves its bytes
(a bucket, a local store, the tier): the bytes a rank hands another go
with proofs against the target's chunk hashes, and the receiver checks
each range with them against the hashes of the manifest it read itself,
not its sender's word.

A range's bytes lie in one or more chunks (`slices`: a chunk of the
entry, or the packed chunk its shard's small blobs share); its proof is
the proofs of its slices back to back (`_ckptstore.slice_proof_len` says
each one's length from the slice alone, so both ends know it). A stream
carries, before each range's bytes, that range's proof; the receiver
hashes the bytes as they land (`SliceCheck`), holding a few hashes a
slice, and a range whose bytes do not hash to its chunks' hashes is
refused. Where a receiver may hold no manifest of the shard (the tier),
its holder sends the shard's chunk map first (`send_maps`), which the
receiver takes only for the save's content digest."""

from typing import Dict, List, Optional, Sequence, Set, Tuple, TypeVar, Union

import numpy as np

from ..._ckptstore import SliceCheck, slice_proof_len
from .._targets import MapsTravel, Piece, Slice
from .._wire import Group

# (rank that read or sent the bytes, source rank of the shard, why)
Refusal = Tuple[int, int, str]


T = TypeVar("T")


def split(flat: Sequence[T], counts: Sequence[int]) -> List[List[T]]:
    """`flat` cut into runs of `counts`, in order."""
    out: List[List[T]] = []
    at = 0
    for n in counts:
        out.append(list(flat[at : at + n]))
        at += n
    return out


def proof_lens(slices: Sequence[Sequence[Slice]]) -> List[int]:
    """The length of each range's proof, from its slices."""
    return [sum(slice_proof_len(s.len, s.a, s.b) for s in ss) for ss in slices]


def interleave(proofs: Sequence[int], lengths: Sequence[int]) -> List[int]:
    """A proving stream's entries: each range's proof, then its bytes."""
    return [x for pair in zip(proofs, lengths) for x in pair]


class _Open:
    """A slice being checked: its check, and its bytes still to come."""

    __slots__ = ("check", "left")

    def __init__(self, check: SliceCheck, left: int) -> None:
        self.check, self.left = check, left


class Checks:
    """The receiving end's checks of a stream's ranges: `proof` takes a
    range's proof as it arrives, `data` its bytes (after the proof, in
    order); the ranges whose bytes fail are in `failed`."""

    def __init__(self, ranges: Sequence[Piece], slices: Sequence[Sequence[Slice]]) -> None:
        self._ranges, self._slices = list(ranges), list(slices)
        self._lens = proof_lens(slices)
        self._proof: Dict[int, bytearray] = {}
        self._open: Dict[int, List[_Open]] = {}
        self.failed: Set[int] = set()

    def proof(self, r: int, data: np.ndarray) -> None:
        """More of range `r`'s proof."""
        self._proof.setdefault(r, bytearray()).extend(data.tobytes())

    def data(self, r: int, data: np.ndarray) -> None:
        """More of range `r`'s bytes, in order."""
        checks = self._open.get(r)
        if checks is None:
            checks = self._open[r] = self._start(r)
        at = 0
        while at < len(data) and checks:
            first = checks[0]
            take = min(first.left, len(data) - at)
            first.check.update(data[at : at + take])
            at += take
            first.left -= take
            if first.left == 0:
                checks.pop(0)
                if not first.check.finish():
                    self.failed.add(r)
        if at < len(data):
            self.failed.add(r)  # more bytes than its slices: never sound
        if not checks:
            self._open.pop(r, None)

    def _start(self, r: int) -> List[_Open]:
        """Range `r`'s checks, from its proof (whole by now)."""
        proof = np.frombuffer(bytes(self._proof.pop(r, b"")), dtype=np.uint8)
        if len(proof) != self._lens[r]:
            self.failed.add(r)
            return []
        checks: List[_Open] = []
        at = 0
        for s in self._slices[r]:
            size = slice_proof_len(s.len, s.a, s.b)
            checks.append(_Open(SliceCheck(s.hash, s.len, s.a, s.b, proof[at : at + size]), s.b - s.a))
            at += size
        return checks

    def why(self, r: int) -> Optional[str]:
        """Why range `r` is refused, if it is."""
        if r not in self.failed:
            return None
        _, entry, start, n = self._ranges[r]
        return f"bytes {start}..{start + n} of {entry!r} do not hash to the target's chunk hashes"


def send_maps(
    group: Group,
    opened: MapsTravel,
    maps: Dict[int, Union[bytes, str]],
    to: Dict[int, Set[int]],
    takes: Dict[int, Set[int]],
) -> List[Refusal]:
    """Send each peer of `to` the chunk maps of its shards there (by source
    rank, from `maps`) and take from each peer of `takes` those of its
    shards there, point to point and once, as a shard's bytes travel; the
    refusals of maps that were not sent or are not of the save."""
    sends = [(peer, _framed([maps[src] for src in sorted(srcs)])) for peer, srcs in sorted(to.items())]
    got = group.send_bytes(sends, sorted(takes))
    refusals: List[Refusal] = []
    for peer, sent in sorted(got.items()):
        srcs = sorted(takes[peer])
        for src, m in zip(srcs, _unframed(sent, len(srcs))):
            why = opened.learn_map(src, m)
            if why is not None:
                refusals.append((peer, src, f"its chunk map of the shard is refused: {why}"))
    return refusals


def _framed(maps: List[Union[bytes, str]]) -> bytes:
    """Maps (or why there is none) back to back: a kind byte (1: a map,
    0: why not), an 8-byte length, the bytes."""
    out = bytearray()
    for m in maps:
        data = m if isinstance(m, bytes) else m.encode()
        out += bytes([isinstance(m, bytes)]) + len(data).to_bytes(8, "little") + data
    return bytes(out)


def _unframed(sent: bytes, n: int) -> List[Union[bytes, str]]:
    """`n` maps as `_framed` wrote them; what does not parse is why."""
    out: List[Union[bytes, str]] = []
    at = 0
    for _ in range(n):
        kind, size = sent[at : at + 1], int.from_bytes(sent[at + 1 : at + 9], "little")
        data, at = sent[at + 9 : at + 9 + size], at + 9 + size
        if kind not in (b"\0", b"\1") or len(data) != size:
            out.append("the chunk maps sent arrived damaged")
        else:
            out.append(data if kind == b"\1" else data.decode(errors="replace"))
    return out
