"""The storage layer under `torch.distributed.checkpoint` (DCP).

    import torch.distributed.checkpoint as dcp
    from ckptstore.dcp import StorageWriter, StorageReader

    dcp.save(state, storage_writer=StorageWriter("s3://bucket/run", step=100))
    dcp.load(state, storage_reader=StorageReader("s3://bucket/run"))  # latest

DCP decides *what* is saved (global shapes, shard offsets, resharding on
load); ckptstore decides *where the bytes go*. A target is a bucket URL
(`s3://`, `file://`) for any number of ranks, or a local store (a path or
an open `ckptstore.Store`) for one process.

In a bucket, each rank's write items become its shard of global step
`step` (chunks deduplicated against everything in the bucket, every chunk
hash-checked on load). The coordinator's `finish` uploads its own shard
with DCP's metadata and then writes the step's commit naming exactly the
shards of this save: the step is listed (`Remote.steps()`, `ckpt ls`)
only after every rank's data and the metadata have landed. A rank that
dies at any point leaves the step invisible; saving again completes it,
and shards of the dead attempt are named by no commit.

Loading at any world size: each read item names a box of a stored shard;
the reader fetches only the chunks that cover the bytes of that box (for
a box of a row-major tensor, the span from its first to its last element)
and checks each chunk's hash; a damaged chunk fails the load with
`ckptstore.CorruptError` (carried inside DCP's `CheckpointException`).

Formats: DCP's metadata is stored as JSON (`.dcp/metadata.json` in the
coordinator's shard: names, global shapes, dtypes, chunk boxes, where each
box is) and rebuilt from it on load: no pickle. Non-tensor values are
DCP's own bytes (`torch.save` by its planner), which DCP's planner loads
with `torch.load(weights_only=False)`: trust a bucket as you would trust
DCP's files.

Memory: the coordinator keeps its own write items (CPU tensors by
reference; device tensors copied to the host) from `write_data` to
`finish`. Its data is uploaded in `write_data`, beside the other ranks';
`finish` uploads its shard manifest with the metadata (the chunks are
there: they are hashed again, not uploaded again).
"""

import json
import os
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from . import DTYPE_NAMES, HfExport
from ._dcp_base import METADATA, Target, _describe, _is_url, _local, _remote
from ._dcp_read import StorageReader
from ._dcp_write import StorageWriter
from ._cost import SaveCost
from ._tiers import Tiers

__all__ = ["StorageWriter", "StorageReader", "Tiers", "SaveCost", "METADATA", "consolidate", "export_hf"]


def export_hf(
    target: Target,
    step: Optional[int],
    directory: "os.PathLike[str] | str",
    max_shard_size: "int | str" = "5GB",
    prefix: Optional[str] = None,
    dtype: Any = None,
) -> HfExport:
    """Write DCP step `step` of `target` (a bucket URL or a local store; the
    latest step if None) into `directory` as a Hugging Face checkpoint:
    safetensors shards of at most `max_shard_size` ("5GB", "500MB", "2GiB"
    or bytes; one shard is written as `model.safetensors`), named and split
    as `save_pretrained` does, and `model.safetensors.index.json` (its
    `weight_map` and `metadata.total_size` exact). Tensors are whole, under
    their fully qualified names; with `prefix` (e.g. "model."), only those
    under it, stripped. `dtype` ("bf16", "f16", "f32" or a torch dtype)
    casts floating tensors, lossily when it narrows. One tensor is in
    memory at a time, every chunk hash-checked; an index already in
    `directory` is removed first and the new one written last, each shard
    durably under a temporary name first, so a killed export never leaves
    an index naming a missing, partial or overwritten shard. The model's
    `config.json` is the caller's to write beside (`model.config.save_pretrained`).
    As `ckpt export TARGET STEP --hf -o DIR`."""
    if _is_url(target):
        remote = _remote(target)
        resolved = step if step is not None else remote.latest_step()
        if resolved is None:
            raise FileNotFoundError(f"{target} holds no complete step")
        return remote.export_hf(resolved, directory, max_shard_size, prefix, dtype)
    with _local(target, read_only=True) as store:
        resolved = step if step is not None else store.latest_step()
        if resolved is None:
            raise FileNotFoundError(f"{_describe(target)} holds no complete step")
        return store.export_hf(resolved, directory, max_shard_size, prefix, dtype)


def consolidate(
    target: Target, step: Optional[int], path: "os.PathLike[str] | str", prefix: Optional[str] = None
) -> List[str]:
    """Write DCP step `step` of `target` (the latest if None) to `path` as one
    safetensors file of whole, unsharded tensors under their fully
    qualified names; with `prefix` (e.g. "model."), only the names under
    it, stripped, so that an unsharded model's `load_state_dict` and
    `safetensors.torch.load_file` take it. Non-tensor values are left out.
    The names written.

    From a bucket, one tensor is in memory at a time (read in 32 MiB
    windows, every chunk hash-checked), written by the Rust core, as
    `ckpt export URL STEP -o FILE --prefix P` does. From a local store the
    step is loaded whole first."""
    reader = StorageReader(target, step)
    if _is_url(target):
        resolved = step if step is not None else reader._latest()
        if resolved is None:
            raise FileNotFoundError(f"{target} holds no complete step")
        return _remote(target).consolidate(resolved, path, prefix)
    md = reader.read_metadata()
    resolved = reader.step
    header: Dict[str, Any] = {"__metadata__": {"ckptstore.step": str(resolved)}}
    blobs = []
    at = 0
    names = []
    for fqn, m in sorted(md.state_dict_metadata.items()):
        if not isinstance(m, TensorStorageMetadata):
            continue
        name = fqn if prefix is None else (fqn[len(prefix):] if fqn.startswith(prefix) else None)
        if name is None:
            continue
        if str(m.properties.dtype).removeprefix("torch.") not in DTYPE_NAMES:
            raise ValueError(
                f"tensor {fqn} is {m.properties.dtype}, which a safetensors file cannot hold: "
                "consolidate the others (a prefix that leaves it out), or load it with ckptstore.dcp"
            )
        whole = torch.zeros(tuple(m.size), dtype=m.properties.dtype)
        for chunk in m.chunks:
            where = md.storage_data[MetadataIndex(fqn, chunk.offsets)]
            stored = reader._local[where.entry].reshape(-1).view(np.uint8)
            part = torch.frombuffer(stored, dtype=whole.dtype).reshape(tuple(chunk.sizes)) if stored.size else None
            if part is not None:
                box = whole
                for d, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
                    box = box.narrow(d, o, n)
                box.copy_(part)
        data = whole.reshape(-1).view(torch.uint8).numpy().tobytes() if whole.numel() else b""
        header[name] = {
            "dtype": DTYPE_NAMES[str(whole.dtype).removeprefix("torch.")],
            "shape": list(whole.shape),
            "data_offsets": [at, at + len(data)],
        }
        at += len(data)
        blobs.append(data)
        names.append(name)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix_bytes = len(text).to_bytes(8, "little") + text
    _durable_write(os.fspath(path), [prefix_bytes, *blobs])
    return names


def _durable_write(path: str, chunks: List[bytes]) -> None:
    """Write `chunks` to `path` durably and atomically: a temporary file,
    fsynced, renamed over `path`, the directory fsynced."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
