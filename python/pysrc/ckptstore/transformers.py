"""Hugging Face Trainer checkpoints in a ckptstore: one callback to switch.

    import ckptstore.transformers as ckt

    args = TrainingArguments("out", save_steps=50, save_total_limit=2, ...)
    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[ckt.CheckpointCallback("run.ckpt")])
    trainer.train(resume_from_checkpoint=ckt.restore("run.ckpt", dir=args.output_dir))

After each save (`on_save` runs once the Trainer has written
`output_dir/checkpoint-<global_step>` and rotated older ones) the callback
moves that directory into the store as step `global_step`, in one
transaction, and then deletes it: each file (weights, optimizer,
scheduler, RNG, trainer state) becomes an entry `hf/<relative path>`,
byte for byte, its chunks hash-checked and deduplicated against the
steps before it. The store then keeps the `save_total_limit` newest steps
(and the best one, when the Trainer tracks it), as the Trainer's rotation
would. Directories a killed run left in `output_dir` (written but not yet
stored, or stored but not yet deleted) are swept when training begins and
after every save; so is a directory `restore` made there, once the
Trainer has read it.

`restore(target, step=None, dir=...)` writes the step back as
`dir/checkpoint-<step>` (whole or not at all: built under a temporary
name and renamed) and returns its path, which `trainer.train(
resume_from_checkpoint=...)` accepts; None when the store has no step.
Restored into `output_dir`, the callback deletes it; restored elsewhere
(`dir=None` makes a temporary directory), the caller deletes it after
`train` returns (the Trainer reads its RNG state when the first epoch
begins, after `on_train_begin`).

With `asynchronous=True`, `on_save` returns once it has opened (mapped)
the directory's files: reading them, committing, deleting the directory
and the rotation run on a thread of the callback's; the next save, and
the end of training, wait for that and raise its failure. The directory's
mapped files stay readable if the Trainer's own rotation deletes it
meanwhile. Each save's cost (`ckptstore.SaveCost`) is `last_cost` once
it is durable, and is appended to the Trainer's `state.log_history` (as
`checkpoint/blocked_s`, `checkpoint/durable_s`, ... at its step, kept in
`trainer_state.json`); an async save's step records its staging in its
save record (`Store.info(step).save_record`, which `ckpt show` prints).

What it cannot do: `load_best_model_at_end=True` reloads the best
checkpoint from its directory at the end of training, which is no longer
on disk: refused with a ValueError when the Trainer is built. Only the
world's process zero stores (the Trainer writes checkpoints there; with
`save_on_each_node` each node's would need a store of its own). DeepSpeed
and FSDP checkpoints are stored as the files they are (sharded files
restore only at the same world size); `torch.distributed.checkpoint`
with `ckptstore.dcp` reshards.
"""

import math
import os
import re
import shutil
import tempfile
import time
from typing import Any, Dict, Optional, Union

import numpy as np
from transformers import TrainerCallback

from ._ckptstore import Tensor
from ._cost import SaveCost
from ._store import Store
from ._store import open as open_store
from ._background import Background
from ._cost import Clock

__all__ = ["CheckpointCallback", "restore"]

_PREFIX = "hf/"
_FOLDER = re.compile(r"^checkpoint-(\d+)$")


