"""How the ranks of a tiered job talk (`ckptstore.dcp.Tiers`), over a
gloo group of the tier's own (no shared file system is assumed):
fixed-size entries gathered by every rank (a constant per rank of the
job), objects and bytes sent point to point to the ranks that need them
(bytes in pieces of at most 64 MiB, each array hash-checked by its
receiver against the BLAKE3 its sender sent with it), streams of
messages run in rounds (a load's bytes, `stream`), and a failure flag
reduced over every rank at each step where one may fail. The flag goes
with what the rank is doing (`Group.on`: "save of step 3"), so ranks at
different operations fail together rather than pair them."""

import contextlib
import hashlib
import pickle
from concurrent.futures import Future
from datetime import timedelta

from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from .._errors import CorruptError
from .._ckptstore import hash_arrays

PIECE = 64 << 20
"""Bytes sent in one message."""

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""The timeout of a group of the tier's (`Tiers(timeout=None)`) or of a
striped load's (`StorageReader(timeout=None)`): how long a rank waits at
one of its collectives for a rank that stopped answering (one that fails
tells the others at once). Long enough for the slowest rank's commit of
its shard and copies at disk speed; torch's default for NCCL groups.
gloo's own default, 30 minutes, would hold a job whose rank died for half
an hour."""

HEADER = 33
"""A streamed message's header: 1 if its sender read its bytes, else 0;
then their BLAKE3 (32 zeros in a stream whose receiver checks its bytes
against the target's chunk hashes: `Outgoing.proves`)."""

T = TypeVar("T")


class Outgoing(Protocol):
    """A stream of messages this rank sends to rank `peer`."""

    peer: int
    proves: bool
    """Whether its receiver checks every byte of it against the target's
    chunk hashes (proofs travel in it): no BLAKE3 goes with a message."""

    def next(self) -> Optional[Tuple[np.ndarray, bool]]:
        """The next message (a C-contiguous 1-D uint8 array, not empty),
        and False if its sender could not read its bytes; None after the
        last."""


class Incoming(Protocol):
    """A stream of messages this rank receives from rank `peer`: the same
    messages, of the same sizes, as its sender's `Outgoing`."""

    peer: int
    proves: bool
    """As its sender's `Outgoing.proves`: the message's BLAKE3 is not
    checked, the stream checks its bytes itself."""

    def next(self) -> Optional[int]:
        """The size of the next message; None after the last."""

    def buffer(self) -> np.ndarray:
        """Where the message `next` sized lands: a writable C-contiguous
        1-D uint8 array of its size."""

    def landed(self, data: np.ndarray, why: Optional[str], unread: bool) -> None:
        """The message landed in `data`: sound (`why` None: read by its
        sender and hash-checked here unless the stream `proves`), or not,
        and why; `unread`: its sender could not read it (and says so
        itself)."""


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


def failed_future(e: BaseException) -> "Future[Any]":
    """A future that failed with `e`."""
    fut: "Future[Any]" = Future()
    fut.set_exception(e)
    return fut


def described(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class Group:
    """The tier's ranks: a gloo group over every rank of the job, or this
    process alone (no `torch.distributed`)."""

    def __init__(self, group: Optional[Any], rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.about = ""

    @contextlib.contextmanager
    def on(self, about: str) -> Iterator[None]:
        """Name what this rank's collectives are about within the block
        ("save of step 3"): each failure flag carries it, and ranks that
        are about different things raise on every rank at that flag."""
        before, self.about = self.about, about
        try:
            yield
        finally:
            self.about = before

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's `obj`, by rank (a collective)."""
        if self.group is None:
            return [obj]
        out: List[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_if_any(self, mine: Any) -> List[Tuple[int, Any]]:
        """(rank, object) of every rank whose `mine` is not None, by rank;
        empty if none has one (a collective: one integer per rank, and the
        objects gathered only when some rank has one)."""
        if self.group is None:
            return [] if mine is None else [(0, mine)]
        tag = _tag(self.about)
        flag = torch.tensor([0 if mine is None else 1, tag, -tag], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if int(flag[1]) != -int(flag[2]):
            # Some rank is about another operation: every rank sees the
            # same reduced tags, so every rank raises here.
            raise TierFailure(
                f"the ranks are not at the same operation (rank {self.rank}: {self.about or 'none named'}); "
                "every rank must call the same saves and loads, with the same steps, in the same order"
            )
        if not int(flag[0]):
            return []
        return [(r, t) for r, t in enumerate(self.gather(mine)) if t is not None]

    def failures(self, mine: Optional[BaseException]) -> List[str]:
        """Every rank's failure at this point ("rank R: Type: message"),
        empty if none failed (see `gather_if_any`)."""
        told = self.gather_if_any(None if mine is None else described(mine))
        return [f"rank {r}: {t}" for r, t in told]

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

    def gather_fixed(self, entry: np.ndarray) -> List[np.ndarray]:
        """Every rank's `entry` (a uint8 array of the same size on every
        rank), by rank: the size of a rank's entry times the world, never
        padded to another rank's."""
        if self.group is None:
            return [entry]
        out = [torch.empty(entry.size, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(out, torch.from_numpy(np.ascontiguousarray(entry)), group=self.group)
        return [t.numpy() for t in out]

    def send_objects(self, sends: Sequence[Tuple[int, Any]], sources: Sequence[int]) -> Dict[int, Any]:
        """Send each (rank, object) of `sends` to that rank and receive one
        object from each rank of `sources`, point to point: a rank learns
        only what is sent to it. The ranks' lists must agree."""
        sent = self._send_sized([(dst, pickle.dumps(obj)) for dst, obj in sends], sources, whole=True)
        return {src: pickle.loads(data) for src, data in sent.items()}

    def send_bytes(self, sends: Sequence[Tuple[int, bytes]], sources: Sequence[int]) -> Dict[int, bytes]:
        """`send_objects` for bytes of a shard's (its chunk map): their
        lengths first, then the bytes in pieces as a shard's bytes go. No
        BLAKE3 goes with them: what is sent checks itself."""
        return self._send_sized(sends, sources, whole=False)

    def _send_sized(self, sends: Sequence[Tuple[int, bytes]], sources: Sequence[int], whole: bool) -> Dict[int, bytes]:
        """Send each (rank, bytes) of `sends` and receive bytes from each of
        `sources`: their lengths, then the bytes (in one message each, or
        in `_pieces`)."""
        if self.group is None:
            return {}
        payloads = [(dst, torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())) for dst, data in sends]
        lengths = {src: torch.zeros(1, dtype=torch.int64) for src in sources}
        sizes = [torch.tensor([int(p.numel())], dtype=torch.int64) for _, p in payloads]
        works: List[Any] = [dist.irecv(t, src, group=self.group) for src, t in lengths.items()]
        works += [dist.isend(n, dst, group=self.group) for (dst, _), n in zip(payloads, sizes)]
        for w in works:
            w.wait()
        got = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in lengths.items()}
        if whole:
            works = [dist.irecv(t, src, group=self.group) for src, t in got.items()]
            works += [dist.isend(p, dst, group=self.group) for dst, p in payloads]
        else:
            works = [w for src, t in got.items() for w in self._pieces(t, src, dist.irecv)]
            works += [w for dst, p in payloads for w in self._pieces(p, dst, dist.isend)]
        for w in works:
            w.wait()
        return {src: t.numpy().tobytes() for src, t in got.items()}

    def send_to_some(self, sends: Dict[int, Any]) -> Dict[int, Any]:
        """Send each object of `sends` to its rank and receive those sent
        to this rank, by sender: a rank learns only what is addressed to
        it (a collective: one integer per peer says who sends to whom,
        then the objects go point to point)."""
        if self.group is None:
            return {}
        flags = torch.zeros(self.world, dtype=torch.int32)
        for dst in sends:
            flags[dst] = 1
        told = torch.zeros(self.world, dtype=torch.int32)
        dist.all_to_all_single(told, flags, group=self.group)
        sources = [r for r in range(self.world) if int(told[r])]
        return self.send_objects(list(sends.items()), sources)

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
        rank calls it, with its own lists (a failure flag is reduced over
        every rank; the hashes go with the bytes); the lists of two ranks
        must agree (what one sends, the other receives, in the same
        order). `failure`: this rank could not make
        its lists; it is raised on every rank before a byte is sent, as is
        a failure to prepare the bytes to send."""

        def prepare() -> Tuple[List[Tuple[int, List[np.ndarray]]], Dict[int, Any]]:
            if failure is not None:
                raise failure
            ready = [(dst, [_contiguous(a) for a in arrays]) for dst, arrays in sends]
            return ready, {dst: hash_arrays(list(arrays)) for dst, arrays in ready}

        prepared, failed = attempt(prepare)
        # A rank that could not prepare its part: nothing is sent, and
        # every rank raises here.
        self.check(failed, "sending bytes between ranks")
        assert prepared is not None
        ready, digests = prepared
        got = dict(receives)
        told = self.send_objects([(dst, digests[dst]) for dst, _ in ready], list(got))
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
            if hash_arrays(list(arrays)) != told.get(src):
                raise CorruptError(f"bytes sent by rank {src} to rank {self.rank} arrived damaged (BLAKE3 differs)")
        return got

    def stream(self, outgoing: Sequence[Outgoing], incoming: Sequence[Incoming]) -> Optional[BaseException]:
        """Run streams of messages to and from other ranks, in rounds: in
        its n-th round a rank sends the n-th message of each outgoing
        stream and receives the n-th of each incoming one, then waits for
        them all. A stream's two ends agree on its messages, so each
        round's receives meet their sends and no rank waits on one that
        waits on it; a rank holds one message a stream in flight. Each
        message goes with a header (its sender's verdict, its BLAKE3),
        checked where it lands. The first exception of this rank's
        streams' callbacks is returned once every stream is done (never
        raised midway: the peers would wait for the rest)."""
        sends, receives = list(outgoing), list(incoming)
        failure: Optional[BaseException] = None
        while sends or receives:
            works: List[Any] = []
            landing: List[Any] = []
            keep: List[torch.Tensor] = []  # the headers, alive until sent
            receives = [r for r in receives if self._post_receive(r, works, landing)]
            for s in list(sends):
                message = s.next()
                if message is None:
                    sends.remove(s)
                    continue
                data, sound = message
                keep.append(_header(data, sound, s.proves))
                works.append(dist.isend(keep[-1], s.peer, group=self.group))
                works.extend(self._pieces(torch.from_numpy(data), s.peer, dist.isend))
            for w in works:
                w.wait()
            failure = failure or self._land(landing)
        return failure

    def _land(self, landing: List[Any]) -> Optional[BaseException]:
        """Hand each message of a round to its stream; the first failure
        (no buffer outlives the round here)."""
        failure: Optional[BaseException] = None
        for r, header, data, lost in landing:
            try:
                if lost is not None:
                    raise lost
                r.landed(data, *_verdict(header, data, r.peer, self.rank, r.proves))
            except Exception as e:  # noqa: BLE001 - returned once the streams are done
                failure = failure or e
        landing.clear()
        return failure

    def _post_receive(self, r: Incoming, works: List[Any], landing: List[Any]) -> bool:
        """Post the receive of `r`'s next message; False after its last.
        A message with nowhere to land is taken all the same (into a
        buffer of its own), and its failure kept."""
        size = r.next()
        if size is None:
            return False
        data, lost = attempt(r.buffer)
        if data is None:
            data = np.empty(size, dtype=np.uint8)
        header = torch.empty(HEADER, dtype=torch.uint8)
        works.append(dist.irecv(header, r.peer, group=self.group))
        works.extend(self._pieces(torch.from_numpy(data), r.peer, dist.irecv))
        landing.append((r, header, data, lost))
        return True

    def _pieces(self, t: torch.Tensor, peer: int, op: Any) -> List[Any]:
        return [op(t[at : at + PIECE], peer, group=self.group) for at in range(0, int(t.numel()), PIECE)]


def _tag(about: str) -> int:
    """`about` as a non-negative 62-bit number (0 for nothing named)."""
    if not about:
        return 0
    return int.from_bytes(hashlib.blake2b(about.encode(), digest_size=8).digest(), "little") >> 2


def _contiguous(a: np.ndarray) -> np.ndarray:
    """`a`'s bytes as a 1-D array torch can send: itself, or a copy if it
    is not C-contiguous or not writable."""
    flat = a.reshape(-1).view(np.uint8)
    if flat.flags.c_contiguous and flat.flags.writeable:
        return flat
    return np.array(flat, dtype=np.uint8, copy=True)


def _header(data: np.ndarray, sound: bool, proves: bool) -> torch.Tensor:
    """A message's header: 1 if its sender read it, then its BLAKE3 (zeros
    where the stream `proves`: its receiver checks the bytes otherwise)."""
    digest = bytes(32) if proves else bytes.fromhex(hash_arrays([data])[0])
    return torch.frombuffer(bytearray(bytes([1 if sound else 0]) + digest), dtype=torch.uint8)


def _verdict(
    header: torch.Tensor, data: np.ndarray, sender: int, receiver: int, proves: bool
) -> Tuple[Optional[str], bool]:
    """Why a streamed message that landed in `data` is unusable (None if it
    is sound, as far as its header tells), and whether its sender could
    not read it."""
    raw = header.numpy().tobytes()
    if raw[0] != 1:
        return f"rank {sender} could not read them", True
    if not proves and bytes.fromhex(hash_arrays([data])[0]) != raw[1:]:
        return f"bytes sent by rank {sender} to rank {receiver} arrived damaged (BLAKE3 differs)", False
    return None, False
