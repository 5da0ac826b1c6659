"""The codec shared by `ckptstore.torch` and `ckptstore.lightning`: a nested
structure of tensors, numbers, strings, lists, tuples and dicts as typed
tensors plus one JSON document, so that loading runs no code.

A tensor is replaced by `{"__tensor__": name, "dtype", "shape"}`, a dict by
`{"__dict__": [[key, value], ...]}` (keys of any storable type, order
kept; an OrderedDict's `_metadata`, which `load_state_dict` reads, as
`"__metadata__"`), a tuple by `{"__tuple__": [...]}` and a torch.dtype by
`{"__dtype__": name}`; anything else is refused, naming its key.
"""

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Union

import numpy as np
import torch

from ._ckptstore import Tensor
from ._convert import DTYPE_NAMES
from ._staging import Hashes, hashes_of


def sharded_kind(t: Any) -> Optional[str]:
    """'DTensor' or 'ShardedTensor' for the distributed tensor types."""
    for module, name in (
        ("torch.distributed.tensor", "DTensor"),
        ("torch.distributed._shard.sharded_tensor", "ShardedTensor"),
    ):
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
        if isinstance(t, cls):
            return name
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_layout(t: torch.Tensor, name: str) -> None:
    """Refuse, naming the key, a tensor whose bytes are not plain elements."""
    kind = sharded_kind(t)
    if kind is not None:
        raise TypeError(
            f"{name}: a {kind} is one shard of a distributed tensor; save sharded "
            "state with torch.distributed.checkpoint and ckptstore.dcp.StorageWriter"
        )
    if t.is_quantized:
        raise TypeError(f"{name}: quantized tensors ({t.dtype}, {t.qscheme()}) are not "
                        "supported; store t.dequantize() or t.int_repr() with its scales")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"{name}: {t.layout} tensors are not supported; convert to dense "
                        "(t.to_dense()) first")


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy array over `t`'s elements: its own memory when `t` is a
    contiguous CPU tensor, else a host copy."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg().contiguous()
    out: np.ndarray = t.reshape(-1).view(torch.uint8).numpy()
    return out


class Flattener:
    """Turns a nested structure into JSON with the tensors taken out."""

    def __init__(self) -> None:
        self.tensors: Dict[str, torch.Tensor] = {}

    def tensor(self, t: torch.Tensor, name: str) -> Dict[str, Any]:
        if name in self.tensors:
            raise ValueError(f"two tensors would be stored as {name!r}")
        check_layout(t, name)
        self.tensors[name] = t
        return {"__tensor__": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}

    def walk(self, obj: Any, name: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, name)
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, dict):
            items = [[self.walk(k, "?key"), self.walk(v, f"{name}/{k}")] for k, v in obj.items()]
            out: Dict[str, Any] = {"__dict__": items}
            metadata = getattr(obj, "_metadata", None)
            if isinstance(obj, OrderedDict) and isinstance(metadata, dict):
                out["__metadata__"] = self.walk(metadata, f"{name}/_metadata")
            return out
        if isinstance(obj, tuple):
            return {"__tuple__": [self.walk(v, f"{name}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.walk(v, f"{name}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, torch.dtype):
            return {"__dtype__": dtype_name(obj)}
        raise TypeError(f"{name}: cannot store a {type(obj).__name__} (tensors, numbers, str, "
                        "None, and lists, tuples and dicts of them are supported)")


class Rebuilder:
    def __init__(self, tensors: Dict[str, np.ndarray], own: Optional[Dict[str, torch.Tensor]] = None) -> None:
        self.tensors = tensors  # name -> uint8 numpy array viewing the loaded bytes
        self.own = own or {}  # name -> the caller's tensor, read into in place

    def tensor(self, ref: Dict[str, Any]) -> torch.Tensor:
        name = ref["__tensor__"]
        if name in self.own:
            return self.own[name]
        if name not in self.tensors:
            raise KeyError(f"the step has no tensor {name!r}")
        dtype = getattr(torch, ref["dtype"])
        raw = torch.from_numpy(self.tensors[name])
        out: torch.Tensor = raw.view(dtype).reshape(ref["shape"])
        return out

    def walk(self, obj: Any) -> Any:
        if isinstance(obj, list):
            return [self.walk(v) for v in obj]
        if not isinstance(obj, dict):
            return obj
        if "__tensor__" in obj:
            return self.tensor(obj)
        if "__dict__" in obj:
            items = [(self.walk(k), self.walk(v)) for k, v in obj["__dict__"]]
            if "__metadata__" not in obj:
                return dict(items)
            out = OrderedDict(items)
            out._metadata = self.walk(obj["__metadata__"])  # type: ignore[attr-defined]
            return out
        if "__tuple__" in obj:
            return tuple(self.walk(v) for v in obj["__tuple__"])
        if "__dtype__" in obj:
            return getattr(torch, obj["__dtype__"])
        raise ValueError(f"unknown structure entry {sorted(obj)}")


def arrays(tensors: Dict[str, torch.Tensor], hashes: Optional[Hashes] = None) -> Dict[str, Tensor]:
    """name -> ckptstore.Tensor over each tensor's bytes (a dtype the store
    does not know is stored as its raw bytes, U8), with the hashes of a
    staged tensor's chunks when `hashes` (a `Staged`'s) has them."""
    out: Dict[str, Tensor] = {}
    for name, t in tensors.items():
        data = host_bytes(t)
        known = None
        if hashes:
            known = hashes_of(hashes, t)
        dtype = DTYPE_NAMES.get(dtype_name(t.dtype))
        if dtype is None:
            out[name] = Tensor("U8", [data.size], data, known)
        else:
            out[name] = Tensor(dtype, list(t.shape), data, known)
    return out