class CheckpointCallback(TrainerCallback):
    """Moves each checkpoint directory the Trainer writes into a store
    (see the module's text). `target` is a store path (opened on the
    first save, closed at the end of training) or an open `Store`;
    `replicate_to` is passed to `ckptstore.open`. With `asynchronous`, the
    work after the files are opened runs in the background."""

    def __init__(
        self,
        target: Union[Store, "os.PathLike[str]", str],
        *,
        replicate_to: Optional[str] = None,
        asynchronous: bool = False,
    ) -> None:
        self._async = bool(asynchronous)
        self._background = Background("ckptstore-transformers-save")
        self.last_cost: Optional[SaveCost] = None
        self._given = target if isinstance(target, Store) else None
        self._path = None if isinstance(target, Store) else os.path.abspath(os.fspath(target))
        if self._path is not None:
            # Made now, as the Trainer makes its output directory: not
            # found missing at the first save, after training ran.
            os.makedirs(os.path.dirname(self._path), exist_ok=True)
        self._replicate_to = replicate_to
        self._store: Optional[Store] = None

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _refuse_best_at_end(args)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _refuse_best_at_end(args)
        if state.is_world_process_zero:
            # The directory being resumed from is read after this: kept.
            self._sweep(args.output_dir, keep=state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        clock = Clock()
        self._background.wait()  # the save before: done, or its failure raised
        step = state.global_step
        folder = os.path.join(args.output_dir, f"checkpoint-{step}")
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"on_save: the Trainer wrote no {folder}")
        # Directories left by a killed run or by `restore` (none of a save
        # of this process: each is gone once stored).
        self._sweep(args.output_dir, keep=step)
        values = _files(folder)  # mapped: readable even if the folder goes
        metrics = _metrics(state.log_history)
        if self._async:
            clock.staged(time.perf_counter() - clock.started)
            self._background.submit(self._commit, step, folder, values, metrics, args, state, clock)
        else:
            self._commit(step, folder, values, metrics, args, state, clock)

    def _commit(self, step: int, folder: str, values: Dict[str, Any], metrics: Dict[str, float], args: Any,
                state: Any, clock: Clock) -> None:
        """Store `folder`'s files as `step`, delete it, keep the newest
        steps; record what it cost (an async save's staging: the seconds it
        blocked the Trainer, opening the files)."""
        store = self._open()
        info = store.save(step, values, metrics, replace=True, record=clock.record())
        shutil.rmtree(folder, ignore_errors=True)
        self._retain(store, args, state)
        cost = clock.cost(step, info.bytes_written, info.bytes_reused)
        self.last_cost = cost
        state.log_history.append({**cost.as_metrics(), "step": step})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        try:
            self._background.close()  # raises a failed save's error
        finally:
            self._sweep(args.output_dir, keep=None)
            store, self._store = self._store, None
            if store is not None and self._given is None:
                store.close()

    def _open(self) -> Store:
        if self._given is not None:
            return self._given
        if self._store is None:
            assert self._path is not None
            self._store = open_store(self._path, replicate_to=self._replicate_to)
        return self._store

    def _retain(self, store: Store, args: Any, state: Any) -> None:
        """The Trainer's own rotation (`rotate_checkpoints`), over steps:
        the newest step and the best one are protected, and the oldest
        others go until `max(save_total_limit, protected)` are left."""
        limit = args.save_total_limit
        if limit is None or limit <= 0:
            return
        steps = store.steps()
        if len(steps) <= limit:
            return
        protected = {steps[-1]}
        best = _step_of_folder(state.best_model_checkpoint)
        if best is not None:
            protected.add(best)
        remaining = len(steps)
        for step in steps:
            if remaining <= max(limit, len(protected)):
                break
            if step not in protected:
                store.remove(step)
                remaining -= 1

    def _sweep(self, output_dir: str, keep: Optional[int]) -> None:
        """Delete the `checkpoint-<step>` directories of `output_dir` but
        `keep`'s: a killed run's (stored, or not stored and superseded by
        the state training goes on from) and one `restore` made there."""
        if not os.path.isdir(output_dir):
            return
        for entry in os.listdir(output_dir):
            match = _FOLDER.match(entry)
            if match and int(match.group(1)) != keep:
                shutil.rmtree(os.path.join(output_dir, entry), ignore_errors=True)


def restore(
    target: Union[Store, "os.PathLike[str]", str],
    step: Optional[int] = None,
    dir: Optional[Union["os.PathLike[str]", str]] = None,  # noqa: A002 (the issue's name)
) -> Optional[str]:
    """Write `step` (the latest if None) back as `dir/checkpoint-<step>`
    and return that path; None when the store is empty or missing. With
    `dir=None`, a new temporary directory, which the caller deletes."""
    if isinstance(target, Store):
        return _restore(target, step, dir)
    path = os.fspath(target)
    if not os.path.exists(path):
        return None
    with open_store(path, read_only=True) as store:
        return _restore(store, step, dir)


def _restore(store: Store, step: Optional[int], dir: Optional[Union["os.PathLike[str]", str]]) -> Optional[str]:  # noqa: A002
    step = store.latest_step() if step is None else step
    if step is None:
        return None
    info = store.info(step)
    if info is None:
        raise KeyError(f"step {step} is not in the store")
    if any(not n.startswith(_PREFIX) for n in list(info.tensors) + list(info.blobs)):
        raise ValueError(f"step {step} was not saved by ckptstore.transformers")
    loaded = store.load(step)
    assert loaded is not None
    parent = tempfile.mkdtemp(prefix="ckptstore-hf-") if dir is None else os.fspath(dir)
    os.makedirs(parent, exist_ok=True)
    folder = os.path.join(parent, f"checkpoint-{step}")
    building = tempfile.mkdtemp(prefix=f".checkpoint-{step}.", dir=parent)
    try:
        for name, array in loaded.tensors.items():
            file = os.path.join(building, name[len(_PREFIX):])
            os.makedirs(os.path.dirname(file), exist_ok=True)
            with open(file, "wb") as f:
                data: Any = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                f.write(memoryview(data))
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.rename(building, folder)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return folder


def _files(folder: str) -> Dict[str, Any]:
    """Each file under `folder` as a U8 tensor over its mapped bytes."""
    values: Dict[str, Any] = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            file = os.path.join(root, name)
            rel = os.path.relpath(file, folder).replace(os.sep, "/")
            size = os.path.getsize(file)
            data = np.memmap(file, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
            values[_PREFIX + rel] = Tensor("U8", [size], data)
    return values


def _metrics(log_history: Any) -> Dict[str, float]:
    """The latest value of each numeric entry of the Trainer's log."""
    out: Dict[str, float] = {}
    for entry in log_history or []:
        for key, value in entry.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out[key] = float(value)
    return out


def _step_of_folder(folder: Optional[str]) -> Optional[int]:
    match = _FOLDER.match(os.path.basename(folder or ""))
    return int(match.group(1)) if match else None


def _refuse_best_at_end(args: Any) -> None:
    if getattr(args, "load_best_model_at_end", False):
        raise ValueError(
            "ckptstore.transformers.CheckpointCallback: load_best_model_at_end=True reloads the best "
            "checkpoint from its directory, which the callback has moved into the store; set it to False "
            "and load the best step with ckptstore.transformers.restore(store, step)"
        )
