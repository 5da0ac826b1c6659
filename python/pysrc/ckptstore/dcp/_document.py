"""DCP's metadata to and from the JSON document `ckptstore.dcp` stores
(`.dcp/metadata.json`), without pickle: the document and its schema are
the core's (`ckptstore::DcpDocument`, which `Remote::dcp_index` and
consolidation read too); here DCP's objects become its plain values and
back, and the torch dtypes their names."""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

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

from .._ckptstore import DcpChunk, DcpDocument, DcpEntry, DcpWhere
from .._convert import DTYPE_NAMES
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


def to_json(md: Metadata) -> bytes:
    """DCP's metadata as the document `ckptstore.dcp` stores (its schema is
    the core's, `ckptstore::DcpDocument`)."""
    entries: Dict[str, DcpEntry] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            dtype = json_dtype(m.properties.dtype)
            itemsize = torch.empty(0, dtype=m.properties.dtype).element_size() if dtype.startswith("torch.") else None
            chunks = [DcpChunk(list(c.offsets), list(c.sizes)) for c in m.chunks]
            requires_grad = bool(m.properties.requires_grad)
            entries[fqn] = DcpEntry.tensor(dtype, itemsize, list(m.size), requires_grad, chunks)
        elif isinstance(m, BytesStorageMetadata):
            entries[fqn] = DcpEntry.non_tensor()
        else:
            raise TypeError(f"{fqn}: DCP metadata of type {type(m).__name__} is not supported")
    where = [
        DcpWhere(i.fqn, None if i.offset is None else list(i.offset), i.index, w.rank, w.entry)
        for i, w in md.storage_data.items()
    ]
    return DcpDocument(md.version, entries, _planner_data(md.planner_data), where).encode()


def _planner_data(data: Any) -> Optional[Dict[str, List[Union[int, str]]]]:
    """The default planners' data: fqn -> the path of keys (str or int) in
    the nested state dict."""
    if data is None:
        return None
    if isinstance(data, dict) and all(
        isinstance(k, str) and isinstance(v, tuple) and all(isinstance(p, (str, int)) for p in v)
        for k, v in data.items()
    ):
        return {k: list(v) for k, v in data.items()}
    raise TypeError(
        f"planner data of type {type(data).__name__} cannot be stored as JSON: "
        "ckptstore.dcp supports DCP's default planners"
    )


def from_json(text: bytes) -> Metadata:
    """DCP's metadata from the document `ckptstore.dcp` stored
    (CorruptError for a damaged one, ValueError for a dtype torch lacks)."""
    doc = DcpDocument.decode(text)
    state: Dict[str, Any] = {}
    for fqn, m in doc.state_dict.items():
        if m.bytes:
            state[fqn] = BytesStorageMetadata()
            continue
        props = TensorProperties(dtype=torch_dtype(m.dtype, fqn), requires_grad=m.requires_grad)
        boxes = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in m.chunks]
        state[fqn] = TensorStorageMetadata(props, torch.Size(m.size), boxes)
    storage = {
        MetadataIndex(fqn=w.fqn, offset=None if w.offset is None else torch.Size(w.offset), index=w.index): Where(
            w.rank, w.entry
        )
        for w in doc.storage
    }
    planner = doc.planner_data
    planner_data = None if planner is None else {k: tuple(v) for k, v in planner.items()}
    return Metadata(
        state_dict_metadata=state,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=doc.version,
    )
