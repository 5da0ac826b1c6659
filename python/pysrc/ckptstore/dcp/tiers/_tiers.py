"""`ckptstore.dcp.Tiers`: a job's checkpoints on each node's own disk,
with copies on peer nodes, over a bucket."""

import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from ..._convert import step_number
from ..._errors import Error
from ..._store import Store
from ..._store import open as open_store
from .._reader import StorageReader
from .._writer import StorageWriter
from .._targets import METADATA, is_bucket_url, remote_of
from ._layout import Record, TierDir, Topology, kept_steps, node_directory, records_in, write_record
from ._load import (
    Choice, Holding, MapOf, ReadOf, ShardsLost, TierSource, choose, chunk_map_held, layout_of, read_held, refusals
)
from ..._staging import Hashes, Pool
from ..._cost import Clock, SaveCost
from ._save import SIZES, TierShard, agree, record_of, send_copies
from .._wire import DEFAULT_TIMEOUT, Group, TierFailure, attempt, described, failed_future


class Tiers:
    """Checkpoints of a job of many ranks on each node's own disk (`local`,
    the same string on every node; `{node}` in it is replaced by the
    node's index), each rank's shard copied to `peers` ranks on other
    nodes, and every `durable_every`-th save uploaded to `bucket` (a URL;
    None keeps only the local tier) in the background as a global step.
    The local tier keeps the newest `keep_local` complete steps. Node `i`
    holds ranks `i*k .. i*k+k-1`, `k` being `ranks_per_node` (default
    `LOCAL_WORLD_SIZE`, set by torchrun, else 1).

    Each rank keeps its own store in its node's directory
    (`rank-RRRRR.ckpt`) and one per rank whose copies it keeps
    (`copies-of-RRRRR.ckpt`); a step is complete once every rank has
    written its record of it (`records/`), which it does only after every
    shard and copy is durable. The constructor and `save`, `async_save`,
    `load` are collectives: every rank calls them, in the same order. The
    ranks talk over two gloo groups of the tier's own (made here, with
    `timeout`), never the job's, so training's collectives and a
    background save or upload never meet. With `background_staging`,
    `async_save` returns before its copy is made (see there).
    `uploaded(step)` is called on every rank, on the upload thread, once
    each step is whole in the bucket (the place for the bucket's
    retention: what it counts has landed); an exception it raises fails
    that upload. docs/tiers.md has the details."""

    def __init__(
        self,
        local: "str | os.PathLike[str]",
        bucket: Optional[str] = None,
        peers: int = 1,
        durable_every: int = 1,
        keep_local: int = 2,
        ranks_per_node: Optional[int] = None,
        *,
        timeout: Optional[timedelta] = None,
        background_staging: bool = False,
        uploaded: Optional[Callable[[int], None]] = None,
    ) -> None:
        for name, value, least in (("peers", peers, 0), ("durable_every", durable_every, 1), ("keep_local", keep_local, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"Tiers({name}={value!r}): an integer of at least {least}")
        if bucket is not None and not is_bucket_url(str(bucket)):
            raise ValueError(f"Tiers(bucket={bucket!r}): a bucket URL (s3://... or file://...)")
        self._bucket = None if bucket is None else str(bucket)
        self._peers, self._every, self._keep = peers, durable_every, keep_local
        self._background = bool(background_staging)
        self._uploaded = uploaded
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            wait = DEFAULT_TIMEOUT if timeout is None else timeout
            self._group = Group(dist.new_group(backend="gloo", timeout=wait), rank, world)
            self._uploads = Group(dist.new_group(backend="gloo", timeout=wait), rank, world)
        else:
            self._group = self._uploads = Group(None, 0, 1)
        per_node = ranks_per_node if ranks_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if per_node < 1:
            raise ValueError(f"Tiers(ranks_per_node={per_node}): at least 1")
        self._topology = Topology(self._group.world, per_node)
        self._rank = self._group.rank
        self._dir = node_directory(os.fspath(local), self._topology.node_of(self._rank))
        self._tier = TierDir(self._dir)
        os.makedirs(self._dir, exist_ok=True)
        others = self._topology.nodes - 1
        if peers > others and self._rank == 0:
            warnings.warn(
                f"ckptstore.dcp.Tiers: peers={peers} but the job has {others} other node(s): "
                + ("a single node keeps no copies" if others == 0 else f"copies go to {others}"),
                stacklevel=2,
            )
        self._stores: Dict[str, Store] = {}
        self._lock = threading.Lock()
        self._work = threading.Lock()
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-tiers-save")
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-tiers-stage")
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-tiers-upload")
        self._running: List["Future[Any]"] = []
        self._saves = 0
        self._pool = Pool()

    @property
    def directory(self) -> str:
        """This node's directory of the local tier."""
        return self._dir

    def save(self, state: Dict[str, Any], step: int) -> SaveCost:
        """Save `state` (a DCP state dict) as step `step`: returns once the
        step is complete on the local tier (its upload, if due, goes on in
        the background), with what the save cost this rank."""
        self._check()
        fut = self._submit(_state_dicts(state), step_number(step), Clock(), None)
        try:
            cost = fut.result()
        finally:
            # Its failure is raised here, not again by the next call.
            with self._work:
                self._running = [f for f in self._running if f is not fut]
        return cost

    def async_save(self, state: Dict[str, Any], step: int) -> AsyncSaveResponse:
        """Save `state` as step `step` in the background, as DCP's
        `async_save` does: `staging_completion` is done once the state was
        copied to host memory (it may change from then on; a GPU's tensors
        are copied on a side stream after the work queued before the
        call): when the call returns, or later with the tier's
        `background_staging`; `upload_completion` when the step is
        complete on the local tier; its result is the save's `SaveCost`.
        A failure is raised by those futures and by the next `save`,
        `async_save`, `load` or `wait`. The host copy is kept and reused by the next `async_save`
        once this save is done (no new memory for a state of the same
        layout): a tier holds one staged copy of the state between saves
        (`close` frees it)."""
        self._check()
        clock, step = Clock(), step_number(step)
        try:
            staging, copy = self._pool.in_background(
                None, _state_dicts(state), self._stager,
                lambda begun: clock.staged(
                    time.perf_counter() - clock.started, begun - clock.started if self._background else None
                ),
            )
        except Exception as e:  # noqa: BLE001 - told to every rank by the save
            staging, copy = failed_future(e), failed_future(e)
        if not self._background:
            staging.exception()  # done; a failure reaches every rank through the save

        def save_now() -> SaveCost:
            copied, failed = attempt(copy.result)
            if copied is None:
                # This rank could not stage its state: the save's first
                # collective fails it on every rank.
                assert failed is not None
                return self._save_now({}, step, clock, None, failed)
            try:
                return self._save_now(copied.state, step, clock, copied.hashes)
            finally:  # free for the next async_save
                self._pool.give_back(None, copied.state)

        durable = self._saver.submit(save_now)  # in order with the saves before and after
        with self._work:
            self._running.append(durable)
        # DCP types its future as Future[None]; its result here is the SaveCost.
        return AsyncSaveResponse(staging_completion=staging, upload_completion=durable)  # type: ignore[arg-type]

    def wait(self) -> None:
        """Wait for every save and upload in flight; raise the first that
        failed."""
        while True:
            with self._work:
                first = self._running[0] if self._running else None
            if first is None:
                return
            first.exception()
            self._check()

    def close(self) -> None:
        """`wait`, then close the stores (the tier cannot be used again)."""
        try:
            self.wait()
        finally:
            self._saver.shutdown()
            self._stager.shutdown()
            self._uploader.shutdown()
            self._close_stores()
            self._pool.clear(None)

    def __enter__(self) -> "Tiers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(
        self, state: Dict[str, Any], step: int, clock: Clock, hashes: Optional[Hashes]
    ) -> "Future[SaveCost]":
        fut = self._saver.submit(self._save_now, state, step, clock, hashes)
        with self._work:
            self._running.append(fut)
        return fut

    def _check(self) -> None:
        """Forget finished work; raise the first failure among it."""
        with self._work:
            done = [f for f in self._running if f.done()]
            self._running = [f for f in self._running if not f.done()]
        for f in done:
            e = f.exception()
            if e is not None:
                raise e

    def _store(self, path: str) -> Store:
        """The store at `path`, kept open; opened again if its file is gone
        (a node's directory emptied under the job)."""
        with self._lock:
            found = self._stores.get(path)
            if found is not None and not os.path.exists(path):
                found.close()
                found = None
            if found is None:
                found = self._stores[path] = open_store(path)
            return found

    def _close_stores(self) -> None:
        with self._lock:
            stores, self._stores = self._stores, {}
        for s in stores.values():
            s.close()

    # The save (on the save thread).

    def _save_now(
        self,
        state: Dict[str, Any],
        step: int,
        clock: Clock,
        hashes: Optional[Hashes],
        failed: Optional[BaseException] = None,
    ) -> SaveCost:
        """Save `state` as `step` on every rank together; `failed`: this
        rank could not stage it (every rank raises)."""
        with self._group.on(f"save of step {step}"):
            return self._save(state, step, clock, hashes, failed)

    def _save(
        self,
        state: Dict[str, Any],
        step: int,
        clock: Clock,
        hashes: Optional[Hashes],
        staging: Optional[BaseException],
    ) -> SaveCost:
        topo, rank, group = self._topology, self._rank, self._group

        def prepare() -> Tuple[Store, Dict[Tuple[int, int], Record]]:
            if staging is not None:
                raise staging
            os.makedirs(self._dir, exist_ok=True)  # a node's disk may have been replaced
            own = self._store(self._tier.store_path("own", rank))
            # This rank vouches no more for an older save of the step.
            self._tier.remove_record(step, rank)
            # The directory, read once for this save (its order, retention).
            return own, records_in(self._tier, rank)

        # A failure on any rank fails the save on every rank, here or in
        # DCP's exchange or in `agree`, never leaving the others waiting.
        prepared, failed = attempt(prepare)
        group.check(failed, f"step {step} was not saved on the local tier")
        assert prepared is not None
        own, records = prepared
        newest = max((r.seq for r in records.values()), default=0)
        shard = TierShard(own)
        writer = StorageWriter(shard, step)
        writer.use_hashes(hashes or {})
        dcp_save(state, storage_writer=writer, process_group=group.group, no_dist=group.group is None)
        copy_digests: Dict[int, str] = {}
        infos = [shard.info] if shard.info is not None else []

        def copy() -> None:
            copies = send_copies(group, topo.sources(rank, self._peers), topo.holders(rank, self._peers), shard.values)
            for src, values in copies.items():
                store = self._store(self._tier.store_path("copy", src))
                infos.append(store.save(step, values, replace=True))
                copy_digests[src] = store.content_digest(step) or ""

        _, failed = attempt(copy)
        shard.values = {}
        digest, failure = "", "" if failed is None else described(failed)
        if failed is None:
            found, failed = attempt(lambda: own.content_digest(step) or "")
            digest, failure = found or "", "" if failed is None else described(failed)
        digests, saved_at, seq = agree(group, step, digest, copy_digests, failure, newest)
        self._saves += 1
        upload = self._bucket is not None and self._saves % self._every == 0
        # Every shard and copy is durable: the save's cost, kept in the record.
        cost = clock.cost(step, sum(i.bytes_written for i in infos), sum(i.bytes_reused for i in infos))
        holders = [topo.holders(src, self._peers) for src in range(topo.world)]
        record = record_of(step, saved_at, topo.per_node, digests, holders, upload, cost, seq)
        # Every rank returns or every rank raises: a rank that cannot
        # record the save (or apply retention after it) fails the call on
        # every rank, and nothing is uploaded. The save is complete all the
        # same where its record was written.
        def finish() -> None:
            write_record(self._tier, rank, record)
            self._retain({**records, record.key: record})

        _, failed = attempt(finish)
        group.check(failed, f"step {step} is durable on every rank, but some rank could not record it")
        if upload:
            with self._work:
                self._running.append(self._uploader.submit(self._upload_pending))
        return cost

    def _retain(self, records: Dict[Tuple[int, int], Record]) -> None:
        """Keep the `keep_local` complete saves made last among this rank's
        `records` (in the order of saves, not of step numbers: the save
        that just completed is always kept) and those still to be
        uploaded; remove every other step from this rank's stores."""
        keep = kept_steps(self._tier, list(records.values()), self._keep)
        paths = [self._tier.store_path("own", self._rank)]
        paths += [self._tier.store_path("copy", src) for src in self._topology.sources(self._rank, self._peers)]
        for path in paths:
            if not os.path.exists(path):
                continue
            store = self._store(path)
            for s in store.steps():
                if s not in keep:
                    store.remove(s)
        for step, _ in records:
            if step not in keep:
                self._tier.remove_record(step, self._rank)

    # Uploads to the bucket (on the upload thread, over the upload group).

    def _upload_pending(self) -> None:
        """Upload every complete step due for the bucket and not there yet
        that every rank still holds, oldest first."""
        def pending() -> Tuple[Store, Dict[Tuple[int, int], Any], List[Tuple[int, int]]]:
            own = self._store(self._tier.store_path("own", self._rank))
            records = records_in(self._tier, self._rank)
            keys = sorted(
                key
                for key, r in records.items()
                if r.upload
                and r.world_size == self._topology.world
                and not self._tier.in_bucket(r.key)
                and own.content_digest(r.step) == r.digests[self._rank]
            )
            return own, records, keys

        found, failed = attempt(pending)
        with self._uploads.on("uploads due"):
            self._uploads.check(failed, "uploading to the bucket")
        assert found is not None
        own, records, keys = found
        agreed = set.intersection(*(set(map(tuple, p)) for p in self._uploads.gather(keys)))
        for key in sorted(agreed):
            self._upload(records[key], own)

    def _upload(self, record: Any, own: Store) -> None:
        assert self._bucket is not None
        remote = None
        shard, failure = "", ""
        try:
            remote = remote_of(self._bucket)
            # Read and uploaded in Rust, less the tier's own entry; a save
            # of 0.4.0 has DCP's metadata in its record.
            extra = {METADATA: record.metadata.encode()} if self._rank == 0 and record.metadata is not None else {}
            shard = remote.upload_shard_from(own, record.step, self._rank, record.world_size, [SIZES], extra).shard
        except Exception as e:  # noqa: BLE001 - told to every rank
            failure = f"rank {self._rank}: {described(e)}"
        told = self._uploads.gather((shard, failure))
        if remote is not None and self._rank == 0 and not any(f for _, f in told):
            try:
                remote.commit_global(record.step, [s for s, _ in told])
            except Exception as e:  # noqa: BLE001 - told to every rank
                failure = f"committing: {described(e)}"
        failures = [f for _, f in told if f] + [self._uploads.broadcast(failure if self._rank == 0 else "", 0)]
        failures = [f for f in failures if f]
        if failures:
            raise RuntimeError(f"step {record.step} was not uploaded to {self._bucket}: " + "; ".join(dict.fromkeys(failures)))
        self._tier.mark_in_bucket(record.key)
        if self._uploaded is not None:
            self._uploaded(record.step)

    # The load.

    def load(self, state: Dict[str, Any], step: Optional[int] = None) -> int:
        """Restore `state` (a DCP state dict, loaded in place) from step
        `step` (the newest complete one if None): from the local tier if
        the surviving ranks' stores hold every shard of it (each rank
        reading its own, or from the rank holding it or its copy), else
        from the bucket, with a warning that says why. The step restored."""
        self.wait()
        self._close_stores()
        wanted = None if step is None else step_number(step)
        with self._group.on("load of the newest step" if wanted is None else f"load of step {wanted}"):
            return self._load(state, wanted)

    def _load(self, state: Dict[str, Any], wanted: Optional[int]) -> int:
        surveyed, failed = attempt(self._survey)
        opened = [] if surveyed is None else surveyed[0]
        try:
            # A rank that could not survey its stores fails the load on
            # every rank (choose's first collective).
            held = [] if surveyed is None else surveyed[1]
            choice, why, newer = choose(self._group, self._tier, held, wanted, failed)
            if choice is not None and newer and self._bucket is not None:
                # A newer save is broken here: the bucket may hold it whole.
                whole = self._in_bucket(newer)
                if whole is not None:
                    return self._load_bucket(state, whole, why)
            if choice is not None:
                if why and self._rank == 0:
                    warnings.warn(f"ckptstore.dcp.Tiers: {why}; restoring step {choice.record.step}", stacklevel=2)
                try:
                    self._load_tier(state, choice, opened)
                    return choice.record.step
                except (CheckpointException, ShardsLost) as e:
                    if self._bucket is None:
                        raise
                    why = f"the local tier could not serve step {choice.record.step} ({_first_line(e)})"
        finally:
            for _, _, store in opened:
                store.close()
        return self._load_bucket(state, wanted, why)

    def _load_tier(self, state: Dict[str, Any], choice: Choice, opened: List[Tuple[str, int, Store]]) -> None:
        """Load `choice` from the local tier: a striped load whose stripes
        each holder reads from its stores; a holder that could not serve a
        shard sound is refused, with a warning, and the load runs again
        without it (every rank learns the same refusals at the same point)."""
        step = choice.record.step
        metadata, sizes = self._layout(choice, opened)
        read_of: ReadOf = lambda src, d, reads, proved: read_held(opened, src, step, d, reads, proved)  # noqa: E731
        map_of: MapOf = lambda src, d: chunk_map_held(opened, src, step, d)  # noqa: E731
        refused: Set[Tuple[int, int]] = set()  # (holder, source rank)
        nodes = [self._topology.node_of(r) for r in range(self._group.world)]
        while True:
            source = TierSource(self._group, choice, read_of, map_of, metadata, sizes, refused, nodes)
            lost = sorted(src for src, hs in (source.readers or {}).items() if not hs)
            if lost:
                raise ShardsLost(f"step {step}: no surviving rank holds a sound copy of the shards of ranks {lost}")
            try:
                self._dcp_load(state, StorageReader(source))
                return
            except CheckpointException as e:
                told = {k: why for k, why in refusals(e).items() if k not in refused}
                if not told:
                    raise
                for (holder, src), why in told.items():
                    if self._rank == 0:
                        warnings.warn(
                            f"ckptstore.dcp.Tiers: rank {src}'s shard of step {step} as held by "
                            f"rank {holder} is refused ({why}); another holder serves it",
                            stacklevel=3,
                        )
                refused |= set(told)

    def _load_bucket(self, state: Dict[str, Any], wanted: Optional[int], why: str) -> int:
        what = "no step" if wanted is None else f"no step {wanted}"
        if self._bucket is None:
            raise FileNotFoundError(f"{what} is whole on the local tier {self._dir}" + (f": {why}" if why else ""))
        bucket = self._bucket

        def find() -> Optional[int]:
            remote = remote_of(bucket)
            if wanted is None:
                return remote.latest_step()
            return wanted if remote.open_global(wanted) is not None else None

        found, failed = attempt(find) if self._rank == 0 else (None, None)
        found, failure = self._group.broadcast((found, None if failed is None else described(failed)), 0)
        if failure is not None:
            if failed is not None:
                raise failed
            raise TierFailure(f"rank 0 could not read {bucket}: {failure}")
        if found is None:
            raise FileNotFoundError(f"{what} is whole on the local tier nor in {self._bucket}" + (f" ({why})" if why else ""))
        if self._rank == 0:
            warnings.warn(
                f"ckptstore.dcp.Tiers: {why or what + ' is whole on the local tier'}; "
                f"loading step {found} from {self._bucket}",
                stacklevel=3,
            )
        self._dcp_load(state, StorageReader(self._bucket, found))
        return int(found)

    def _layout(self, choice: Choice, opened: List[Tuple[str, int, Store]]) -> Tuple[str, List[Dict[str, int]]]:
        """DCP's metadata and every rank's entry sizes of the save to
        restore: from its record (0.4.0's), else read from rank 0's shard
        by the first rank holding it that can, and broadcast (every rank's
        DCP planner needs the metadata; nothing else goes to every rank)."""
        record = choice.record
        if record.metadata is not None and record.sizes is not None:
            return record.metadata, list(record.sizes)
        problems = []
        for holder in choice.holders.get(0, []):
            got, failed = attempt(lambda: layout_of(opened, record)) if self._rank == holder else (None, None)
            got, why = self._group.broadcast((got, None if failed is None else described(failed)), holder)
            if got is not None:
                return got  # type: ignore[no-any-return]
            problems.append(f"rank {holder}: {why}")
        raise ShardsLost(
            f"step {record.step}: no rank could read DCP's metadata from rank 0's shard ({'; '.join(problems) or 'none holds it'})"
        )

    def _in_bucket(self, steps: List[int]) -> Optional[int]:
        """The first of `steps` that the bucket holds whole (rank 0 asks,
        every rank is told; a bucket that cannot be read holds none, with
        a warning)."""
        bucket = self._bucket
        assert bucket is not None

        def find() -> Optional[int]:
            remote = remote_of(bucket)
            return next((s for s in steps if remote.open_global(s) is not None), None)

        found, failed = attempt(find) if self._rank == 0 else (None, None)
        if failed is not None:
            warnings.warn(f"ckptstore.dcp.Tiers: {bucket} cannot be read ({described(failed)})", stacklevel=3)
        chosen: Optional[int] = self._group.broadcast(found, 0)
        return chosen

    def _dcp_load(self, state: Dict[str, Any], reader: Any) -> None:
        group = self._group.group
        dcp_load(state, storage_reader=reader, process_group=group, no_dist=group is None)

    def _survey(self) -> Tuple[List[Tuple[str, int, Store]], List[Holding]]:
        """This rank's share of its node's stores (each store of the
        directory goes to one rank of the node), opened, and what they
        hold."""
        ranks = self._topology.ranks_of(self._topology.node_of(self._rank))
        opened: List[Tuple[str, int, Store]] = []
        held: List[Holding] = []
        try:
            for i, (kind, src, path) in enumerate(self._tier.stores()):
                if ranks[i % len(ranks)] != self._rank:
                    continue
                try:
                    store = open_store(path)
                    for s in store.steps():
                        digest = store.content_digest(s)
                        if digest:
                            held.append((kind, src, s, digest))
                except (Error, OSError) as e:
                    warnings.warn(f"ckptstore.dcp.Tiers: {path} cannot be read ({e}); its shards are not used", stacklevel=3)
                    continue
                opened.append((kind, src, store))
        except BaseException:
            for _, _, store in opened:
                store.close()
            raise
        return opened, held


def _state_dicts(state: Dict[str, Any]) -> Dict[str, Any]:
    """`state` with each `Stateful` value (a model, an optimizer wrapper)
    replaced by its `state_dict()`, as DCP's save does."""
    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state.items()}


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
