"""Staging for async saves: a copy of a state that later changes to the
state leave alone, made into the memory of an earlier copy when one is
free (no new memory for a state of the same layout), with the hashes of
its chunks taken in the same pass (the save then writes the copy without
reading it again). A device's tensors (a GPU's) go into an arena of
pinned host memory kept for the next save (`_arena`), copied on a side
stream and hashed piece by piece as the copies land. Used by
`ckptstore.dcp.StorageWriter` (DCP's `AsyncStager`),
`ckptstore.dcp.Tiers.async_save` and the Lightning and Trainer adapters'
asynchronous saves."""

import copy
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import numpy as np
import torch

from . import _arena
from ._arena import Arena, Layout
from ._ckptstore import ChunkHashes, copy_hashed


# Staged tensors' hashes: data pointer -> (tensor, its chunks' hashes).
Hashes = Dict[int, Tuple[torch.Tensor, ChunkHashes]]


@dataclass
class Staged:
    """A staged copy of a state and what its tensors' chunks hash to."""

    state: Any
    # The staged tensors whose bytes `copy_hashed` copied, with their
    # hashes: data pointer -> (tensor, hashes). The tensors are kept with
    # the hashes so that a writer sent to another process with the state
    # (DCP's process mode pickles both in one message) still names the
    # same tensors there.
    hashes: Hashes = field(default_factory=dict)

    def hashes_of(self, t: torch.Tensor) -> Optional[ChunkHashes]:
        """The hashes of `t`'s bytes, if `t` is (a view of all of) a
        staged tensor's memory."""
        return hashes_of(self.hashes, t)


def hashes_of(known: Hashes, t: torch.Tensor) -> Optional[ChunkHashes]:
    """The hashes of `t`'s bytes from `known` (as `Staged.hashes`), if `t`
    covers exactly the memory of a staged tensor."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    hit = known.get(t.data_ptr())
    if hit is None:
        return None
    staged, hashes = hit
    nbytes = t.numel() * t.element_size()
    return hashes if nbytes == staged.numel() * staged.element_size() == hashes.nbytes else None


class Pool:
    """Staged copies kept for reuse, one per key (with the arena of its
    device tensors); a copy is lent to one save at a time and given back
    when that save is done with it."""

    def __init__(self) -> None:
        self._free: Dict[Hashable, Tuple[Any, Optional[Arena]]] = {}
        self._arenas: Dict[int, Arena] = {}  # of lent copies, by id
        self._lock = threading.Lock()

    def stage(self, key: Hashable, state: Any, shared: bool = False, budget: Optional[int] = None) -> Staged:
        """A staged copy of `state`, into the free copy of `key` if any;
        new memory in shared memory if `shared`; a device's tensors within
        `budget` bytes of host memory (and what the host has available)."""
        return self.begin(key, state, shared, budget).finish()

    def begin(self, key: Hashable, state: Any, shared: bool = False, budget: Optional[int] = None) -> "Pending":
        """`stage` begun: where `state` has a device's tensors, their
        copies are queued now, on the caller's thread (after the work its
        streams have queued); `finish()` (any thread) does the rest and
        waits (a state of host tensors only is staged by `finish()`
        whole). A failure of `finish()` gives the copy back."""

        def now() -> Begun:
            with self._lock:
                old, arena = self._free.pop(key, (None, None))
            try:
                out = begin(state, old, shared, arena, budget)
            except BaseException:
                if old is not None:  # still free for a later save
                    with self._lock:
                        self._free.setdefault(key, (old, arena))
                raise
            if out.arena is not None:
                with self._lock:
                    self._arenas[id(out.state)] = out.arena
            return out

        def done(begun: Begun) -> Staged:
            try:
                return begun.finish()
            except BaseException:
                self.give_back(key, begun.state)
                raise

        if has_device_tensors(state):
            begun = now()
            return Pending(lambda: done(begun))
        return Pending(lambda: done(now()))

    def give_back(self, key: Hashable, copied: Any) -> None:
        with self._lock:
            self._free[key] = (copied, self._arenas.pop(id(copied), None))

    def clear(self, key: Hashable) -> None:
        with self._lock:
            self._free.pop(key, None)

    def in_background(
        self, key: Hashable, state: Any, thread: ThreadPoolExecutor, staged: Callable[[float], None]
    ) -> Tuple["Future[None]", "Future[Staged]"]:
        """`begin` on the caller's thread, `finish` on `thread`: a future
        done when the state may change again (after `staged(t)` is called,
        `t` the `time.perf_counter()` when the caller was free to go), and
        one of the copy. A failure gives the copy back and fails both."""
        pending = self.begin(key, state)
        begun = time.perf_counter()
        done: "Future[None]" = Future()

        def finish() -> Staged:
            try:
                copied = pending.finish()
            except BaseException as e:
                done.set_exception(e)
                raise
            staged(begun)
            done.set_result(None)
            return copied

        return done, thread.submit(finish)


class Pending:
    """A stage begun (`Pool.begin`): `finish()` makes the copy."""

    def __init__(self, finish: Callable[[], Staged]) -> None:
        self.finish = finish


class Begun:
    """A stage begun (`begin`): the copy's structure, its device tensors'
    copies in flight; `finish()` copies and hashes the host tensors and
    waits for the device's, with their hashes."""

    def __init__(self, state: Any, pairs: List[Tuple[torch.Tensor, torch.Tensor]], arena: Optional[Arena], device: Optional[_arena.Copy]) -> None:
        self.state, self.arena = state, arena
        self._pairs, self._device = pairs, device

    def finish(self) -> Staged:
        out = Staged(self.state)
        if self._pairs:
            sources = [_bytes(src) for src, _ in self._pairs]
            copied = copy_hashed(sources, [_bytes(dst) for _, dst in self._pairs])
            for (_, dst), hashes in zip(self._pairs, copied):
                out.hashes[dst.data_ptr()] = (dst, hashes)
        if self._device is not None:
            for ptr, hit in self._device.finish().items():
                out.hashes.setdefault(ptr, hit)
        return out


