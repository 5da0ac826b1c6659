"""`ckptstore.dcp.Tiers`: a job's checkpoints on each node's own disk,
with copies on peer nodes, over a bucket. `Tiers` owns the lifecycle,
its threads and the public calls, and hands the work to its roles: the
node (`_node.Node`: its directory, open stores, retention), the save
(`_save.Save`, which says when an upload is due), the upload
(`_upload.Upload`) and the load (`_load.Load`); `Running` holds the
work in flight."""

import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Dict, Optional

from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from ..._background import Running, Told
from ..._convert import step_number
from ..._cost import Clock, SaveCost
from ..._staging import Hashes, Pool
from .._targets import is_bucket_url
from .._wire import attempt, failed_future
from ._load import Load
from ._node import join
from ._save import Save, state_dicts
from ._upload import Upload


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
    that upload. `compress`: whether the uploader stores chunks compressed
    where that saves bytes (bucket format 4; by default as the bucket's
    scheme says, `Remote`; the local tier stays raw).
    docs/tiers.md has the details."""

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
        compress: Optional[bool] = None,
    ) -> None:
        for name, value, least in (("peers", peers, 0), ("durable_every", durable_every, 1), ("keep_local", keep_local, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"Tiers({name}={value!r}): an integer of at least {least}")
        if bucket is not None and not is_bucket_url(str(bucket)):
            raise ValueError(f"Tiers(bucket={bucket!r}): a bucket URL (s3://... or file://...)")
        self._bucket = None if bucket is None else str(bucket)
        self._background = bool(background_staging)
        self._node, self._group, self._uploads = join(os.fspath(local), peers, keep_local, ranks_per_node, timeout)
        # The roles, each over the node and a group: saves on the save
        # thread, uploads on the upload thread, loads on the caller's.
        self._saving = Save(self._node, self._group, durable_every, self._bucket is not None)
        self._upload = None if self._bucket is None else Upload(self._node, self._uploads, self._bucket, uploaded, compress)
        self._loading = Load(self._node, self._group, self._bucket)
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-tiers-save")
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-tiers-stage")
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-tiers-upload")
        self._running = Running()
        self._pool = Pool()

    @property
    def directory(self) -> str:
        """This node's directory of the local tier."""
        return self._node.dir

    def save(self, state: Dict[str, Any], step: int) -> SaveCost:
        """Save `state` (a DCP state dict) as step `step`: returns once the
        step is complete on the local tier (its upload, if due, goes on in
        the background), with what the save cost this rank."""
        self._running.check()
        fut = self._saver.submit(self._save_now, state_dicts(state), step_number(step), Clock(), None)
        self._running.add(fut)
        try:
            return fut.result()
        finally:
            # Its failure is raised here, not again by the next call.
            self._running.forget(fut)

    def async_save(self, state: Dict[str, Any], step: int) -> AsyncSaveResponse:
        """Save `state` as step `step` in the background, as DCP's
        `async_save` does: `staging_completion` is done once the state was
        copied to host memory (it may change from then on; a GPU's tensors
        are copied on a side stream after the work queued before the
        call): when the call returns, or later with the tier's
        `background_staging`; `upload_completion` when the step is
        complete on the local tier; its result is the save's `SaveCost`.
        A failure is raised by those futures and, unless the caller took
        it from `upload_completion` (its `result` or `exception`), by the
        next `save`, `async_save`, `load` or `wait`: a failure taken once
        is not raised again, so a failed save costs that step only. The host copy is kept and reused by the next `async_save`
        once this save is done (no new memory for a state of the same
        layout): a tier holds one staged copy of the state between saves
        (`close` frees it)."""
        self._running.check()
        clock, step = Clock(), step_number(step)
        try:
            staging, copy = self._pool.in_background(
                None, state_dicts(state), self._stager,
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

        # In order with the saves before and after; the caller's view of it
        # says whether its failure was taken.
        durable = Told(self._saver.submit(save_now))
        self._running.add(durable)
        # DCP types its future as Future[None]; its result here is the SaveCost.
        return AsyncSaveResponse(staging_completion=staging, upload_completion=durable)

    def wait(self) -> None:
        """Wait for every save and upload in flight; raise the first that
        failed (but a failure the caller took from an `async_save`'s
        `upload_completion`)."""
        self._running.wait()

    def close(self) -> None:
        """`wait`, then close the stores (the tier cannot be used again)."""
        try:
            self.wait()
        finally:
            self._saver.shutdown()
            self._stager.shutdown()
            self._uploader.shutdown()
            self._node.close_stores()
            self._pool.clear(None)

    def __enter__(self) -> "Tiers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        rank could not stage it (every rank raises). An upload it makes
        due is started on the upload thread."""
        with self._group.on(f"save of step {step}"):
            cost, due = self._saving.run(state, step, clock, hashes, failed)
        if due and self._upload is not None:
            self._running.add(self._uploader.submit(self._upload.pending))
        return cost

    # The load.

    def load(self, state: Dict[str, Any], step: Optional[int] = None) -> int:
        """Restore `state` (a DCP state dict, loaded in place) from step
        `step` (the newest complete one if None): from the local tier if
        the surviving ranks' stores hold every shard of it (each rank
        reading its own, or from the rank holding it or its copy), else
        from the bucket, with a warning that says why. The step restored."""
        self.wait()
        self._node.close_stores()
        wanted = None if step is None else step_number(step)
        with self._group.on("load of the newest step" if wanted is None else f"load of step {wanted}"):
            return self._loading.run(state, wanted)
