"""ckptstore.lightning's side of the store and the checkpoint directory:
the stores this process's plugins write (one handle per path), the names
a path's entries take in a step, the marker files Lightning lists (read,
written with the crate's durable write), and the sweep of a killed
process's temporary files. `lightning.CheckpointIO` is their one user."""

import json
import os
import re
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from ._ckptstore import Tensor, write_durably
from ._store import Store
from ._store import open as open_store
from ._structure import Rebuilder

# A path's structure is the blob "lightning:<path>"; its tensors are named
# "lightning:<path>/<key>/<key>...". Each name is also in its step's save
# record (`StepInfo.save_record.names`), which `ckpt ls` and `show` show.
PREFIX = "lightning:"
FORMAT = 1
# Marker format 2 names the store relative to the marker, and the
# checkpoint relative to the store's directory; format 1 named both by
# absolute path (read as before).
MARKER_FORMAT = 2
MARKER = "ckptstore.lightning"
_MARKER_MAX = 1 << 16


# The stores this process's plugins write, by path, with the plugins that
# use each: a store stays open while one does, so that a plugin of a new
# Trainer in the same process (after a `save_checkpoint` outside `fit`,
# which no teardown follows) writes through the same handle instead of
# finding the store locked.
_WRITERS: Dict[str, Tuple[Store, Set[int]]] = {}


def acquire_store(user: object, path: str, replicate_to: Optional[str], threads: Optional[int]) -> Store:
    found = _WRITERS.get(path)
    if found is None:
        found = (open_store(path, replicate_to=replicate_to, threads=threads), set())
        _WRITERS[path] = found
    found[1].add(id(user))
    return found[0]


def release_store(user: object, store: Store) -> None:
    for path, (shared, users) in list(_WRITERS.items()):
        if shared is store:
            users.discard(id(user))
            if not users:
                del _WRITERS[path]
                store.close()
            return
    store.close()  # a read-only handle: this plugin's own


def marker_store(marker: Dict[str, Any], file: str) -> Optional[str]:
    """The path of the store the marker at `file` names (format 2:
    relative to the marker), or None."""
    where = marker.get(MARKER)
    if not isinstance(where, str):
        return None
    if marker.get("format") == MARKER_FORMAT:
        return os.path.normpath(os.path.join(os.path.dirname(file), where))
    return where


def same_file(a: str, b: Optional[str]) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def path_name(path: Any) -> str:
    name: str = os.path.abspath(os.fspath(path))
    return name


def global_step_of(checkpoint: Dict[str, Any], name: str) -> int:
    step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{name}: a Lightning checkpoint has an int global_step, got {step!r}")
    return step


def entry_names(values: Dict[str, Any]) -> List[str]:
    """The step's names for its save record: `lightning:<name>` for each
    checkpoint structure among `values`."""
    return [n for n in values if n.startswith(PREFIX) and isinstance(values[n], bytes)]


def owns(name: str, entry: str) -> bool:
    head = PREFIX + name
    return entry == head or entry.startswith(head + "/")


def names_at(store: Store, step: int) -> List[str]:
    info = store.info(step)
    if info is None:
        return []
    return [b[len(PREFIX):] for b in info.blobs if b.startswith(PREFIX)]


def step_of(store: Store, name: str) -> Optional[int]:
    """The newest step holding `name` (two hold it only after a crash in
    the middle of moving it)."""
    found = [step for step in store.steps() if name in names_at(store, step)]
    return max(found) if found else None


def load_path(store: Store, name: str, map_location: Optional[Any]) -> Dict[str, Any]:
    """The checkpoint stored under `name`, rebuilt without running code."""
    step = step_of(store, name)
    if step is None:
        raise FileNotFoundError(f"{name}: no checkpoint of that name in the store")
    loaded = store.load(step)
    if loaded is None:
        raise FileNotFoundError(f"{name}: step {step} was removed while loading")
    document = json.loads(loaded.tensors.pop(PREFIX + name).tobytes())
    if document.get("format") != FORMAT:
        raise ValueError(f"{name}: step {step} has an unknown ckptstore.lightning format "
                         f"{document.get('format')!r}")
    tensors = {n: a.reshape(-1).view(np.uint8) for n, a in loaded.tensors.items() if owns(name, n)}
    checkpoint: Dict[str, Any] = Rebuilder(tensors).walk(document["checkpoint"])
    if isinstance(map_location, (str, torch.device)):
        checkpoint = _to(checkpoint, torch.device(map_location))
    return checkpoint


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, _to(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def read_marker(path: str) -> Optional[Dict[str, Any]]:
    """The marker at `path`; None if there is no file or it is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(_MARKER_MAX + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    if len(head) > _MARKER_MAX or not head.startswith(b"{"):
        return None
    try:
        marker = json.loads(head)
    except ValueError:
        return None
    if not isinstance(marker, dict) or MARKER not in marker or "name" not in marker:
        return None
    return marker


def write_marker(path: str, marker: Dict[str, Any]) -> None:
    """Write `marker` at `path` whole or not at all, durably (in Rust:
    through `.<marker>.tmp<pid>-<uuid>` beside it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_durably(path, json.dumps(marker, indent=1).encode() + b"\n")


# Temporary files of a marker's write: the crate's (`.<marker>.tmp<pid>-
# <uuid>`), and 0.4's (`<marker>.<pid>.tmp`).
_TEMP = re.compile(r"\..+\.tmp([0-9]+)-[0-9a-f-]{36}|.+\.([0-9]+)\.tmp")


def remove_stale_temps(directory: str) -> None:
    """Remove the temporary files a marker's write left in `directory` when
    its process was killed: named with the pid of a process no longer
    alive, and empty or a marker (never another file)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        found = _TEMP.fullmatch(name)
        if found is None or _alive(int(found.group(1) or found.group(2))):
            continue
        path = os.path.join(directory, name)
        try:
            ours = os.path.getsize(path) == 0 or read_marker(path) is not None
            if ours:
                os.remove(path)
        except FileNotFoundError:
            continue


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (this one included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's, or no such pid number: kept
    return True
