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
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

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
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.futures import Future

from . import DTYPE_NAMES, Remote, StepExistsError, Store, Tensor, _dcp_json, step_number
from ._dcp_json import Where
from . import open as _open_store

__all__ = ["StorageWriter", "StorageReader", "METADATA", "consolidate"]

METADATA = ".dcp/metadata.json"
"""The entry of the coordinator's shard that holds DCP's metadata."""

# Bytes of stored boxes read at once by a load.
_BATCH_BYTES = 64 << 20

Target = Union[str, "os.PathLike[str]", Store]


# One Remote per bucket URL in a process: it remembers where the chunks it
# wrote lie in the bucket's packs, so a save of unchanged tensors uploads
# nothing and asks nothing per chunk. Keyed by process too: a forked child
# opens its own.
_REMOTES: Dict[Tuple[int, str], Remote] = {}


def _remote(target: Any) -> Remote:
    key = (os.getpid(), str(target))
    found = _REMOTES.get(key)
    if found is None:
        found = _REMOTES[key] = Remote(str(target))
    return found


def _is_url(target: Any) -> bool:
    return isinstance(target, str) and target.split("://", 1)[0] in ("s3", "file")


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


class _SentAsUrl:
    """Pickles as its target URL and arguments (DCP's process mode sends
    the writer to another process); a local store stays in its process."""

    _target: Any

    def _arguments(self) -> Dict[str, Any]:
        raise NotImplementedError

    def __getstate__(self) -> Dict[str, Any]:
        if not _is_url(self._target):
            raise TypeError(
                f"a {type(self).__name__} over a local store cannot be sent to another process "
                "(dcp.async_save in process mode): use a bucket URL, or thread mode"
            )
        return self._arguments()

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]


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
        try:
            step_number(checkpoint_id)
            return True
        except (TypeError, ValueError):
            return False

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


class _local:
    """A local target as a context manager: an open Store is used as it is;
    a path is opened and closed around the use."""

    def __init__(self, target: Target, read_only: bool = False) -> None:
        self._target, self._read_only = target, read_only
        self._opened: Optional[Store] = None

    def __enter__(self) -> Store:
        if isinstance(self._target, Store):
            return self._target
        self._opened = _open_store(self._target, read_only=self._read_only)
        return self._opened

    def __exit__(self, *exc: object) -> None:
        if self._opened is not None:
            self._opened.close()


