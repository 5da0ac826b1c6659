"""Accelerate's `save_state` / `load_state` into a store or a bucket
(issue 76), through a step of files: Accelerate writes its folder
(model, optimizer, scheduler, RNG states, each process its own files)
into a temporary directory the processes share, and the main process
commits it as one step (`Store.save_dir` / `Remote.save_dir`); a load
writes the step back into such a directory and Accelerate reads it.

    from ckptstore.accelerate import load_state, save_state

    save_state(accelerator, "run.ckpt", step)      # or "s3://bucket/run"
    load_state(accelerator, "run.ckpt")            # the newest step

Every process calls both (as Accelerate's own). The temporary directory
is made by the main process under `tmp_dir` (default: the system's) and
must be seen by every process: one node, or a shared file system.
"""

import os
import shutil
import tempfile
from typing import Any, Callable, Optional, Union

from ._remote import Remote
from ._store import Store

__all__ = ["load_state", "save_state"]

Target = Union[str, "os.PathLike[str]"]


def _is_url(target: Target) -> bool:
    return str(target).startswith(("s3://", "file://"))


def _told(accelerator: Any, value: Any) -> Any:
    """`value` as the main process has it, on every process (Accelerate's
    own broadcast)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list  # type: ignore[import-untyped]

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def _together(accelerator: Any, work: Callable[[], Any]) -> Any:
    """`work()` on this process, then one exchange of every process's
    failure (Accelerate's `gather_object`): a failure on any process
    raises on every one (its own as it was, another's named), so no
    process waits at a barrier for one that gave up."""
    failure: Optional[BaseException] = None
    result = None
    try:
        result = work()
    except Exception as e:  # told to every process, raised by each
        failure = e
    told = None if failure is None else f"{type(failure).__name__}: {failure}"
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        everyone = gather_object([told])
    else:
        everyone = [told]
    if failure is not None:
        raise failure
    for rank, other in enumerate(everyone):
        if other is not None:
            raise RuntimeError(f"process {rank} of the save or load failed: {other}")
    return result


def _shared_dir(accelerator: Any, tmp_dir: Optional[str]) -> str:
    """A new directory made by the main process, its path told to every
    process."""
    made = None
    if accelerator.is_main_process:
        made = tempfile.mkdtemp(prefix="ckptstore-accelerate-", dir=tmp_dir)
    path: str = _told(accelerator, made)
    return path


def save_state(accelerator: Any, target: Target, step: int, *, tmp_dir: Optional[str] = None) -> None:
    """Save the accelerator's state (`accelerator.save_state`) as step
    `step` of `target` (a store file or a bucket URL), committed whole by
    the main process once every process wrote its files: a job killed
    before that leaves the previous step the newest. Every process calls
    it."""
    folder = _shared_dir(accelerator, tmp_dir)
    state = os.path.join(folder, "state")

    def commit() -> None:
        if not accelerator.is_main_process:
            return
        if _is_url(target):
            Remote(str(target)).save_dir(step, state)
        else:
            with Store(target) as store:
                store.save_dir(step, state)

    try:
        _together(accelerator, lambda: accelerator.save_state(state))
        _together(accelerator, commit)
    finally:
        if accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)


def load_state(accelerator: Any, target: Target, step: Optional[int] = None, *, tmp_dir: Optional[str] = None) -> int:
    """Load step `step` of `target` (None: the newest) into the
    accelerator (`accelerator.load_state`): the step loaded. Every
    process calls it."""
    folder = _shared_dir(accelerator, tmp_dir)
    state = os.path.join(folder, "state")
    try:
        written = _together(accelerator, lambda: _write_back(target, step, state) if accelerator.is_main_process else None)
        loaded: int = _told(accelerator, written)
        _together(accelerator, lambda: accelerator.load_state(state))
        return loaded
    finally:
        if accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)


def _write_back(target: Target, step: Optional[int], state: str) -> int:
    """Step `step` (None: the newest) of `target` written into `state`:
    its number."""
    if _is_url(target):
        remote = Remote(str(target))
        chosen = remote.latest_step() if step is None else step
        if chosen is None:
            raise FileNotFoundError(f"{target} holds no complete step")
        remote.load_dir(chosen, state)
        return chosen
    with Store(target, read_only=True) as store:
        chosen = store.latest_step() if step is None else step
        if chosen is None:
            raise FileNotFoundError(f"{target} holds no step")
        store.load_dir(chosen, state)
        return chosen
