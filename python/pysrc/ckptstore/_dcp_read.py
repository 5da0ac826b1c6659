"""ckptstore.dcp's StorageReader: one load reads one save of a step,
and of it the shards it takes boxes from, in ranged reads of
neighbouring bytes."""

import dataclasses
import io
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from . import _dcp_json, step_number
from ._dcp_base import METADATA, Target, _describe, _is_step_id, _is_url, _local, _remote, _SentAsUrl
from ._dcp_json import Where

# Bytes of stored boxes read at once by a load.
_BATCH_BYTES = 64 << 20

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
        return _is_step_id(checkpoint_id)

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
        # In the order the shards store their entries (by rank, then name):
        # neighbouring bytes of a pack are fetched with few requests.
        items = sorted(plan.items, key=lambda i: (self._where[i.storage_index].rank, self._where[i.storage_index].entry))
        # From a bucket, a box stored contiguously whose target tensor is a
        # plain contiguous CPU tensor of its dtype is read straight into the
        # target's memory, all such boxes in one call (no copy is held, so
        # the bucket gets as many ranges in flight as it takes); the rest
        # through buffers and `copy_`, in batches of about _BATCH_BYTES, so
        # that memory holds the state and one batch, not a second copy.
        direct: List[Tuple[ReadItem, Tuple[int, str, int, int], torch.Tensor, np.ndarray]] = []
        rest: List[Tuple[ReadItem, Tuple[int, str, int, int], Any, Optional[torch.Tensor]]] = []
        for item in items:
            piece, box = self._piece(item, self._where[item.storage_index])
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
        batch: List[Tuple[ReadItem, Tuple[int, str, int, int], Any, Optional[torch.Tensor]]] = []
        size = 0
        for entry in rest:
            batch.append(entry)
            size += entry[1][3]
            if size >= _BATCH_BYTES:
                self._load_batch(batch, planner)
                batch, size = [], 0
        self._load_batch(batch, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _load_batch(
        self, batch: List[Tuple[ReadItem, Tuple[int, str, int, int], Any, Optional[torch.Tensor]]], planner: LoadPlanner
    ) -> None:
        if not batch:
            return
        self._put(batch, self._fetch([piece for _, piece, _, _ in batch]), planner)

    def _put(
        self,
        batch: List[Tuple[ReadItem, Tuple[int, str, int, int], Any, Optional[torch.Tensor]]],
        datas: List[np.ndarray],
        planner: LoadPlanner,
    ) -> None:
        """Hand each item of `batch` its bytes `datas` (read for its piece)."""
        for (item, _, box, target), data in zip(batch, datas):
            if target is None:
                planner.load_bytes(item, io.BytesIO(data.tobytes()))
                continue
            dtype, lengths, strides = box
            source = _view(data, dtype, lengths, strides)
            if target.size() != source.size():
                raise ValueError(f"{item.storage_index.fqn}: sizes {target.size()} and {source.size()} differ")
            # Bytes read straight into the target's memory need no copy.
            if source.data_ptr() != target.data_ptr() or source.stride() != target.stride():
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
