"""DCP's metadata as JSON (`.dcp/metadata.json`), written by
`ckptstore.dcp`'s coordinator and read back into DCP's `Metadata` without
pickle; Rust reads the same JSON (`Remote::dcp_index`, consolidation).

    {"format": 1, "version": ..., "state_dict": {FQN: {"dtype", "size",
     "requires_grad", "chunks": [{"offsets", "sizes"}]} | {"bytes": true}},
     "planner_data": [[FQN, [path...]], ...] | null,
     "storage": [{"fqn", "offset", "index", "rank", "entry"}, ...]}
"""

import json
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ._convert import DTYPE_NAMES

FORMAT = 1
_FROM_STORE = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class Where:
    """Where a write item's bytes are: rank `rank`'s entry `entry`, in the
    shard named `shard` (bucket targets)."""

    rank: int
    entry: str
    shard: str = ""


# Torch dtypes safetensors has no name for: named "torch.<name>" in the
# JSON (with their element size), their boxes stored as bytes.
TORCH_ONLY = ("complex128", "complex32")


def json_dtype(dtype: torch.dtype) -> str:
    """The name of `dtype` in the JSON: its store name, or "torch.<name>"."""
    name = str(dtype).removeprefix("torch.")
    if name in DTYPE_NAMES:
        return DTYPE_NAMES[name]
    if name in TORCH_ONLY:
        return f"torch.{name}"
    raise TypeError(f"dtype {dtype} cannot be stored by ckptstore.dcp")


def torch_dtype(store_name: Optional[str], entry: str) -> torch.dtype:
    """The torch dtype of a store dtype name (or of a "torch.<name>")."""
    if store_name is not None and store_name.removeprefix("torch.") in TORCH_ONLY:
        name: Optional[str] = store_name.removeprefix("torch.")
    else:
        name = _FROM_STORE.get(store_name or "")
    if name is None:
        raise ValueError(f"{entry!r}: dtype {store_name} is not a torch dtype")
    found: torch.dtype = getattr(torch, name)
    return found


def to_json(md: Metadata) -> str:
    tensors: Dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            tensors[fqn] = {
                "dtype": json_dtype(m.properties.dtype),
                "size": list(m.size),
                "requires_grad": bool(m.properties.requires_grad),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks],
            }
            if tensors[fqn]["dtype"].startswith("torch."):
                tensors[fqn]["itemsize"] = torch.empty(0, dtype=m.properties.dtype).element_size()
        elif isinstance(m, BytesStorageMetadata):
            tensors[fqn] = {"bytes": True}
        else:
            raise TypeError(f"{fqn}: DCP metadata of type {type(m).__name__} is not supported")
    where = [
        {
            "fqn": i.fqn,
            "offset": None if i.offset is None else list(i.offset),
            "index": i.index,
            "rank": w.rank,
            "entry": w.entry,
        }
        for i, w in md.storage_data.items()
    ]
    return json.dumps(
        {
            "format": FORMAT,
            "version": md.version,
            "state_dict": tensors,
            "planner_data": _planner_data(md.planner_data),
            "storage": where,
        },
        separators=(",", ":"),
    )


def _planner_data(data: Any) -> Any:
    """The default planners' data: fqn -> the path of keys (str or int) in
    the nested state dict."""
    if data is None:
        return None
    if isinstance(data, dict) and all(
        isinstance(k, str) and isinstance(v, tuple) and all(isinstance(p, (str, int)) for p in v)
        for k, v in data.items()
    ):
        return [[k, list(v)] for k, v in data.items()]
    raise TypeError(
        f"planner data of type {type(data).__name__} cannot be stored as JSON: "
        "ckptstore.dcp supports DCP's default planners"
    )


def from_json(text: bytes) -> Metadata:
    try:
        js = json.loads(text)
        if js.get("format") != FORMAT:
            raise ValueError(f"unknown ckptstore.dcp metadata format {js.get('format')}")
        state: Dict[str, Any] = {}
        for fqn, m in js["state_dict"].items():
            if m.get("bytes"):
                state[fqn] = BytesStorageMetadata()
                continue
            props = TensorProperties(dtype=torch_dtype(m["dtype"], fqn), requires_grad=bool(m["requires_grad"]))
            chunks = [ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in m["chunks"]]
            state[fqn] = TensorStorageMetadata(props, torch.Size(m["size"]), chunks)
        storage = {
            MetadataIndex(
                fqn=w["fqn"],
                offset=None if w["offset"] is None else torch.Size(w["offset"]),
                index=w["index"],
            ): Where(int(w["rank"]), str(w["entry"]))
            for w in js["storage"]
        }
        planner = js.get("planner_data")
        planner_data = None if planner is None else {k: tuple(v) for k, v in planner}
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"damaged ckptstore.dcp metadata: {e!r}") from None
    return Metadata(
        state_dict_metadata=state,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=js.get("version"),
    )
