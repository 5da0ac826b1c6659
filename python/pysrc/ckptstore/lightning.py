"""Lightning checkpoints in a ckptstore: one line to switch.

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    import ckptstore.lightning

    trainer = pl.Trainer(
        plugins=[ckptstore.lightning.CheckpointIO("run.ckpt")],
        callbacks=[ModelCheckpoint(dirpath="checkpoints", save_top_k=2,
                                   monitor="val_loss", save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")   # resumes when there is a last

Each checkpoint Lightning saves becomes one step of the store, numbered
by its `global_step`. Two paths saved at one global step (`last.ckpt` and
a top-k file) are one step holding both: each path's structure (loops,
callback state, hyper-parameters) is kept apart, the tensors are stored
per path and deduplicated, so the second copy costs no space. A path
names one step at a time: saving `last.ckpt` again moves the name to the
new step. `remove_checkpoint` (top-k rotation) drops the path's name and
removes the step, in one transaction, once no name refers to it.

Lightning finds checkpoints by listing the callback's `dirpath` (for
`ckpt_path="last"`: the newest `last*.ckpt` by modification time), so
each path also gets a *marker file*: a few hundred bytes of JSON naming
the store (relative to the marker), the path (relative to the store's
directory: a run directory moves or is copied whole) and its step,
written (atomically, fsynced: the crate's own durable write) after
the step commits and removed before the name is dropped. `cat
checkpoints/last.ckpt` shows where the state is; a marker copied away
alone is not a checkpoint. The store is the truth: a load looks the path
up in the store (the marker's step is a hint for humans), so a save
killed between its commit and its marker loads the newer state. Names
whose marker is gone (a save killed before writing it) are dropped, and
a marker's temporary file a killed process left is removed, the first
time this process saves into their directory.

Safety: tensors (model, optimizer moments, tensor-valued callback state)
are typed tensors; the rest of the checkpoint is JSON (numbers, strings,
None, lists, tuples, dicts with keys of those types, torch dtypes), so
loading never runs code, as `torch.load(weights_only=True)` promises.
Anything else (an object in `hyper_parameters`, say) is refused with a
TypeError naming its key: convert it to plain data, or save the module's
`hparams` that way. Loading a path that holds a regular `torch.save`
checkpoint (one written before switching) hands it to Lightning's own
`TorchCheckpointIO`.

With `asynchronous=True` a save returns once the checkpoint's tensors
are copied (into host memory kept for the next save, hashed as they are
copied), and the commit and the marker are written on a thread of the
plugin's; a save still in flight when the next one starts, a load, a
removal or the end of the fit (`teardown`) waits for it and raises its
failure. Each save's cost (`ckptstore.SaveCost`) is `last_cost` once it
is durable; `ckptstore.lightning.SaveCosts()`, a callback, logs it with
the trainer's logger (a `CheckpointIO` has no trainer to log with). The
step of an async save records its staging in its save record
(`Store.info(step).save_record`, which `ckpt show` prints).

What it cannot do: Lightning strategies that save sharded state
(FSDP with `state_dict_type="sharded"`, DeepSpeed, ModelParallelStrategy)
bypass `CheckpointIO` or hand it per-rank shards; use
`torch.distributed.checkpoint` with `ckptstore.dcp` there. Tensors are
loaded on the CPU (`map_location` may name a device).
"""

import json
import os
import time
from typing import Any, Dict, Optional, Set, Union

import numpy as np

from ._ckptstore import SaveRecord, Tensor, remove_durably
from ._cost import SaveCost
from ._store import Store
from ._store import open as open_store
from ._background import Background
from ._cost import Clock
from ._staging import Pool
from ._structure import Flattener, arrays

try:
    from lightning.pytorch.callbacks import Callback as _Callback
    from lightning.pytorch.plugins.io import CheckpointIO as _CheckpointIO
    from lightning.pytorch.plugins.io import TorchCheckpointIO as _TorchCheckpointIO
