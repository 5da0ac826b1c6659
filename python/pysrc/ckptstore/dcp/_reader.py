"""ckptstore.dcp's StorageReader: one load reads one save of a step of
a target (`_targets`), and of it the boxes its ranks take, in reads of
neighbouring bytes; at several ranks, each byte once (`stripes._run`)."""

import dataclasses
import io
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from . import _rank_local

from .stripes import _plan, _run
from .._ckptstore import dcp_box_span
from .._convert import step_number
from ._document import Where
from ._choose import load_target
from ._targets import LoadTarget, Opened, Piece, UserTarget, check_sendable, is_step_id
from ._wire import DEFAULT_TIMEOUT, Group

# A read item, the bytes it reads, the stored box they hold (dtype,
# lengths, strides; None for bytes) and the tensor they go into (None for
# bytes).
Planned = Tuple[ReadItem, Piece, Any, Optional[torch.Tensor]]


class StorageReader(_storage.StorageReader):
    """Read a DCP checkpoint from step `step` of `target` (the latest
    complete step if None, resolved again at each load).

    One load reads one save: each rank opens the step on its own (DCP
    reads metadata on every rank before its first collective), the
    coordinator's step and commit go to every rank in its plan, and a rank
    that opened another commit (the step saved again meanwhile, or a newer
    latest) reads the coordinator's instead, or fails the load if that
    save's layout differs from the one it planned with.

    With `fan_out` (the default), a load at several ranks reads each byte
    of the target once: the coordinator gives each stripe of the bytes
    the ranks need to one rank, which reads it and hands it to the others
    (`stripes._run`), over a gloo group of the reader's own, made by every
    rank at its first such load (`timeout`: its collectives' timeout,
    `DEFAULT_TIMEOUT` if None; the local tier's loads use the tier's
    group, a stripe of a shard read by a rank that holds it). That needs DCP's process group to be the
    whole job (a load over a group of some ranks reads as without it);
    a load at one rank and a `no_dist` load read as without it.
    `fan_out=False`: every rank reads what it needs itself, and the load
    waits on no collective but DCP's.

    A step saved rank-locally (`dcp.save(..., use_collectives=False)`)
    loads at the world size it was saved at rank-locally: each rank plans
    from the metadata it saved and reads only its own shard (a state
    sharded otherwise than when saved is refused; `rank_local=False`
    loads it as at any other world size: every rank reads every rank's
    metadata, the global view, and the load is striped).

    `process_group`: the group `dcp.load` runs over (`dist.group.WORLD`
    for the default group). Given, each load makes one `all_gather_object`
    over it as its ranks open the step (a rank that fails to open it
    fails the load on every rank there), and a load of a rank-local step
    at another world size reads each saved rank's metadata once, on one
    rank of the group, which hands it on in that exchange; without it,
    every rank reads every saved rank's metadata. DCP hands a reader no
    group, and a collective over another group than the load's would
    wait on processes that are not loading: hence the keyword. A reader
    sent to another process goes without it."""

    def __init__(
        self,
        target: "UserTarget | LoadTarget",
        step: Optional[int] = None,
        *,
        fan_out: bool = True,
        timeout: Optional[timedelta] = None,
        rank_local: bool = True,
        process_group: "Optional[dist.ProcessGroup]" = None,
    ) -> None:
        super().__init__()
        self._target = target
        self._from = load_target(target)
        self._fan_out, self._timeout, self._rank_local = fan_out, timeout, bool(rank_local)
        if process_group is not None and dist.get_rank(process_group) < 0:
            raise ValueError("StorageReader: this process is not a member of the process_group given")
        self._process_group = process_group
        self._group: Optional[Group] = None
        self._step = None if step is None else step_number(step)
        self._resolved: Optional[int] = None
        self._commit: Optional[str] = None
        self._opened: Optional[Opened] = None
        self._where: Dict[MetadataIndex, Where] = {}
        self._metadata: Any = None
        # What the load plans from (`_rank_local.load_metadata`).
        self._loaded: Optional[_rank_local.LoadedMetadata] = None

    def __getstate__(self) -> Dict[str, Any]:
        # Sent as its arguments, where its target can be.
        check_sendable(self, self._from)
        return {
            "target": self._target, "step": self._step, "fan_out": self._fan_out, "timeout": self._timeout,
            "rank_local": self._rank_local,
        }

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self._step = step_number(checkpoint_id)
        self._resolved = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """A checkpoint id is a step number."""
        return is_step_id(checkpoint_id)

    @property
    def step(self) -> Optional[int]:
        """The step being read (once `read_metadata` resolved it)."""
        return self._resolved

    # No `rank=`/`**kwargs`: DCP would retry a failed read rank-locally and
    # leave that rank out of the collectives the others wait in. (A
    # rank-local save loaded at its own world size is read rank-locally
    # all the same: each rank from its own metadata, `_rank_local`.)
    def read_metadata(self) -> Metadata:
        group = self._process_group
        if group is not None and dist.get_world_size(group) > 1:
            saved, docs = self._open_together(group)
        else:
            saved, docs = self._open(self._step, None), None
        self._load(saved, docs)
        metadata: Metadata = self._metadata
        return metadata

    def _open(self, step: Optional[int], commit: Optional[str]) -> _rank_local.SavedMetadata:
        """Open `step` (exactly `commit`, if given; the newest complete
        step if None); its saved metadata as this rank reads it."""
        self._resolved, self._commit, self._opened, self._loaded = step, None, None, None
        self._opened = self._from.open(step, commit)
        self._resolved, self._commit = self._opened.step, self._opened.commit
        return self._opened.saved_metadata(_rank_local.world()[0])

    def _load(self, saved: _rank_local.SavedMetadata, docs: Optional[List[bytes]]) -> None:
        """Plan from `saved` (`_rank_local.load_metadata`; `docs`: every
        saved rank's document, where handed on)."""
        def every_rank() -> List[bytes]:
            return docs if docs is not None else [self._doc_of(r, saved) for r in range(saved.world)]

        self._loaded = _rank_local.load_metadata(saved, self._rank_local, every_rank)
        self._where = self._loaded.metadata.storage_data
        self._metadata = self._loaded.metadata

    def _open_together(self, group: "dist.ProcessGroup") -> Tuple[_rank_local.SavedMetadata, Optional[List[bytes]]]:
        """Open the step on every member of the load's group (`process_group`):
        each reads its part of the saved ranks' metadata where the step is a
        rank-local save read whole (saved rank r by member r modulo the
        group's size) and joins one exchange, which hands the parts on
        and a member's failure to every member."""
        me, size = dist.get_rank(group), dist.get_world_size(group)
        saved: Optional[_rank_local.SavedMetadata] = None
        part: Dict[int, bytes] = {}
        failure: Optional[BaseException] = None
        try:
            saved = self._open(self._step, None)
            if saved.read_whole(self._rank_local):
                part = {r: self._doc_of(r, saved) for r in range(me, saved.world, size)}
        except Exception as e:  # noqa: BLE001 (handed to every member)
            failure = e
        what = f"opening step {self._resolved} of {self._from.description}"
        world = saved.world if saved is not None and saved.kind is _rank_local.SaveKind.RANK_LOCAL else 0
        docs = _rank_local.hand_on(group, (self._resolved, self._commit), world, part, failure, what)
        assert saved is not None  # else hand_on raised the failure
        return saved, docs

    def _doc_of(self, rank: int, saved: _rank_local.SavedMetadata) -> bytes:
        """Saved rank `rank`'s metadata document of the rank-local save `saved`."""
        assert self._opened is not None
        return saved.document if rank == saved.own_rank() else self._opened.rank_document(rank)

    def _own(self) -> bool:
        """Whether each rank plans from its own metadata and reads only its
        own shard (a rank-local save at its own world size)."""
        return self._loaded is not None and self._loaded.own

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._where = metadata.storage_data
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Which save this rank planned from, for the coordinator to tell a
        # re-save with another layout from its own.
        return dataclasses.replace(plan, storage_data=(self._resolved, self._commit))

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        # The coordinator's save is the load's: every rank reads it; and,
        # fanned out, the stripes each rank reads and hands on.
        fans: List[Optional[_plan.FanPlan]] = [None] * len(plans)
        try:
            # A rank-local read: each rank reads its own shard itself.
            if not self._own() and self._fans_out(len(plans)):
                needs = [[self._piece(i, self._where[i.storage_index])[0] for i in p.items] for p in plans]
                fans = [fan for fan in _plan.plan(needs, self._from.readers, self._from.nodes)]
        except (KeyError, ValueError) as e:
            if all(p.storage_data == (self._resolved, self._commit) for p in plans):
                raise
            # A rank planned from another save of the step, of another
            # layout: refused on every rank (DCP scatters this failure).
            raise RuntimeError(self._resaved()) from e
        return [
            dataclasses.replace(p, storage_data=(self._resolved, self._commit, fan)) for p, fan in zip(plans, fans)
        ]

    def _resaved(self) -> str:
        return (
            f"step {self._resolved} of {self._from.description} was saved again while this load "
            "opened it, with another layout: load again"
        )

    def _fans_out(self, world: int) -> bool:
        """Whether a load at `world` ranks (DCP's) reads each byte once."""
        whole_job = dist.is_available() and dist.is_initialized() and dist.get_world_size() == world
        return self._fan_out and world > 1 and whole_job and self._from.fans_out

    def _follow(self, chosen: Any) -> None:
        """Read the coordinator's save `chosen` (step, commit, ...) if this
        rank opened another; refuse one whose layout is not the one planned."""
        if not isinstance(chosen, tuple) or chosen[:2] == (self._resolved, self._commit):
            return
        planned = self._metadata.state_dict_metadata
        step, commit = chosen[:2]
        self._load(self._open(step, commit), None)
        if self._metadata.state_dict_metadata != planned:
            raise RuntimeError(self._resaved())

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        # This rank's reads are planned before the target reads them, also
        # where planning failed: a target with collectives of its own
        # (the tier's) raises the failure after them, on every rank.
        batch: List[Planned] = []
        dest: Dict[int, np.ndarray] = {}
        failure: Optional[BaseException] = None
        try:
            if self._loaded is not None and self._loaded.own:
                _rank_local.check_covered(plan, planner, self._loaded.metadata, self._from.description)
            batch, dest = self._plan(plan, planner)
        except Exception as e:  # noqa: BLE001 (raised by the target's read)
            failure = e
        fan = plan.storage_data[2] if isinstance(plan.storage_data, tuple) else None
        what = f"loading step {self._resolved} of {self._from.description}"
        if self._opened is None:
            failure = failure or RuntimeError("read_data before read_metadata")
            if fan is not None:
                # The others wait in the striped exchange: its first
                # collective raises this failure on every rank.
                self._joined().check(failure, what)
            raise failure
        pieces = [piece for _, piece, _, _ in batch]
        deliver = lambda i, data: self._put([batch[i]], [data], planner)  # noqa: E731
        if fan is None:
            self._opened.read(pieces, dest, deliver, failure)
        else:
            _run.run(self._joined(), self._opened, fan, pieces, dest, deliver, failure, what)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _joined(self) -> Group:
        """The target's group, else the load's own group of every rank
        (made at its first fanned out load: a collective every rank makes,
        all having the same plan)."""
        if self._from.group is not None:
            return self._from.group
        if self._group is None:
            wait = DEFAULT_TIMEOUT if self._timeout is None else self._timeout
            self._group = Group(dist.new_group(backend="gloo", timeout=wait), dist.get_rank(), dist.get_world_size())
        return self._group

    def _plan(self, plan: LoadPlan, planner: LoadPlanner) -> Tuple[List[Planned], Dict[int, np.ndarray]]:
        """What each read item reads, in the order the shards store their
        entries (by rank, then name: neighbouring bytes are read together);
        and, by item, the target's memory where its piece lands as it is
        stored (a plain contiguous CPU tensor of its dtype and size), read
        straight into place, no copy held."""
        self._follow(plan.storage_data)
        items = sorted(plan.items, key=lambda i: (self._where[i.storage_index].rank, self._where[i.storage_index].entry))
        batch: List[Planned] = []
        dest: Dict[int, np.ndarray] = {}
        for i, item in enumerate(items):
            piece, box = self._piece(item, self._where[item.storage_index])
            target = None if item.type == LoadItemType.BYTE_IO else planner.resolve_tensor(item).detach()
            batch.append((item, piece, box, target))
            memory = None if target is None else memory_of(target, piece, box)
            if memory is not None:
                dest[i] = memory
        return batch, dest

    def _put(
        self,
        batch: List[Planned],
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

    def _length(self, where: Where) -> int:
        assert self._opened is not None
        return self._opened.length(where.rank, where.entry)

    def _piece(self, item: ReadItem, where: Where) -> Tuple[Piece, Any]:
        if item.type == LoadItemType.BYTE_IO:
            return (where.rank, where.entry, 0, self._length(where)), None
        # The stored chunk's dtype and sizes, from DCP's metadata.
        index = item.storage_index
        md = self._metadata.state_dict_metadata[index.fqn]
        chunk = next(c for c in md.chunks if list(c.offsets) == list(index.offset or []))
        dtype = md.properties.dtype
        itemsize = torch.empty(0, dtype=dtype).element_size()
        offsets, lengths = list(item.storage_offsets), list(item.lengths)
        span = dcp_box_span(list(chunk.sizes), offsets, lengths, itemsize)
        if span is None or (span.len and span.start + span.len > self._length(where)):
            raise ValueError(f"{index.fqn}: the box {offsets}+{lengths} is outside its stored chunk")
        return (where.rank, where.entry, span.start, span.len), (dtype, lengths, span.strides)


def memory_of(target: torch.Tensor, piece: Piece, box: Any) -> Optional[np.ndarray]:
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


def _view(data: np.ndarray, dtype: torch.dtype, lengths: List[int], strides: List[int]) -> torch.Tensor:
    """The box `lengths` of a row-major tensor with `strides` (elements),
    from `data`, the bytes from its first element to its last."""
    if any(n == 0 for n in lengths) or data.size == 0:
        return torch.empty(lengths, dtype=dtype)
    flat = torch.frombuffer(data, dtype=dtype)
    return flat.as_strided(lengths, strides)
