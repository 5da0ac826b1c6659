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

import dataclasses
import io
import json
import os
from builtins import open as builtins_open
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.futures import Future

from . import DTYPE_NAMES, HfExport, StepExistsError, Tensor, _dcp_json, step_number
from ._dcp_base import METADATA, Target, _describe, _is_step_id, _is_url, _local, _remote, _SentAsUrl
from ._dcp_json import Where
from ._dcp_read import StorageReader

__all__ = ["StorageWriter", "StorageReader", "METADATA", "consolidate", "export_hf"]

def _entry_name(index: MetadataIndex) -> str:
    if index.offset is None:
        return f"b/{index.fqn}"
    return f"t/{index.fqn}@{','.join(str(o) for o in index.offset)}"


def _host_bytes(t: torch.Tensor) -> Tuple[str, List[int], np.ndarray]:
    """(store dtype, shape, uint8 array over a C-contiguous CPU copy or the
    tensor itself)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = _dcp_json.json_dtype(t.dtype)
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    if name.startswith("torch."):
        # No safetensors name: its bytes (DCP's metadata keeps the dtype).
        return "U8", [int(flat.numel())], flat.numpy()
    return name, list(t.shape), flat.numpy()


class StorageWriter(_SentAsUrl, _storage.StorageWriter):
    """Write a DCP checkpoint as step `step` of `target`: a bucket URL (any
    number of ranks) or a local store (a path or an open Store; one
    process). With `overwrite` (DCP's default, as in its FileSystemWriter)
    a save of a step already committed replaces it; without, it is refused
    (`StepExistsError` inside DCP's `CheckpointException`) before any rank
    writes.

    The ranks are those of the save (DCP's `process_group`, or the one
    process of `no_dist=True`): the coordinator numbers them from the plans
    it gathers and hands each its rank and the world size in its plan."""

    def __init__(self, target: Target, step: int, overwrite: bool = True) -> None:
        super().__init__()
        self._target = target
        self._step = step_number(step)
        self._overwrite = bool(overwrite)
        self._rank, self._world = 0, 1
        self._coordinator = True
        self._kept: Dict[str, Any] = {}

    def _arguments(self) -> Dict[str, Any]:
        return {"target": self._target, "step": self._step, "overwrite": self._overwrite}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self._step = step_number(checkpoint_id)
        self._kept = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """A checkpoint id is a step number."""
        return _is_step_id(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = is_coordinator

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=str(self._step))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        world = len(plans)
        if not _is_url(self._target) and world > 1:
            raise ValueError(
                f"a local store takes one process; {world} ranks save to a bucket URL "
                "(s3://... or file://...)"
            )
        if not self._overwrite and self._committed():
            raise StepExistsError(
                f"step {self._step} is already in {_describe(self._target)}; "
                "StorageWriter(..., overwrite=True) replaces it"
            )
        # Each rank's place in this save and its size, from the plans DCP
        # gathered (the save's group, whatever it is).
        return [dataclasses.replace(p, storage_data=(i, world)) for i, p in enumerate(plans)]

    def _committed(self) -> bool:
        if _is_url(self._target):
            return _remote(self._target).open_global(self._step) is not None
        with _local(self._target) as store:
            return self._step in store.steps()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[_storage.WriteResult]]":
        if isinstance(plan.storage_data, tuple):
            self._rank, self._world = plan.storage_data
        values: Dict[str, Any] = {}
        written = [self._resolve(item, planner, values) for item in plan.items]
        shard = ""
        if self._coordinator:
            # Its shard is uploaded with the metadata by finish; its data
            # now, beside the other ranks' (finish then finds it there). A
            # save of one rank has no one to upload beside: its data is
            # hashed and uploaded once, by finish.
            self._kept = values
            if _is_url(self._target) and self._world > 1:
                self._upload(values, chunks_only=True)
        elif _is_url(self._target):
            shard = self._upload(values)
        # Every rank reports its shard, also a rank with no items.
        written.append((MetadataIndex(fqn=f"\0ckptstore.rank.{self._rank}"), 0, ""))
        results = [
            _storage.WriteResult(index, size, Where(self._rank, name, shard))
            for index, size, name in written
        ]
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _resolve(
        self, item: WriteItem, planner: SavePlanner, values: Dict[str, Any]
    ) -> Tuple[MetadataIndex, int, str]:
        """Put `item`'s data in `values`: (its index, its size, its entry)."""
        data = planner.resolve_data(item)
        name = _entry_name(item.index)
        if item.type == WriteItemType.BYTE_IO:
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            values[name] = raw
            return item.index, len(raw), name
        dtype, shape, array = _host_bytes(data)
        values[name] = Tensor(dtype, shape, array)
        return item.index, int(array.size), name

    def _upload(self, values: Dict[str, Any], chunks_only: bool = False) -> str:
        remote = _remote(self._target)
        info = remote.upload_shard(self._step, self._rank, self._world, values, data_only=chunks_only)
        return info.shard

    def finish(self, metadata: Metadata, results: List[List[_storage.WriteResult]]) -> None:
        shards: List[str] = [""] * self._world
        storage: Dict[MetadataIndex, Where] = {}
        for per_rank in results:
            for r in per_rank:
                where = r.storage_data
                if where.entry:
                    storage[r.index] = where
                elif 0 <= where.rank < self._world:
                    shards[where.rank] = where.shard
        metadata.storage_data = storage
        values = dict(self._kept)
        self._kept = {}
        values[METADATA] = _dcp_json.to_json(metadata).encode()
        if not _is_url(self._target):
            with _local(self._target) as store:
                store.save(self._step, values, replace=self._overwrite)
            return
        shards[self._rank] = self._upload(values)
        missing = [r for r, s in enumerate(shards) if not s]
        if missing:
            raise ValueError(f"step {self._step}: no shard reported by ranks {missing}")
        _remote(self._target).commit_global(self._step, shards)


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
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with builtins_open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for b in blobs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return names