except ImportError:  # the standalone package
    from pytorch_lightning.callbacks import Callback as _Callback  # type: ignore[assignment,no-redef,unused-ignore]
    from pytorch_lightning.plugins.io import CheckpointIO as _CheckpointIO  # type: ignore[assignment,no-redef,unused-ignore]
    from pytorch_lightning.plugins.io import TorchCheckpointIO as _TorchCheckpointIO  # type: ignore[assignment,no-redef,unused-ignore]

from ._lightning_files import (
    FORMAT, MARKER, MARKER_FORMAT, PREFIX, acquire_store, entry_names, global_step_of, load_path, marker_store, names_at,
    owns, path_name, read_marker, release_store, remove_stale_temps, same_file, step_of, write_marker,
)

__all__ = ["CheckpointIO", "SaveCosts"]

class CheckpointIO(_CheckpointIO):
    """A Lightning `CheckpointIO` over a ckptstore (see the module's text).

    `target` is a store path (opened on first use, in each process that
    uses it, closed by `teardown`) or an open `ckptstore.Store` (used as
    it is, never closed here). `replicate_to` and `threads` are passed to
    `ckptstore.open`. With `asynchronous`, saves commit in the background
    (see the module's text).
    """

    def __init__(
        self,
        target: Union[Store, "os.PathLike[str]", str],
        *,
        replicate_to: Optional[str] = None,
        threads: Optional[int] = None,
        asynchronous: bool = False,
    ) -> None:
        super().__init__()
        self._async = bool(asynchronous)
        self._background = Background("ckptstore-lightning-save")
        self._pool = Pool()
        self.last_cost: Optional[SaveCost] = None
        self._given: Optional[Store] = target if isinstance(target, Store) else None
        self._path: Optional[str] = None if isinstance(target, Store) else os.path.abspath(os.fspath(target))
        if self._path is not None:
            # Made now, as TorchCheckpointIO makes its directories: not
            # found missing at the first save, after training ran.
            os.makedirs(os.path.dirname(self._path), exist_ok=True)
        if self._given is not None and (replicate_to is not None or threads is not None):
            raise ValueError("replicate_to and threads are options of a store path, not of an open Store")
        self._replicate_to = replicate_to
        self._threads = threads
        self._store: Optional[Store] = None
        self._read_only = False
        self._swept: Set[str] = set()

    def __getstate__(self) -> Dict[str, Any]:
        if self._given is not None:
            raise TypeError("a CheckpointIO over an open Store cannot be sent to another process; "
                            "give it the store's path")
        state = dict(self.__dict__)
        state["_store"] = None
        state["_background"] = state["_pool"] = None  # threads and copies stay here
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._background = Background("ckptstore-lightning-save")
        self._pool = Pool()

    # --- Lightning's interface -------------------------------------------

    def save_checkpoint(
        self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None
    ) -> None:
        """Store `checkpoint` as step `checkpoint["global_step"]` under the
        name `path`, then write `path`'s marker file (with `asynchronous`:
        once its tensors are staged, in the background)."""
        clock = Clock()
        if storage_options is not None:
            raise TypeError(f"ckptstore.lightning.CheckpointIO takes no storage_options, got {storage_options!r}")
        self._background.wait()  # the save before: done, or its failure raised
        file = path_name(path)
        step = global_step_of(checkpoint, file)
        flat = Flattener()
        structure = flat.walk(checkpoint, PREFIX + self._key(file))
        blob = json.dumps({"format": FORMAT, "checkpoint": structure}, separators=(",", ":")).encode()
        if not self._async:
            self._commit(file, step, arrays(flat.tensors), blob, clock)
            return
        staged = self._pool.stage(None, flat.tensors)
        clock.staged(time.perf_counter() - clock.started)
        values = arrays(staged.state, staged.hashes)

        def commit() -> None:
            try:
                self._commit(file, step, values, blob, clock)
            finally:
                self._pool.give_back(None, staged.state)

        self._background.submit(commit)

    def _commit(self, file: str, step: int, tensors: Dict[str, Any], blob: bytes, clock: Clock) -> None:
        """Commit a checkpoint's tensors and structure under `file`'s name
        (with the other names' entries at `step`), then its marker."""
        name = self._key(file)
        store = self._open(write=True)
        self._sweep(store, os.path.dirname(file))
        values: Dict[str, Any] = self._others_at(store, step, name)
        values.update(tensors)
        values[PREFIX + name] = blob
        # An async save's staging is over: the step records it, and its names.
        info = store.save(step, values, replace=True, record=clock.record(entry_names(values)))
        self._drop(store, name, keep=step)
        if name != file:
            self._drop(store, file, keep=None)  # its name in a store of marker format 1
        where = None if self._path is None else os.path.relpath(self._path, os.path.dirname(file))
        write_marker(file, {"format": MARKER_FORMAT, MARKER: where, "name": name, "step": step})
        self.last_cost = clock.cost(step, info.bytes_written, info.bytes_reused)

    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> Dict[str, Any]:
        """The checkpoint saved under `path` (a marker file or the name a
        checkpoint was saved under). Nothing loaded runs code, whatever
        `weights_only` says."""
        self._background.wait()
        file = path_name(path)
        marker = read_marker(file)
        if marker is None and os.path.isfile(file):
            # A regular Lightning checkpoint, e.g. from before the switch.
            return _TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only)
        if marker is None:
            store = self._open(write=False)
            return load_path(store, self._lookup(store, file), map_location)
        # The marker's name is the one its store holds.
        name = str(marker["name"])
        store_path = marker_store(marker, file)
        if store_path is None or self._given is not None or same_file(store_path, self._path):
            return load_path(self._open(write=False), name, map_location)
        # A marker of another store (another run's checkpoint): read it there.
        with open_store(store_path, read_only=True, threads=self._threads) as other:
            return load_path(other, name, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove `path`'s marker, then its name from the store: its step
        goes (one transaction) once no name refers to it. With
        `asynchronous`, behind the saves in flight, in the background."""
        if self._async:
            self._background.then(self._remove, path)
        else:
            self._remove(path)

    def _remove(self, path: Any) -> None:
        file = path_name(path)
        marker = read_marker(file)
        if marker is None and os.path.isfile(file):
            os.unlink(file)  # a regular checkpoint file
            return
        store = self._open(write=True)
        if marker is None:
            name = self._lookup(store, file)
        else:
            name = str(marker["name"])
            remove_durably(file)
        self._drop(store, name, keep=None)

    def teardown(self) -> None:
        """Wait for the saves in flight (raising a failure), then close the
        store this plugin opened (waiting for replication), unless another
        plugin of this process uses it too."""
        try:
            self._background.close()
        finally:
            store, self._store = self._store, None
            if store is not None and self._given is None:
                release_store(self, store)
            self._pool.clear(None)

    # --- queries ---------------------------------------------------------

    def names(self) -> Dict[str, int]:
        """Each checkpoint the store holds, by its file's absolute path,
        and its step."""
        self._background.wait()
        store = self._open(write=False)
        out: Dict[str, int] = {}
        for step in store.steps():
            for name in names_at(store, step):
                file = self._file(name)
                out[file] = max(step, out.get(file, step))
        return out

    # --- helpers ---------------------------------------------------------

    def _open(self, write: bool) -> Store:
        if self._given is not None:
            return self._given
        assert self._path is not None
        if self._store is not None and self._read_only and write:
            release_store(self, self._store)
            self._store = None
        if self._store is None:
            if write:
                self._store = acquire_store(self, self._path, self._replicate_to, self._threads)
            elif os.path.exists(self._path):
                # Lightning saves on global rank 0 only: other ranks read
                # beside it.
                self._store = open_store(self._path, read_only=True, threads=self._threads)
            else:
                raise FileNotFoundError(f"no store at {self._path}")
            self._read_only = not write
        return self._store

    def _key(self, file: str) -> str:
        """The name the checkpoint file `file` is stored under: relative to
        the store's directory, so that a run directory moved or copied
        whole (store, pack files, markers) keeps its names; absolute for
        an open Store, whose path the plugin does not know."""
        if self._path is None:
            return file
        return os.path.relpath(file, os.path.dirname(self._path))

    def _file(self, name: str) -> str:
        """The absolute path of the checkpoint stored under `name`."""
        if self._path is None or os.path.isabs(name):
            return name
        return os.path.normpath(os.path.join(os.path.dirname(self._path), name))

    def _lookup(self, store: Store, file: str) -> str:
        """The name `file` is stored under: its relative name, or its
        absolute path in a store that marker format 1 wrote."""
        name = self._key(file)
        if name != file and step_of(store, name) is None and step_of(store, file) is not None:
            return file
        return name

    def _others_at(self, store: Store, step: int, name: str) -> Dict[str, Any]:
        """The entries of the other names stored at `step`, to be saved
        again with `name`'s (their bytes are in the store: only hashed)."""
        info = store.info(step)
        if info is None:
            return {}
        foreign = [n for n in list(info.blobs) + list(info.tensors) if not n.startswith(PREFIX)]
        if foreign:
            raise ValueError(f"step {step} of the store holds state not saved by ckptstore.lightning "
                             f"({foreign[0]!r}...): give Lightning a store of its own")
        names = [n for n in names_at(store, step) if n != name]
        if not names:
            return {}
        loaded = store.load(step)
        assert loaded is not None
        out: Dict[str, Any] = {}
        for entry, array in loaded.tensors.items():
            if not any(owns(n, entry) for n in names):
                continue
            if entry in info.tensors:
                t = info.tensors[entry]
                assert t.dtype is not None and t.shape is not None  # a tensor's
                out[entry] = Tensor(t.dtype, t.shape, array.reshape(-1).view(np.uint8))
            else:
                out[entry] = array.tobytes()
        return out

    def _drop(self, store: Store, name: str, keep: Optional[int]) -> None:
        """Take `name` off every step but `keep`: a step left with no name
        is removed, one with other names saved again without it."""
        for step in store.steps():
            if step == keep or name not in names_at(store, step):
                continue
            rest = self._others_at(store, step, name)
            if rest:
                info = store.info(step)
                staged = info.save_record if info else SaveRecord()
                record = SaveRecord(staging_seconds=staged.staging_seconds,
                                    blocked_seconds=staged.blocked_seconds, names=entry_names(rest))
                store.save(step, rest, replace=True, record=record)
            else:
                store.remove(step)

    def _sweep(self, store: Store, directory: str) -> None:
        """Once per process and directory: drop the names in `directory`
        whose marker is missing (a save killed before writing it), and the
        markers' temporary files that killed processes left."""
        if directory in self._swept:
            return
        self._swept.add(directory)
        remove_stale_temps(directory)
        for step in store.steps():
            for name in names_at(store, step):
                file = self._file(name)
                if os.path.dirname(file) == directory and not os.path.exists(file):
                    self._drop(store, name, keep=None)


class SaveCosts(_Callback):
    """Logs the cost of each save of a `ckptstore.lightning.CheckpointIO`
    (`SaveCost.as_metrics(prefix)`: blocked, staging and durable seconds,
    MiB new and deduplicated) with the trainer's loggers at its step, once
    the save is durable: at the next training batch's end, or at the end
    of training (an async save still in flight then is logged by the next
    fit)."""

    def __init__(self, prefix: str = "checkpoint/") -> None:
        self._prefix = prefix
        self._logged: Optional[SaveCost] = None

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self._log(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._log(trainer)

    def _log(self, trainer: Any) -> None:
        io = getattr(trainer.strategy, "checkpoint_io", None)
        while io is not None and not isinstance(io, CheckpointIO):
            io = getattr(io, "checkpoint_io", None)  # under a wrapping plugin
        cost = io.last_cost if io is not None else None
        if cost is None or cost is self._logged:
            return
        self._logged = cost
        for logger in trainer.loggers:
            logger.log_metrics(cost.as_metrics(self._prefix), step=cost.step)
