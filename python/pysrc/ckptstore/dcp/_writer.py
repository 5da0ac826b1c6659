"""ckptstore.dcp's StorageWriter: each rank's write items as its shard
of a step of a target (`_targets`), the coordinator's commit naming
exactly the shards of the save."""

import dataclasses
import io
import os
import threading
import time
import weakref
from concurrent.futures import Future as _Staging
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Dict, Hashable, List, Optional, Tuple, Union

import numpy as np
import torch
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.futures import Future

from . import _document, _rank_local
from .._ckptstore import SaveRecord, ShardUpload, Tensor
from .._convert import step_number
from .._cost import Clock, SaveCost
from .._errors import StepExistsError
from ._document import Where
from ._choose import save_target
from ._targets import (
    METADATA, Put, SaveTarget, ShardWrite, Then, UserTarget, check_sendable,
    is_step_id,
)
from .._staging import Hashes, Pending, Pool, Staged, hashes_of

# The staged copies of async saves, reused by the next save to the same
# target once the one that used it is done (`StorageWriter.stage`).
_POOL = Pool()
# The thread that stages in the background (`background_staging=True`).
_STAGER = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-dcp-stage")


class _StagedState(dict):  # type: ignore[type-arg]
    """The staged state DCP saves: a dict, that can be watched for when
    DCP lets go of it (a weak reference)."""


class _Lent:
    """A staged copy lent to one save, given back to the pool once: when
    the save finishes in this process, or when DCP lets go of the staged
    state (in process mode the save finishes in DCP's process)."""

    def __init__(self, key: Hashable, copied: Any) -> None:
        self._key, self._copied = key, copied
        self._lock = threading.Lock()

    def give_back(self) -> None:
        with self._lock:
            copied, self._copied = self._copied, None
        if copied is not None:
            _POOL.give_back(self._key, copied)


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
    name = _document.json_dtype(t.dtype)
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    if name.startswith("torch."):
        # No safetensors name: its bytes (DCP's metadata keeps the dtype).
        return "U8", [int(flat.numel())], flat.numpy()
    return name, list(t.shape), flat.numpy()