def staged(value: Any, reuse: Any = None, shared: bool = False) -> Staged:
    """A copy of a state's value that later changes to the state leave
    alone (see `begin`), made now."""
    return begin(value, reuse, shared).finish()


def begin(value: Any, reuse: Any = None, shared: bool = False, arena: Optional[Arena] = None, budget: Optional[int] = None) -> Begun:
    """A copy of a state's value that later changes to the state leave
    alone, begun: tensors copied to host memory (into the tensor at the
    same place of `reuse`, a copy an earlier call made and no save holds
    any more, when its type, dtype, shape and layout match: no new memory;
    else into new memory, shared memory if `shared`), containers rebuilt,
    other values deep-copied (or as they are, if they cannot be). The
    bytes of contiguous host tensors are copied by `copy_hashed` in one
    call, on every core, hashed as they are copied; a device's tensors go
    into `arena` where its layout is theirs, else a new one (within
    `budget`), copied on the device's side stream."""
    sources: List[torch.Tensor] = []
    _devices(value, sources)
    views: "deque[torch.Tensor]" = deque()
    copying = None
    if sources:
        layout = Layout.of(sources)
        if arena is None or arena.layout != layout or arena.shared != shared:
            arena = Arena(layout, sources[0].device, shared, budget)
        else:
            _arena.within_budget(layout.nbytes, budget)
        carved = arena.carve()
        copying = _arena.Copy(arena, sources, carved, [t.is_contiguous() for t in sources])
        views.extend(carved)
    else:
        arena = None
    pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []
    state = _copy(value, reuse, shared, pairs, views)
    return Begun(state, pairs, arena, copying)


def has_device_tensors(value: Any) -> bool:
    """Whether `value` holds a tensor staged through an arena."""
    found: List[torch.Tensor] = []
    _devices(value, found)
    return bool(found)


