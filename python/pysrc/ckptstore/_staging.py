"""Staging for async saves: a copy of a state that later changes to the
state leave alone, made into the memory of an earlier copy when one is
free (no new memory for a state of the same layout). Used by
`ckptstore.dcp.StorageWriter` (DCP's `AsyncStager`) and
`ckptstore.dcp.Tiers.async_save`."""

import copy
import threading
from typing import Any, Dict, Hashable

import torch


class Pool:
    """Staged copies kept for reuse, one per key; a copy is lent to one
    save at a time and given back when that save is done with it."""

    def __init__(self) -> None:
        self._free: Dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def stage(self, key: Hashable, state: Any) -> Any:
        """A staged copy of `state`, into the free copy of `key` if any."""
        with self._lock:
            old = self._free.pop(key, None)
        return staged(state, old)

    def give_back(self, key: Hashable, copied: Any) -> None:
        with self._lock:
            self._free[key] = copied

    def clear(self, key: Hashable) -> None:
        with self._lock:
            self._free.pop(key, None)


def staged(value: Any, reuse: Any = None) -> Any:
    """A copy of a state's value that later changes to the state leave
    alone: tensors copied to host memory (into the tensor at the same place
    of `reuse`, a copy an earlier call made and no save holds any more,
    when its type, dtype, shape and layout match: no new memory), containers
    rebuilt, other values deep-copied (or as they are, if they cannot be)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if _same_layout(value, reuse):
            _local(reuse).copy_(_local(value))
            return reuse
        return value.to("cpu", copy=True)
    if isinstance(value, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: staged(v, old.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        old = reuse if isinstance(reuse, type(value)) and len(reuse) == len(value) else [None] * len(value)
        out = [staged(v, o) for v, o in zip(value, old)]
        return out if isinstance(value, list) else tuple(out)
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is saved as it is
        return value


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