class StorageWriter(_storage.StorageWriter):
    """Write a DCP checkpoint as step `step` of `target`: a bucket URL (any
    number of ranks) or a local store (a path or an open Store; one
    process). With `overwrite` (DCP's default, as in its FileSystemWriter)
    a save of a step already committed replaces it; without, it is refused
    (`StepExistsError` inside DCP's `CheckpointException`) before any rank
    writes.

    The ranks are those of the save (DCP's `process_group`, or the one
    process of `no_dist=True`): the coordinator numbers them from the plans
    it gathers and hands each its rank and the world size in its plan.

    Through `dcp.async_save(state, storage_writer=StorageWriter(...))`,
    the writer stages (see `stage`): with `background_staging` the copy
    runs on a thread of its own and `async_save` returns at once, an
    `AsyncSaveResponse` whose `staging_completion` says when the state may
    change again; with `block_on_staging` as well, it returns once the
    copy is made (`staging_completion` already resolved: for a loop that
    changes the state right away); with `shared_memory` new staged copies
    are made in shared memory, so that in DCP's process mode they reach
    its process without a copy. A device's tensors (a GPU's) are staged
    into pinned host memory kept for the next save, at most
    `staging_budget` bytes of it (and never more than the host has
    available: `StagingBudgetError` instead).

    `compress` (a bucket URL only; by default on for `s3://`, off for
    `file://`): the save's new chunks are stored compressed where that
    saves bytes (byte planes by the element width of each tensor, zstd,
    on the uploading thread's cores, never in the staging a training step
    waits for); such a step is bucket format 4, which builds before 0.5
    cannot read. Loads decompress either way."""

    def __init__(
        self,
        target: "UserTarget | SaveTarget",
        step: int,
        overwrite: bool = True,
        *,
        background_staging: bool = False,
        shared_memory: bool = False,
        block_on_staging: bool = False,
        staging_budget: Optional[int] = None,
        compress: Optional[bool] = None,
    ) -> None:
        super().__init__()
        self._target = target
        self._compress = None if compress is None else bool(compress)
        self._to = save_target(target, self._compress)
        self._step = step_number(step)
        self._overwrite = bool(overwrite)
        self._background = bool(background_staging)
        self._shared = bool(shared_memory)
        self._block = bool(block_on_staging)
        self._budget = staging_budget
        self._rank, self._world = 0, 1
        self._coordinator = True
        # A rank-local save's identity (`_rank_local`); None for a save
        # with collectives.
        self._save: Optional[str] = None
        self._kept: Dict[str, Any] = {}
        self._lent: Optional[_Lent] = None
        self._hashes: Hashes = {}
        # What this save costs (`cost`): its clock, from its staging or its
        # first write; the staging an earlier process measured (DCP's
        # process mode); bytes (new, deduplicated) it wrote.
        self._clock: Optional[Clock] = None
        self._staged: Optional[Tuple[float, float]] = None
        self._bytes = [0, 0]
        self.cost: Optional[SaveCost] = None

    def __getstate__(self) -> Dict[str, Any]:
        # Sent as its arguments (DCP's process mode sends the writer to
        # another process), where its target can be. The staged tensors go
        # with their hashes; DCP sends this writer in the same message as
        # the staged state, so they are the same objects there (pickle
        # keeps shared references).
        check_sendable(self, self._to)
        return {
            "target": self._target, "step": self._step, "overwrite": self._overwrite,
            "background_staging": self._background, "shared_memory": self._shared,
            "block_on_staging": self._block, "staging_budget": self._budget, "compress": self._compress,
            "hashes": list(self._hashes.values()),
            "staged": self._staged if self._clock is None else self._clock.staging,
        }

    def __setstate__(self, state: Dict[str, Any]) -> None:
        hashes = state.pop("hashes", [])
        staged = state.pop("staged", None)
        self.__init__(**state)  # type: ignore[misc]
        self.use_hashes({t.data_ptr(): (t, h) for t, h in hashes})
        self._staged = staged

    def use_hashes(self, hashes: Hashes) -> None:
        """The hashes of the chunks of a state staged elsewhere (by data
        pointer), which the save uses in place of hashing them again."""
        self._hashes = dict(hashes)

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self._step = step_number(checkpoint_id)
        self._kept = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """A checkpoint id is a step number."""
        return is_step_id(checkpoint_id)

    # DCP's AsyncStager: `dcp.async_save(state, storage_writer=...)` stages
    # through the writer.

    _synchronize_after_execute = True

    @property
    def should_synchronize_after_execute(self) -> bool:
        return True

    def stage(self, state_dict: Dict[str, Any]) -> Union[Dict[str, Any], "_Staging[Dict[str, Any]]"]:
        """A copy of `state_dict` in host memory that changes to the state
        leave alone, made into the memory of the copy an earlier async save
        to the same target (in this process) used, once that save is done
        with it: a state of the same layout needs no new memory, and the
        process keeps one staged copy per target between saves (in DCP's
        process mode too: a copy is free again once DCP's process has
        saved it). The bytes of host tensors are copied on every core and
        hashed in the same pass; the save writes them without reading them
        again. A device's tensors are copied on its side stream, after the
        work queued before the call. With `background_staging`, a future
        of the copy: the caller may change the state once it is done."""
        self._clock = Clock()
        started = time.perf_counter()
        key = (os.getpid(), self._to.pool_key)
        staging = _POOL.begin(key, state_dict, shared=self._shared, budget=self._budget)
        if self._background:
            begun = time.perf_counter() - started
            done = _STAGER.submit(self._staged_now, key, staging, started, None if self._block else begun)
            if self._block:
                wait([done])
            return done
        return self._staged_now(key, staging, started, None)

    def _staged_now(self, key: Hashable, staging: Pending, started: float, blocked: Optional[float]) -> Dict[str, Any]:
        """The staged state, once `staging` is done; `blocked`: how long
        the caller waited, if not until now."""
        copy: Staged = staging.finish()  # a failure gives the copy back
        out = _StagedState(copy.state)
        self._lent = _Lent(key, copy.state)
        weakref.finalize(out, self._lent.give_back)
        self._hashes = copy.hashes
        seconds = time.perf_counter() - started
        assert self._clock is not None
        self._clock.staged(seconds, seconds if blocked is None else blocked)
        return out

    def synchronize_staging(self) -> None:
        """Nothing to wait for here: `stage` copies before it returns, or
        (`background_staging`) returns the future of its copy."""

    def close(self) -> None:
        """Nothing to release."""

    def _give_back(self) -> None:
        """This save is done with its staged copy: the next may reuse it."""
        if self._lent is not None:
            self._lent.give_back()
            self._lent = None
        self._hashes = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = is_coordinator
        self._save = None
        if kwargs.get("use_collectives", True) is False:
            self._set_up_rank_local(kwargs.get("rank"))

    def _set_up_rank_local(self, dcp_rank: Any) -> None:
        """A rank-local save (`use_collectives=False`) of every rank of the
        default process group: this rank's place and the save's identity,
        agreed without a collective. One process saving alone is an
        ordinary save."""
        rank, world = _rank_local.world()
        if world == 1:
            return
        if not self._to.takes_rank_local:  # the tier keeps its own protocol
            raise NotImplementedError(
                f"a rank-local save (use_collectives=False) of {world} ranks to {self._to.description} "
                "is not supported: save with use_collectives=True, or to a bucket URL"
            )
        if dcp_rank is not None and int(dcp_rank) != rank:
            raise ValueError(
                f"a rank-local save over a group of some ranks (rank {dcp_rank} of the save, {rank} of "
                f"the job): the step is whole only with every rank of the job's {world}"
            )
        self._rank, self._world = rank, world
        self._save = _rank_local.save_identity(self._to.pool_key, self._step)

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=str(self._step))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        # A rank-local save plans on each rank alone: its place is its
        # rank in the job, not in the plans.
        local = self._save is not None
        world = self._world if local else len(plans)
        if not self._to.many_ranks and world > 1:
            raise ValueError(
                f"a local store takes one process; {world} ranks save to a bucket URL "
                "(s3://... or file://...)"
            )
        if not self._overwrite and self._to.committed(self._step):
            # DCP's own writer's words, which code written against it checks.
            raise StepExistsError(
                f"Checkpoint already exists and self.overwrite=False: step {self._step} is already in "
                f"{self._to.description}; StorageWriter(..., overwrite=True) replaces it"
            )
        if local:
            return [dataclasses.replace(plans[0], storage_data=(self._rank, world))]
        # Each rank's place in this save and its size, from the plans DCP
        # gathered (the save's group, whatever it is).
        return [dataclasses.replace(p, storage_data=(i, world)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[_storage.WriteResult]]":
        if isinstance(plan.storage_data, tuple):
            self._rank, self._world = plan.storage_data
        if self._clock is None:
            self._clock = Clock(staging=self._staged)
        values: Dict[str, Any] = {}
        written = [self._resolve(item, planner, values) for item in plan.items]
        shard = ""
        if self._coordinator or self._save is not None:
            # Its shard is put with the metadata by finish (every rank's,
            # in a rank-local save); its data now, where the target takes
            # it ahead, beside the other ranks' (finish then finds it
            # there). A save of one rank, or a rank-local save, has no one
            # to put beside: its data is hashed and put once, by finish.
            self._kept = values
            if self._world > 1 and self._save is None:
                self._put(values, ShardUpload.ChunksOnly())
        else:
            shard = self._put(values, ShardUpload.Manifest())
            self._give_back()
            self._done()
        # Every rank reports its shard, also a rank with no items.
        written.append((MetadataIndex(fqn=f"\0ckptstore.rank.{self._rank}"), 0, ""))
        results = [
            _storage.WriteResult(index, size, Where(self._rank, name, shard))
            for index, size, name in written
        ]
        fut: Future[List[_storage.WriteResult]] = Future()
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
        assert isinstance(data, torch.Tensor)
        dtype, shape, array = _host_bytes(data)
        values[name] = Tensor(dtype, shape, array, hashes_of(self._hashes, data))
        return item.index, int(array.size), name

    def _put(self, values: Dict[str, Any], then: Then, record: Optional[SaveRecord] = None) -> str:
        """Put this rank's shard of `values` to the target as far as `then`
        says, counting what it wrote; the shard's name."""
        put: Put = self._to.put(ShardWrite(self._step, self._rank, self._world, values, then, record, self._overwrite))
        self._bytes[0] += put.bytes_new
        self._bytes[1] += put.bytes_reused
        return put.shard

    def _record(self) -> Optional[SaveRecord]:
        return None if self._clock is None else self._clock.record()

    def _done(self) -> None:
        """This rank's part is durable: its `cost`."""
        clock = self._clock or Clock()
        self.cost = clock.cost(self._step, self._bytes[0], self._bytes[1])

    def finish(self, metadata: Metadata, results: List[List[_storage.WriteResult]]) -> None:
        storage, shards, sizes = fold(results, self._world)
        metadata.storage_data = storage
        values = dict(self._kept)
        self._kept = {}
        if self._save is not None:
            # This rank's metadata (its own items), in its own shard.
            values[_rank_local.RANK_METADATA] = _document.to_json(metadata)
            self._put(values, ShardUpload.RankLocal(save=self._save), self._record())
        else:
            values[METADATA] = _document.to_json(metadata)
            values.update(self._to.layout_entries(sizes))
            # The names came from each rank once its upload returned (the
            # gather above, of this save): trusted, no shard read again.
            self._put(values, ShardUpload.CommitReported(shards=shards), self._record())
        self._give_back()
        self._done()

def fold(
    results: List[List[_storage.WriteResult]], world: int
) -> Tuple[Dict[MetadataIndex, Where], List[str], List[Dict[str, int]]]:
    """Every rank's write results: where each item is stored (DCP's
    `storage_data`), each rank's shard by rank, and each rank's entry
    sizes by rank."""
    shards: List[str] = [""] * world
    storage: Dict[MetadataIndex, Where] = {}
    sizes: List[Dict[str, int]] = [{} for _ in range(world)]
    for per_rank in results:
        for r in per_rank:
            where = r.storage_data
            if not 0 <= where.rank < world:
                raise ValueError(f"a write result names rank {where.rank} of a save of {world}")
            if where.entry:
                storage[r.index] = where
                sizes[where.rank][where.entry] = int(r.size_in_bytes)
            else:
                shards[where.rank] = where.shard
    return storage, shards, sizes
