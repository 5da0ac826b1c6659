"""torchtitan checkpoints in ckptstore: three lines of a config to switch.

    from ckptstore.torchtitan import CheckpointManager

    config.checkpoint = CheckpointManager.Config(
        enable=True, interval=100, async_mode="async", keep_latest_k=3,
        target="s3://bucket/run-7",          # None: a bucket in the checkpoint folder
    )

A subclass of torchtitan's own `CheckpointManager` (tested with torchtitan
0.3.0, `pip install "ckptstore[torchtitan]"`) built by the trainer as
before, with its arguments unchanged; the training loop calls nothing new
(`save(step)`, `maybe_wait_for_staging()`, `load()`, `close()`).

Each save is a DCP save through `ckptstore.dcp.StorageWriter` into
`target` as step `step`, all-or-nothing across ranks: a step is seen
only once committed, so a rank killed mid-save (in any `async_mode`)
leaves nothing a resume picks up. `load()` restores the newest committed
step (or `load_step`) at any world size, resharding as DCP does; a step
0 restores the model only (torchtitan's seed checkpoint). `keep_latest_k`
is the bucket's retention (`Remote.gc(keep_last=k)`), run by rank 0 once
a save is durable (with the local tier: once its upload lands, and at
`close()`), never on a step in flight. `async_mode="async"` saves
on DCP's thread; `"async_with_pinned_mem"` through ckptstore's own
staging (`StorageWriter(background_staging=True)`): `save` returns at
once, `maybe_wait_for_staging()` waits for the copy. `close()` waits for
a save in flight and raises its failure.

The last step (`save(step, last_step=True)`) with `last_save_model_only`
is the model alone in `export_dtype`; with `last_save_in_hf` it is stored
under the state-dict adapter's Hugging Face names and exported (rank 0,
`ckptstore.dcp.export_hf`) as safetensors shards with their index into
`<folder>/step-<step>`.

`initial_load_path` (used when the target holds no step) is a bucket URL
(its newest step) or a directory torchtitan's own checkpointer wrote
(read by torchtitan, HF included). With `local` set, saves go through
the node-local tier (`ckptstore.dcp.Tiers(local, target, peers,
durable_every=upload_every, keep_local=...)`): every save to each node's
disk and `peers` other nodes, every `upload_every`-th one to `target`;
a load takes the newest step the tier restores whole, else the bucket's.
"""

import copy
import dataclasses
import os
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Dict, Optional, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save, save
from torchtitan.components.checkpointer import MODEL, AsyncMode  # type: ignore[import-untyped]
from torchtitan.components.checkpointer import CheckpointManager as _TitanManager

from .dcp._export import export_hf
from .dcp._reader import StorageReader
from .dcp._writer import StorageWriter
from ._remote import Remote
from .dcp._choose import target_of
from .dcp._targets import is_bucket_url
from .dcp.tiers._tiers import Tiers

__all__ = ["CheckpointManager"]


