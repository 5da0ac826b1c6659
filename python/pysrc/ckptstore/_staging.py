"""Staging for async saves: a copy of a state that later changes to the
state leave alone, made into the memory of an earlier copy when one is
free (no new memory for a state of the same layout), with the hashes of
its chunks taken in the same pass (the save then writes the copy without
reading it again). Used by `ckptstore.dcp.StorageWriter` (DCP's
`AsyncStager`) and `ckptstore.dcp.Tiers.async_save`."""

import copy
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Optional, Tuple

import numpy as np
import torch

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
    """Staged copies kept for reuse, one per key; a copy is lent to one
    save at a time and given back when that save is done with it."""

    def __init__(self) -> None:
        self._free: Dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def stage(self, key: Hashable, state: Any, shared: bool = False) -> Staged:
        """A staged copy of `state`, into the free copy of `key` if any;
        new memory in shared memory if `shared`."""
        with self._lock:
            old = self._free.pop(key, None)
        return staged(state, old, shared)

    def give_back(self, key: Hashable, copied: Any) -> None:
        with self._lock:
            self._free[key] = copied

    def clear(self, key: Hashable) -> None:
        with self._lock:
            self._free.pop(key, None)


def staged(value: Any, reuse: Any = None, shared: bool = False) -> Staged:
    """A copy of a state's value that later changes to the state leave
    alone: tensors copied to host memory (into the tensor at the same place
    of `reuse`, a copy an earlier call made and no save holds any more,
    when its type, dtype, shape and layout match: no new memory; else into
    new memory, shared memory if `shared`), containers rebuilt, other
    values deep-copied (or as they are, if they cannot be). The bytes of
    contiguous host tensors are copied by `copy_hashed` in one call, on
    every core, hashed as they are copied."""
    pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []
    out = Staged(_copy(value, reuse, shared, pairs))
    if pairs:
        arrays = [(_bytes(src), _bytes(dst)) for src, dst in pairs]
        for (_, dst), hashes in zip(pairs, copy_hashed(arrays)):
            out.hashes[dst.data_ptr()] = (dst, hashes)
    return out


def _copy(value: Any, reuse: Any, shared: bool, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """`value` staged (see `staged`), the copies of contiguous host tensors
    left to make: (source, destination) added to `pairs`."""
    if isinstance(value, torch.Tensor):
        return _tensor(value.detach(), reuse, shared, pairs)
    if isinstance(value, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: _copy(v, old.get(k), shared, pairs) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        same = isinstance(reuse, type(value)) and len(reuse) == len(value)
        olds = reuse if same else [None] * len(value)
        items = [_copy(v, o, shared, pairs) for v, o in zip(value, olds)]
        return items if isinstance(value, list) else tuple(items)
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is saved as it is
        return value


def _tensor(value: torch.Tensor, reuse: Any, shared: bool, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    if _same_layout(value, reuse):
        out = reuse
    elif isinstance(value, torch.Tensor) and hasattr(value, "placements"):
        # A DTensor: a new one over a host copy of its local tensor.
        local = _new_like(_local(value), shared)
        out = type(value).from_local(  # type: ignore[attr-defined]
            local, value.device_mesh, value.placements, run_check=False,  # type: ignore[attr-defined]
            shape=value.shape, stride=value.stride(),
        )
    else:
        out = _new_like(value, shared)
    src, dst = _local(value), _local(out)
    if src.device.type == "cpu" and src.is_contiguous() and _hashable(src):
        pairs.append((src, dst))
    else:
        dst.copy_(src)  # another device, or strided: torch copies, the save hashes
    copied: torch.Tensor = out
    return copied


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
