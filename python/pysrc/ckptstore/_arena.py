"""Staging of device tensors (a GPU's state) into host memory allocated
once and reused by the next save of the same layout: an `Arena`, pinned
once where the device is CUDA, carved by source storage (views that share
a storage share the copy). The copies run on a side stream after the
work that made the values (an event recorded on the caller's stream),
in pieces, and each piece is hashed by chunks once it has landed while
the next are in flight: the staged copy's chunk hashes are ready with it.

Device-neutral apart from `_Cuda` (pinning, streams, events): a CPU
source runs the same carving, copies and hashing with copies that are
done when issued (the tests' way in; `ckptstore._staging` copies plain
host tensors itself, on every core, hashed in the same pass)."""

import contextlib
import mmap
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ._ckptstore import ChunkHasher, ChunkHashes

PAGE = mmap.PAGESIZE

PIECE = 16 * ChunkHasher.PIECE_ALIGN
"""Bytes copied between two events, and hashed at a time."""

DEVICES = ("cuda",)
"""The device types whose tensors are staged through an arena."""


class StagingBudgetError(MemoryError):
    """Staging a state would take more host memory than its budget (or
    than the host has available): nothing was allocated."""


# A tensor's place in its storage's copy: (its storage's index, byte
# offset of its first element from the start of the copied span).
_Place = Tuple[int, int]