class StorageReader(_SentAsUrl, _storage.StorageReader):
    """Read a DCP checkpoint from step `step` of `target` (the latest
    complete step if None, resolved again at each load).

    One load reads one save: each rank opens the step on its own (DCP
    reads metadata on every rank before its first collective), the
    coordinator's step and commit go to every rank in its plan, and a rank
    that opened another commit (the step saved again meanwhile, or a newer
    latest) reads the coordinator's instead, or fails the load if that
    save's layout differs from the one it planned with. Nothing here waits
    on a collective of its own: a failure on any rank reaches every rank
    through DCP's exchange."""

    def __init__(self, target: Target, step: Optional[int] = None) -> None:
        super().__init__()
        self._target = target
        self._step = None if step is None else step_number(step)
        self._resolved: Optional[int] = None
        self._commit: Optional[str] = None
        self._global: Any = None
        self._local: Dict[str, np.ndarray] = {}
        self._where: Dict[MetadataIndex, Where] = {}
        self._by_rank: Dict[int, Dict[str, Tuple[Optional[str], Optional[List[int]], int]]] = {}
        self._metadata: Any = None

    def _arguments(self) -> Dict[str, Any]:
        return {"target": self._target, "step": self._step}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self._step = step_number(checkpoint_id)
        self._resolved = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """A checkpoint id is a step number."""
        return StorageWriter.validate_checkpoint_id(checkpoint_id)

    @property
    def step(self) -> Optional[int]:
        """The step being read (once `read_metadata` resolved it)."""
        return self._resolved

    def _latest(self) -> Optional[int]:
        if _is_url(self._target):
            return _remote(self._target).latest_step()
        with _local(self._target, read_only=True) as store:
            return store.latest_step()

    # No `rank=`/`**kwargs`: DCP would retry a failed read rank-locally and
    # leave that rank out of the collectives the others wait in.
    def read_metadata(self) -> Metadata:
        step = self._step if self._step is not None else self._latest()
        if step is None:
            raise FileNotFoundError(f"{_describe(self._target)} holds no complete step")
        self._open(step, None)
        return self._metadata

    def _open(self, step: int, commit: Optional[str]) -> None:
        """Open `step` (exactly `commit`, if given) and read its metadata."""
        self._resolved, self._commit = step, None
        self._global, self._local, self._by_rank = None, {}, {}
        where = _describe(self._target)
        if _is_url(self._target):
            remote = _remote(self._target)
            self._global = remote.open_global(step, commit)
            if self._global is None:
                which = f"step {step}" if commit is None else f"the commit {commit} of step {step}"
                raise FileNotFoundError(f"{where} has no complete {which}")
            self._commit = self._global.commit
            # The coordinator's shard holds the metadata: rank 0's, unless
            # the save's coordinator was another rank. Other shards are read
            # when their entries are.
            owner = None
            for rank in range(self._global.world_size):
                if METADATA in self._shard_entries(rank):
                    owner = rank
                    break
            if owner is None:
                raise ValueError(f"step {step} of {where} was not saved by ckptstore.dcp")
            size = self._shard_entries(owner)[METADATA][2]
            (buf,) = remote.read_pieces(self._global, [(owner, METADATA, 0, size)])
            text = buf.tobytes()
        else:
            with _local(self._target, read_only=True) as store:
                ck = store.load(step)
            if ck is None:
                raise FileNotFoundError(f"{where} has no step {step}")
            self._local = ck.tensors
            if METADATA not in self._local:
                raise ValueError(f"step {step} of {where} was not saved by ckptstore.dcp")
            text = self._local[METADATA].tobytes()
        metadata = _dcp_json.from_json(text)
        self._where = metadata.storage_data
        self._metadata = metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._where = metadata.storage_data
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        # The coordinator's save is the load's: every rank reads it.
        chosen = (self._resolved, self._commit)
        return [dataclasses.replace(p, storage_data=chosen) for p in plans]

    def _follow(self, chosen: Any) -> None:
        """Read the coordinator's save `chosen` (step, commit) if this rank
        opened another; refuse one whose layout is not the one planned."""
        if not isinstance(chosen, tuple) or chosen == (self._resolved, self._commit):
            return
        planned = self._metadata.state_dict_metadata
        step, commit = chosen
        self._open(step, commit)
        if self._metadata.state_dict_metadata != planned:
            raise RuntimeError(
                f"step {step} of {_describe(self._target)} was saved again while this load "
                "opened it, with another layout: load again"
            )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        self._follow(plan.storage_data)
        # In batches of about _BATCH_BYTES: memory holds the state being
        # loaded and one batch, not a second copy of the state.
        batch: List[Tuple[ReadItem, Tuple[int, str, int, int], Any]] = []
        size = 0
        # In the order the shards store their entries (by rank, then name):
        # a batch then covers neighbouring bytes of a pack, fetched with
        # few requests.
        items = sorted(plan.items, key=lambda i: (self._where[i.storage_index].rank, self._where[i.storage_index].entry))
        for item in items:
            piece, box = self._piece(item, self._where[item.storage_index])
            batch.append((item, piece, box))
            size += piece[3]
            if size >= _BATCH_BYTES:
                self._load_batch(batch, planner)
                batch, size = [], 0
        self._load_batch(batch, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _load_batch(self, batch: List[Tuple[ReadItem, Tuple[int, str, int, int], Any]], planner: LoadPlanner) -> None:
        if not batch:
            return
        # From a bucket, a box stored contiguously whose target tensor is a
        # plain contiguous CPU tensor of its dtype is read straight into the
        # target's memory; the rest through a buffer and `copy_`.
        direct: List[Tuple[ReadItem, Tuple[int, str, int, int], torch.Tensor, np.ndarray]] = []
        rest: List[Tuple[ReadItem, Tuple[int, str, int, int], Any, Optional[torch.Tensor]]] = []
        for item, piece, box in batch:
            target = None
            if item.type != LoadItemType.BYTE_IO:
                target = planner.resolve_tensor(item).detach()
                dest = _memory_of(target, piece, box) if self._global is not None else None
                if dest is not None:
                    direct.append((item, piece, target, dest))
                    continue
            rest.append((item, piece, box, target))
        if direct:
            _remote(self._target).read_pieces_into(
                self._global, [piece for _, piece, _, _ in direct], [dest for _, _, _, dest in direct]
            )
            for item, _, target, _ in direct:
                planner.commit_tensor(item, target)
        datas = self._fetch([piece for _, piece, _, _ in rest]) if rest else []
        for (item, _, box, target), data in zip(rest, datas):
            if target is None:
                planner.load_bytes(item, io.BytesIO(data.tobytes()))
                continue
            dtype, lengths, strides = box
            source = _view(data, dtype, lengths, strides)
            if target.size() != source.size():
                raise ValueError(f"{item.storage_index.fqn}: sizes {target.size()} and {source.size()} differ")
            target.copy_(source)
            planner.commit_tensor(item, target)

    def _shard_entries(self, rank: int) -> Dict[str, Tuple[Optional[str], Optional[List[int]], int]]:
        """Rank `rank`'s entries, its shard read once."""
        found = self._by_rank.get(rank)
        if found is None:
            assert self._global is not None
            found = self._by_rank[rank] = _remote(self._target).entries(self._global, rank)
        return found

    def _length(self, where: Where) -> int:
        if self._global is not None:
            return self._shard_entries(where.rank)[where.entry][2]
        return int(self._local[where.entry].nbytes)

    def _piece(self, item: ReadItem, where: Where) -> Tuple[Tuple[int, str, int, int], Any]:
        if item.type == LoadItemType.BYTE_IO:
            return (where.rank, where.entry, 0, self._length(where)), None
        # The stored chunk's dtype and sizes, from DCP's metadata.
        index = item.storage_index
        md = self._metadata.state_dict_metadata[index.fqn]
        chunk = next(c for c in md.chunks if list(c.offsets) == list(index.offset or []))
        dtype = md.properties.dtype
        itemsize = torch.empty(0, dtype=dtype).element_size()
        strides = _row_major(list(chunk.sizes))
        offsets, lengths = list(item.storage_offsets), list(item.lengths)
        if any(n == 0 for n in lengths):
            return (where.rank, where.entry, 0, 0), (dtype, lengths, strides)
        first = sum(o * s for o, s in zip(offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
        start, end = first * itemsize, (last + 1) * itemsize
        if end > self._length(where):
            raise ValueError(f"{index.fqn}: the box {offsets}+{lengths} is outside its stored chunk")
        return (where.rank, where.entry, start, end - start), (dtype, lengths, strides)

    def _fetch(self, pieces: Sequence[Tuple[int, str, int, int]]) -> List[np.ndarray]:
        if self._global is not None:
            return _remote(self._target).read_pieces(self._global, list(pieces))
        out = []
        for _, entry, start, n in pieces:
            whole = self._local[entry]
            flat = whole.reshape(-1).view(np.uint8)
            out.append(flat[start : start + n])
        return out


def _describe(target: Target) -> str:
    return str(target) if not isinstance(target, Store) else "the store"


def _memory_of(target: torch.Tensor, piece: Tuple[int, str, int, int], box: Any) -> Optional[np.ndarray]:
    """The bytes of `target` as a writable uint8 array, when the stored box
    `piece` covers is contiguous and `target` holds it in the same layout
    (a plain contiguous CPU tensor of its dtype and size); else None."""
    dtype, lengths, _ = box
    n = 1
    for d in lengths:
        n *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    plain = (
        target.device.type == "cpu"
        and target.layout == torch.strided
        and not target.is_quantized
        and type(target) is torch.Tensor
    )
    if not plain or n == 0 or target.dtype != dtype or target.numel() != n or not target.is_contiguous():
        return None
    if piece[3] != n * itemsize or list(target.shape) != list(lengths):
        return None
    return target.reshape(-1).view(torch.uint8).numpy()


def _row_major(shape: Sequence[int]) -> List[int]:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return list(reversed(strides))


def _view(data: np.ndarray, dtype: torch.dtype, lengths: List[int], strides: List[int]) -> torch.Tensor:
    """The box `lengths` of a row-major tensor with `strides` (elements),
    from `data`, the bytes from its first element to its last."""
    if any(n == 0 for n in lengths) or data.size == 0:
        return torch.empty(lengths, dtype=dtype)
    flat = torch.frombuffer(data, dtype=dtype)
    return flat.as_strided(lengths, strides)


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