def _devices(value: Any, out: List[torch.Tensor]) -> None:
    """The local tensors of `value` staged through an arena, in the order
    `_copy` meets them."""
    if isinstance(value, torch.Tensor):
        # The device first: a host tensor (a DTensor's too) is passed over
        # without a dispatch.
        if value.device.type in _arena.DEVICES:
            local = _local(value.detach())
            if _in_arena(local):
                out.append(local)
    elif isinstance(value, dict):
        for v in value.values():
            _devices(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _devices(v, out)


def _in_arena(t: torch.Tensor) -> bool:
    return t.device.type in _arena.DEVICES and _hashable(t)


def _copy(value: Any, reuse: Any, shared: bool, pairs: List[Tuple[torch.Tensor, torch.Tensor]], views: "deque[torch.Tensor]") -> Any:
    """`value` staged (see `begin`), the copies of contiguous host tensors
    left to make: (source, destination) added to `pairs`; a device's
    tensors into `views` (theirs, in order, in the arena)."""
    if isinstance(value, torch.Tensor):
        return _tensor(value.detach(), reuse, shared, pairs, views)
    if isinstance(value, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: _copy(v, old.get(k), shared, pairs, views) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        same = isinstance(reuse, type(value)) and len(reuse) == len(value)
        olds = reuse if same else [None] * len(value)
        items = [_copy(v, o, shared, pairs, views) for v, o in zip(value, olds)]
        return items if isinstance(value, list) else tuple(items)
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is saved as it is
        return value


def _tensor(value: torch.Tensor, reuse: Any, shared: bool, pairs: List[Tuple[torch.Tensor, torch.Tensor]], views: "deque[torch.Tensor]") -> torch.Tensor:
    in_arena = value.device.type in _arena.DEVICES and _in_arena(_local(value))
    if in_arena:
        out = _over(value, views.popleft())  # copied by the arena's `Copy`
    elif _same_layout(value, reuse):
        out = reuse
    else:
        out = _over(value, _new_like(_local(value), shared))
    src, dst = _local(value), _local(out)
    if in_arena:
        pass
    elif src.device.type == "cpu" and src.is_contiguous() and _hashable(src):
        pairs.append((src, dst))
    else:
        dst.copy_(src)  # another device, or strided: torch copies, the save hashes
    copied: torch.Tensor = out
    return copied


def _over(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A host tensor like `value` over `local` (its copy of the local
    tensor, where `value` is a DTensor)."""
    if hasattr(value, "placements"):
        # A DTensor: a new one over a host copy of its local tensor.
        out: torch.Tensor = type(value).from_local(  # type: ignore[attr-defined]
            local, value.device_mesh, value.placements, run_check=False,  # type: ignore[attr-defined]
            shape=value.shape, stride=value.stride(),
        )
        return out
    return local


def _new_like(t: torch.Tensor, shared: bool) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    if shared:
        out.share_memory_()  # type: ignore[no-untyped-call]  # in place
    return out


def _hashable(t: torch.Tensor) -> bool:
    """Whether `t`'s bytes are its values (not quantized, no lazy
    conjugate or negative bit), so that copying them copies the tensor."""
    return t.layout == torch.strided and not t.is_quantized and not t.is_conj() and not t.is_neg()


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 array over the bytes of a contiguous host tensor."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _same_layout(value: torch.Tensor, old: Any) -> bool:
    """Whether `old` (a staged copy) can take `value`'s bytes as it is."""
    if not isinstance(old, torch.Tensor) or type(old) is not type(value) or old.device.type != "cpu":
        return False
    if hasattr(value, "placements"):
        if value.placements != old.placements or value.device_mesh != old.device_mesh:  # type: ignore[attr-defined]
            return False
    a, b = _local(value), _local(old)
    return a.dtype == b.dtype and a.shape == b.shape and b.is_contiguous() and a.layout == b.layout == torch.strided