@dataclass(frozen=True)
class Layout:
    """Where the device tensors of a state go in an arena: each source
    storage's span (the bytes from the first to the last element of its
    tensors) at a page boundary, in the order first met; each tensor by
    its storage and offset. Equal layouts share an arena."""

    spans: Tuple[Tuple[int, int], ...]  # per storage: (first byte, bytes)
    offsets: Tuple[int, ...]  # per storage: where its span lies in the arena
    tensors: Tuple[Tuple[_Place, torch.dtype, Tuple[int, ...], Tuple[int, ...]], ...]
    nbytes: int

    @staticmethod
    def of(sources: Sequence[torch.Tensor]) -> "Layout":
        index: Dict[Tuple[str, int], int] = {}
        bounds: List[List[int]] = []
        starts: List[Tuple[int, int]] = []
        for t in sources:
            key = (str(t.device), t.untyped_storage().data_ptr())
            first, end = _extent(t)
            i = index.setdefault(key, len(bounds))
            if i == len(bounds):
                bounds.append([first, end])
            bounds[i] = [min(bounds[i][0], first), max(bounds[i][1], end)]
            starts.append((i, first))
        # Spans start on 16 bytes (the widest element) so that every
        # tensor's offset in the arena is a multiple of its element size.
        spans = tuple((lo - lo % 16, hi - (lo - lo % 16)) for lo, hi in bounds)
        offsets, at = [], 0
        for _, n in spans:
            offsets.append(at)
            at += -(-n // PAGE) * PAGE
        tensors = tuple(
            ((i, first - spans[i][0]), t.dtype, tuple(t.shape), tuple(t.stride()))
            for (i, first), t in zip(starts, sources)
        )
        return Layout(spans, tuple(offsets), tensors, at)


def _extent(t: torch.Tensor) -> Tuple[int, int]:
    """The bytes of `t`'s storage from its first element to past its last."""
    first = int(t.storage_offset()) * t.element_size()
    return first, first + _span_bytes([int(n) for n in t.shape], [int(s) for s in t.stride()], t.element_size())


def available_bytes() -> Optional[int]:
    """The host memory available to new allocations (Linux's
    `MemAvailable`), if known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Arena:
    """Host memory for one layout: page-aligned, in shared memory if asked
    (a writer in another process reads it), pinned once where the sources
    are CUDA tensors (unpinned when the arena is collected)."""

    def __init__(self, layout: Layout, device: torch.device, shared: bool, budget: Optional[int]) -> None:
        _check_budget(layout.nbytes, budget)
        self.layout, self.device, self.shared = layout, device, shared
        self.memory = _page_aligned(layout.nbytes, shared)
        self.pinned = False
        if device.type == "cuda" and layout.nbytes:
            self.pinned = _Cuda.pin(self.memory)
            if self.pinned:
                weakref.finalize(self, _Cuda.unpin, self.memory)

    def carve(self) -> List[torch.Tensor]:
        """A host tensor per source tensor of the layout, in the arena."""
        out = []
        for (i, at), dtype, shape, stride in self.layout.tensors:
            start = self.layout.offsets[i] + at
            n = _span_bytes(shape, stride, torch.empty(0, dtype=dtype).element_size())
            base = self.memory[start : start + n].view(dtype)
            out.append(base.as_strided(shape, stride, base.storage_offset()))
        return out


def _span_bytes(shape: Sequence[int], stride: Sequence[int], size: int) -> int:
    """The bytes from a tensor's first element to past its last."""
    if any(n == 0 for n in shape):
        return 0
    return (sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * size


def within_budget(nbytes: int, budget: Optional[int]) -> None:
    """Refuse `nbytes` of staging over `budget` (an arena reused is
    checked too: the budget may have shrunk since it was made)."""
    if budget is not None and nbytes > budget:
        raise StagingBudgetError(
            f"staging the state's device tensors takes {nbytes} bytes of host memory, over the budget of {budget}"
        )


def _check_budget(nbytes: int, budget: Optional[int]) -> None:
    available = available_bytes()
    within_budget(nbytes, budget)
    if available is not None and nbytes > available:
        raise StagingBudgetError(
            f"staging the state's device tensors takes {nbytes} bytes of host memory; the host has {available} "
            "available (save synchronously, or with fewer bytes a rank)"
        )


def _page_aligned(nbytes: int, shared: bool) -> torch.Tensor:
    """`nbytes` of host memory (uint8) starting on a page."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if shared:
        memory = torch.empty(nbytes, dtype=torch.uint8)
        memory.share_memory_()  # type: ignore[no-untyped-call]  # mapped: on a page
        return memory
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]


class Copy:
    """The copies of one stage into an arena, issued in arena order, and
    the hashes of its hashable tensors, taken piece by piece as the copies
    land: `finish()` waits for them (in the staging thread)."""

    def __init__(self, arena: Arena, sources: Sequence[torch.Tensor], staged: List[torch.Tensor], hashed: Sequence[bool]) -> None:
        self._landed: "deque[Tuple[int, Optional[Any]]]" = deque()  # (arena end, event)
        self._done = 0  # the copies have landed up to here
        self._keep = list(sources)  # the sources live until their copies land
        stream = _Cuda.side_stream(arena.device) if arena.device.type == "cuda" else None
        copies = self._copies(arena, sources)
        with _Cuda.on(stream):
            for dst, src, end in copies:
                dst.copy_(src, non_blocking=stream is not None)
                self._landed.append((end, _Cuda.event(stream)))
        self._hashed = [(t, arena.layout.offsets[p[0]] + p[1]) for t, (p, *_), h in zip(staged, arena.layout.tensors, hashed) if h]

    def _copies(self, arena: Arena, sources: Sequence[torch.Tensor]) -> List[Tuple[torch.Tensor, torch.Tensor, int]]:
        """(destination, source, arena end) for each piece of each span."""
        seen: Dict[int, torch.Tensor] = {}
        for (p, *_), t in zip(arena.layout.tensors, sources):
            seen.setdefault(p[0], t)
        out = []
        for i, t in sorted(seen.items()):
            lo, n = arena.layout.spans[i]
            src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), 0, (lo + n,), (1,))
            at = arena.layout.offsets[i]
            for a in range(0, n, PIECE):
                b = min(n, a + PIECE)
                out.append((arena.memory[at + a : at + b], src[lo + a : lo + b], at + b))
        return out

    def finish(self) -> Dict[int, Tuple[torch.Tensor, ChunkHashes]]:
        """Wait for the copies; the hashes of the hashable staged tensors
        (data pointer -> (tensor, hashes)), each piece hashed once landed."""
        out: Dict[int, Tuple[torch.Tensor, ChunkHashes]] = {}
        for t, start in self._hashed:
            data = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            hasher = ChunkHasher(data.numel())
            for a in range(0, data.numel(), PIECE):
                b = min(data.numel(), a + PIECE)
                self._wait(start + b)
                hasher.update(data[a:b].numpy())
            out.setdefault(t.data_ptr(), (t, hasher.finish()))
        self._wait(None)
        self._keep = []
        return out

    def _wait(self, end: Optional[int]) -> None:
        """Until the copies up to arena position `end` (all: None) landed."""
        while self._landed and (end is None or self._done < end):
            self._done, event = self._landed.popleft()
            if event is not None:
                event.synchronize()  # a stream's copies land in order


class _Cuda:
    """The CUDA-specific lines: pinning, the side stream, events."""

    _streams: Dict[torch.device, Any] = {}

    @staticmethod
    def pin(memory: torch.Tensor) -> bool:
        code = torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel(), 1)  # type: ignore[no-untyped-call]
        return int(code) == 0

    @staticmethod
    def unpin(memory: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())  # type: ignore[no-untyped-call]

    @staticmethod
    def side_stream(device: torch.device) -> Any:
        """The device's staging stream (made once, on the first stage's
        thread), waiting for the work the caller's stream has queued."""
        stream = _Cuda._streams.get(device)
        if stream is None:
            stream = _Cuda._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    @staticmethod
    def on(stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    @staticmethod
    def event(stream: Any) -> Any:
        if stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