class CheckpointManager(_TitanManager):  # type: ignore[misc]
    """torchtitan's checkpoint manager with its steps in ckptstore."""

    save_future: "Optional[Future[Any]]"
    staging_future: "Optional[Future[Any]]"

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_TitanManager.Config):  # type: ignore[misc]
        target: Optional[str] = None
        """Where the steps go: a bucket URL (`s3://...`, `file://...`);
        None, a bucket in the checkpoint folder."""

        local: Optional[str] = None
        """A node-local directory (`{node}` is replaced by the node's
        index): saves go to the local tier first."""

        peers: int = 1
        """With `local`: other nodes each rank's shard is copied to."""

        upload_every: int = 1
        """With `local`: every how many saves one goes to `target`."""

        timeout_seconds: float = 600.0
        """How long a rank waits on the others in the manager's own
        collectives (its gloo group for async saves, the local tier's)
        before the save or load fails on it."""

        def __post_init__(self) -> None:
            _TitanManager.Config.__post_init__(self)
            if self.target is not None and not is_bucket_url(self.target):
                raise ValueError(f"checkpoint.target={self.target!r}: a bucket URL (s3://... or file://...) or None")
            if self.peers < 0 or self.upload_every < 1:
                raise ValueError("checkpoint.peers must be >= 0 and checkpoint.upload_every >= 1")
            if not self.timeout_seconds > 0:
                raise ValueError(f"checkpoint.timeout_seconds={self.timeout_seconds!r}: a number of seconds above 0")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        # torchtitan's own set-up, less its purge thread and its gloo group
        # (made here only where there is a process group).
        plain = copy.copy(config)
        plain.keep_latest_k, plain.async_mode = 0, "disabled"
        super().__init__(plain, **kwargs)
        if not self.enable:
            return
        self.keep_latest_k = config.keep_latest_k
        self.async_mode = AsyncMode(config.async_mode)
        wait = timedelta(seconds=config.timeout_seconds)
        if self.async_mode != AsyncMode.DISABLED and _distributed():
            self.pg = cast(dist.ProcessGroup, dist.new_group(backend="gloo", timeout=wait))
        folder = os.path.abspath(self.folder)
        self.target = config.target or "file://" + folder
        if self.target.startswith("file://"):
            os.makedirs(self.target[len("file://") :], exist_ok=True)
        self.tiers: Optional[Tiers] = None
        if config.local is not None:
            keep = max(2, config.keep_latest_k or 2)
            # The bucket's retention runs once an upload lands (and at
            # close): run as a save returns, it would count the steps
            # before the upload in flight and leave k + 1.
            self.tiers = Tiers(
                config.local, self.target, config.peers, config.upload_every, keep,
                timeout=wait, uploaded=lambda _step: self._retain(),
            )

    # Saves.

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step:
            self._save_last_step(curr_step)
            return True
        states = self._flattened_model_states_sd()
        if self.async_mode == AsyncMode.DISABLED:
            self._save_now(states, curr_step)
        else:
            self._save_async(states, curr_step)
        return True

    def _save_now(self, states: Dict[str, Any], step: int) -> None:
        if self.tiers is not None:
            self.tiers.save(states, step)  # retention once its upload lands
            return
        save(states, storage_writer=StorageWriter(self.target, step))
        self._retain()

    def _save_async(self, states: Dict[str, Any], step: int) -> None:
        staged = self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
        if self.tiers is not None:
            response: Any = self.tiers.async_save(states, step)
        else:
            writer = StorageWriter(self.target, step, background_staging=staged)
            response = async_save(states, storage_writer=writer, process_group=self.pg)
        if isinstance(response, Future):
            self.save_future = response
        else:
            self.staging_future = response.staging_completion if staged else None
            self.save_future = response.upload_completion
            if not staged:
                response.staging_completion.result()

    def _wait_for_saving(self) -> None:
        future = self.save_future
        self.save_future = None
        if future is not None:
            future.result()
        if self.tiers is None:  # the tier's: once its upload lands
            self._retain()

    def _maybe_wait_for_staging(self) -> None:
        if self.staging_future is not None:
            future = self.staging_future
            self.staging_future = None
            future.result()

    def _retain(self) -> None:
        """Keep the `keep_latest_k` newest steps in the bucket (rank 0, once
        this job's save is durable; a tier's upload in flight is younger
        than the bucket's grace period, which retention leaves alone)."""
        if self.keep_latest_k > 0 and _rank() == 0:
            Remote(self.target).gc(keep_last=self.keep_latest_k)

    def _purge_stale_checkpoints(self) -> None:
        # torchtitan's hook deletes `step-N` directories; only its own
        # `_save` (replaced above) calls it, and here it is the bucket's
        # retention should anything else.
        self._retain()

    def _save_last_step(self, curr_step: int) -> None:
        if not self.last_save_model_only:
            self._save_now(self._flattened_model_states_sd(), curr_step)
            return
        states = {
            k: v.to(self.export_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in self.states[MODEL].state_dict().items()
        }
        if self.last_save_in_hf:
            states = self.sd_adapter.to_hf(states)
        save(states, storage_writer=StorageWriter(self.target, curr_step))
        if self.last_save_in_hf:
            self._export_hf(curr_step)
        self._retain()

    def _export_hf(self, step: int) -> None:
        """Rank 0 exports step `step` as HF shards into `<folder>/step-N`;
        its failure is raised on every rank (none waits on it)."""
        failure: Optional[str] = None
        if _rank() == 0:
            try:
                export_hf(self.target, step, os.path.join(self.folder, f"step-{step}"))
            except Exception as e:  # noqa: BLE001 - told to every rank
                if not _distributed():
                    raise
                failure = f"{type(e).__name__}: {e}"
        if _distributed():
            told = [failure]
            dist.broadcast_object_list(told, src=0)
            failure = told[0]
        if failure is not None:
            raise RuntimeError(f"step {step} was saved, but rank 0 could not export it to Hugging Face shards: {failure}")

    # Loads.

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        if self.tiers is not None:
            return self._load_tier(step)
        newest = target_of(self.target).latest()
        if step != -1 and newest is None:
            raise FileNotFoundError(f"--checkpoint.load_step={step}: {self.target} holds no step")
        found = step if step != -1 else newest
        if found is None:
            return self._load_initial()
        states = self._states_to_load(found == 0)
        dcp_load(states, storage_reader=StorageReader(self.target, found))
        self.states[MODEL].load_state_dict(states)
        return True

    def _load_tier(self, step: int) -> bool:
        assert self.tiers is not None
        states = self._states_to_load(False)
        try:
            self.tiers.load(states, None if step == -1 else step)
        except FileNotFoundError:
            if step != -1:
                raise
            return self._load_initial()
        self.states[MODEL].load_state_dict(states)
        return True

    def _load_initial(self) -> bool:
        path = self.initial_load_path
        if path and is_bucket_url(path):
            states = self._states_to_load(self.initial_load_model_only)
            dcp_load(states, storage_reader=StorageReader(path))
            self.states[MODEL].load_state_dict(states)
            return True
        # A directory torchtitan wrote, or none: torchtitan's own load
        # (its checkpoint folder holds no `step-N` of DCP's).
        return bool(super()._load(-1))

    def _close(self) -> None:
        try:
            self.maybe_wait_for_saving()
        finally:
            if self.tiers is not None:
                self.tiers.close()
                self.tiers = None
                self._retain()  # every upload has landed
            super()._close()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0
