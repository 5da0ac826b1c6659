"""DCP's metadata to and from the JSON document `ckptstore.dcp` stores
(`.dcp/metadata.json`), without pickle: the document and its schema are
the core's (`ckptstore::DcpDocument`, which `Remote::dcp_index` and
consolidation read too); here DCP's objects become its plain values and
back, and the torch dtypes their names."""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

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

from .._ckptstore import dcp_metadata_decode, dcp_metadata_encode
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
    tensors: List[Tuple[str, Any]] = []
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            dtype = json_dtype(m.properties.dtype)
            itemsize = torch.empty(0, dtype=m.properties.dtype).element_size() if dtype.startswith("torch.") else None
            chunks = [(list(c.offsets), list(c.sizes)) for c in m.chunks]
            tensors.append((fqn, (dtype, itemsize, list(m.size), bool(m.properties.requires_grad), chunks)))
        elif isinstance(m, BytesStorageMetadata):
            tensors.append((fqn, None))
        else:
            raise TypeError(f"{fqn}: DCP metadata of type {type(m).__name__} is not supported")
    where = [
        (i.fqn, None if i.offset is None else list(i.offset), i.index, w.rank, w.entry)
        for i, w in md.storage_data.items()
    ]
    return dcp_metadata_encode(md.version, tensors, _planner_data(md.planner_data), where)


def _planner_data(data: Any) -> Optional[List[Tuple[str, List[Union[int, str]]]]]:
    """The default planners' data: fqn -> the path of keys (str or int) in
    the nested state dict."""
    if data is None:
        return None
    if isinstance(data, dict) and all(
        isinstance(k, str) and isinstance(v, tuple) and all(isinstance(p, (str, int)) for p in v)
        for k, v in data.items()
    ):
        return [(k, list(v)) for k, v in data.items()]
    raise TypeError(
        f"planner data of type {type(data).__name__} cannot be stored as JSON: "
        "ckptstore.dcp supports DCP's default planners"
    )


def from_json(text: bytes) -> Metadata:
    """DCP's metadata from the document `ckptstore.dcp` stored
    (CorruptError for a damaged one, ValueError for a dtype torch lacks)."""
    version, tensors, planner, where = dcp_metadata_decode(text)
    state: Dict[str, Any] = {}
    for fqn, m in tensors:
        if m is None:
            state[fqn] = BytesStorageMetadata()
            continue
        dtype, _, size, requires_grad, chunks = m
        props = TensorProperties(dtype=torch_dtype(dtype, fqn), requires_grad=requires_grad)
        boxes = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks]
        state[fqn] = TensorStorageMetadata(props, torch.Size(size), boxes)
    storage = {
        MetadataIndex(fqn=fqn, offset=None if offset is None else torch.Size(offset), index=index): Where(rank, entry)
        for fqn, offset, index, rank, entry in where
    }
    planner_data = None if planner is None else {k: tuple(v) for k, v in planner}
    return Metadata(
        state_dict_metadata=state,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=version,
    )
