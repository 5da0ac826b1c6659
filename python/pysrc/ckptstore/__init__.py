"""ckptstore: transactional, deduplicated, verified training checkpoints.

    import ckptstore
    with ckptstore.open("run.ckpt") as store:
        info = store.save(step, {"w": np_array, "rng": b"..."}, metrics={"loss": 0.42})
        ck = store.load()            # the latest step, or None

Arrays keep their dtype and shape; bytes-like values are untyped blobs and
load back as 1-D uint8 arrays. Saving copies each array's bytes once into
the store's memory; loading copies the bytes read into each array once.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np

from ._ckptstore import (  # noqa: F401  (re-exported)
    CorruptError,
    Error,
    LockedError,
    RawStore,
    StepExistsError,
)

__all__ = [
    "open",
    "Store",
    "Checkpoint",
    "CommitInfo",
    "Error",
    "StepExistsError",
    "CorruptError",
    "LockedError",
]

# numpy dtype name -> safetensors dtype name, and back.
_TO_STORE = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "float16": "F16",
    "uint32": "U32",
    "int32": "I32",
    "float32": "F32",
    "uint64": "U64",
    "int64": "I64",
    "float64": "F64",
    "complex64": "C64",
    "bfloat16": "BF16",  # with ml_dtypes
}
_FROM_STORE = {v: k for k, v in _TO_STORE.items()}


@dataclass
class CommitInfo:
    """What a save did."""

    step: int
    bytes_written: int
    bytes_reused: int
    logical_bytes: int
    removed: list
    seconds: float


@dataclass
class Checkpoint:
    """A loaded step: tensors by name as numpy arrays (dtype and shape kept)."""

    step: int
    timestamp: int
    loss_cid: Optional[str]
    metrics: Dict[str, float]
    tensors: Dict[str, np.ndarray] = field(default_factory=dict)


def _split(state):
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of name -> array or bytes, not {type(state).__name__}")
    tensors, blobs = [], []
    for name, value in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state keys must be str, not {type(name).__name__}")
        if isinstance(value, (bytes, bytearray, memoryview)):
            blobs.append((name, bytes(value)))
            continue
        if not isinstance(value, np.ndarray):
            raise TypeError(f"{name!r}: expected a numpy array or bytes, not {type(value).__name__}")
        dtype = _TO_STORE.get(value.dtype.name)
        if dtype is None:
            raise TypeError(f"{name!r}: dtype {value.dtype} is not supported")
        # A C-contiguous copy only when needed (ascontiguousarray would
        # also turn a 0-d array into a 1-d one).
        array = value if value.flags["C_CONTIGUOUS"] else value.copy(order="C")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        tensors.append((name, dtype, list(array.shape), array.tobytes()))
    return tensors, blobs


def _metrics(metrics):
    return {str(k): float(v) for k, v in (metrics or {}).items()}


def _array(dtype, shape, data):
    name = _FROM_STORE.get(dtype)
    if name == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401

            np_dtype = np.dtype("bfloat16")
        except (ImportError, TypeError):
            np_dtype = None
    else:
        np_dtype = np.dtype(name) if name else None
    if np_dtype is None:
        # A dtype numpy lacks (F8, F6, F4, BF16 without ml_dtypes): the bytes.
        return np.frombuffer(data, dtype=np.uint8)
    return np.frombuffer(data, dtype=np_dtype.newbyteorder("<")).reshape(tuple(shape))


class Handle:
    """A background save: `result()` waits and returns its CommitInfo."""

    def __init__(self, raw):
        self._raw = raw

    def done(self) -> bool:
        return self._raw.done()

    def result(self) -> CommitInfo:
        return CommitInfo(**self._raw.result())


class Store:
    """An open checkpoint store. Use `ckptstore.open`."""

    def __init__(self, path, read_only=False):
        self._raw = RawStore(str(path), read_only)

    def save(self, step: int, state: dict, metrics=None) -> CommitInfo:
        """Commit `state` as `step`; durable when it returns."""
        tensors, blobs = _split(state)
        return CommitInfo(**self._raw.save(int(step), tensors, blobs, _metrics(metrics)))

    def save_async(self, step: int, state: dict, metrics=None) -> Handle:
        """Queue `state` for commit in the background; the arrays are copied now."""
        tensors, blobs = _split(state)
        return Handle(self._raw.save_async(int(step), tensors, blobs, _metrics(metrics)))

    def flush(self) -> None:
        self._raw.flush()

    def load(self, step: Optional[int] = None) -> Optional[Checkpoint]:
        """The step `step` (the latest if None), or None if it is not stored."""
        d = self._raw.load(None if step is None else int(step))
        if d is None:
            return None
        tensors = {name: _array(dt, shape, data) for name, (dt, shape, data) in d["tensors"].items()}
        for name, data in d["blobs"].items():
            tensors[name] = np.frombuffer(data, dtype=np.uint8)
        return Checkpoint(d["step"], d["timestamp"], d["loss_cid"], d["metrics"], tensors)

    def steps(self):
        return self._raw.steps()

    def latest_step(self) -> Optional[int]:
        return self._raw.latest_step()

    def remove(self, step: int) -> bool:
        return self._raw.remove(int(step))

    def gc(self, keep_last=None, keep_every=None):
        return self._raw.gc(keep_last, keep_every)

    def verify(self):
        ok, steps_ok, bytes_checked, damaged = self._raw.verify()
        return _Report(ok, steps_ok, bytes_checked, damaged)

    def stats(self) -> dict:
        return self._raw.stats()

    def close(self) -> None:
        """Finish background saves and close."""
        self._raw.close()

    def __len__(self):
        return len(self.steps())

    def __contains__(self, step):
        return step in self.steps()

    def __getitem__(self, step):
        ck = self.load(step)
        if ck is None:
            raise KeyError(step)
        return ck

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


@dataclass
class _Report:
    ok: bool
    steps_ok: int
    bytes_checked: int
    damaged: list


def open(path, read_only: bool = False) -> Store:  # noqa: A001  (the package's verb)
    """Open (or create, unless read_only) the store at `path`."""
    return Store(path, read_only)
