"""ckptstore: transactional, deduplicated, verified training checkpoints.

    import ckptstore
    with ckptstore.open("run.ckpt") as store:
        info = store.save(step, {"w": np_array, "rng": b"..."}, metrics={"loss": 0.42})
        ck = store.load()            # the latest step, or None

Arrays keep their dtype and shape; bytes-like values are untyped blobs and
load back as 1-D uint8 arrays.

Copies: `save` hashes and writes each C-contiguous little-endian array
straight from its memory (others are first made so: one copy); do not
change an array from another thread while its save runs. `save_async`
copies every array once before it returns (a snapshot: the arrays may
change afterwards). `load` returns arrays that view the bytes the store
read, with no further copy; they are writable and own those bytes.
Untyped blobs (bytes) are copied once either way.

Object storage: `ckptstore.open(path, replicate_to="s3://bucket/run")`
uploads every commit in the background (`flush()` waits for it);
`store.push(url)` uploads once; `ckptstore.Remote(url)` lists, loads and
pulls steps from the bucket alone. Multi-rank jobs: each rank saves its
shard with `Remote(url).shard(rank, world_size).save(step, state)` (or
`ckptstore.torch.save(remote.shard(rank, world_size), step, model=...)`);
a step is listed only once every rank's shard has landed.

PyTorch: `ckptstore.torch`.
"""

import operator
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _hf

from ._ckptstore import (  # noqa: F401  (re-exported)
    MAX_WORLD_SIZE,
    CommitInfo,
    CorruptError,
    Error,
    HfExport,
    LockedError,
    PushReport,
    RawGlobalStep,
    RawRemote,
    RawStore,
    ReplicationStatus,
    ShardInfo,
    ShardStatus,
    StepExistsError,
    StepInfo,
    StoreStats,
    Tensor,
    VerifyReport,
    __version__,
)

# The errors pickle by the name users import them under (DCP sends a
# rank's exception to the coordinator pickled, and its process mode
# between processes): `ckptstore.Error`, not the compiled core's
# `CkptError`.
for _error in (Error, StepExistsError, CorruptError, LockedError):
    _error.__module__ = "ckptstore"
Error.__name__ = Error.__qualname__ = "Error"

# What a state maps names to: an array, bytes (an untyped blob), or a
# Tensor given by its bytes.
Value = Union[np.ndarray, bytes, bytearray, memoryview, Tensor]
_RawTensor = Tuple[str, str, List[int], Any]
# A tensor to save: as _RawTensor, with its chunks' hashes if known.
_RawSaved = Tuple[str, str, List[int], Any, Optional[Any]]

__all__ = [
    "__version__",
    "open",
    "remove_store",
    "Store",
    "Remote",
    "Shard",
    "ShardInfo",
    "ShardStatus",
    "Checkpoint",
    "CommitInfo",
    "SaveCost",
    "DTYPE_NAMES",
    "HfExport",
    "step_number",
    "PushReport",
    "ReplicationStatus",
    "StepInfo",
    "StoreStats",
    "Tensor",
    "Value",
    "VerifyReport",
    "Error",
    "StepExistsError",
    "CorruptError",
    "LockedError",
]

# A dtype's name in numpy or torch -> its safetensors name in the store:
# the one dtype table of the package (numpy and torch share their names;
# the float8 types are torch's, bfloat16 numpy's through ml_dtypes).
DTYPE_NAMES: Dict[str, str] = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "float16": "F16",
    "bfloat16": "BF16",
    "uint32": "U32",
    "int32": "I32",
    "float32": "F32",
    "uint64": "U64",
    "int64": "I64",
    "float64": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}
_FROM_STORE = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass
class Checkpoint:
    """A loaded step: tensors by name as numpy arrays (dtype and shape kept)."""

    step: int
    timestamp: int
    loss_cid: Optional[str]
    metrics: Dict[str, float]
    tensors: Dict[str, np.ndarray] = field(default_factory=dict)


def _split(state: Mapping[str, Value]) -> Tuple[List[_RawSaved], List[Tuple[str, bytes]]]:
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of name -> array or bytes, not {type(state).__name__}")
    tensors: List[_RawTensor] = []
    blobs: List[Tuple[str, bytes]] = []
    for name, value in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state keys must be str, not {type(name).__name__}")
        if isinstance(value, (bytes, bytearray, memoryview)):
            blobs.append((name, bytes(value)))
            continue
        if isinstance(value, Tensor):
            tensors.append((name, value.dtype, list(value.shape), value.data, value.hashes))
            continue
        if not isinstance(value, np.ndarray):
            raise TypeError(f"{name!r}: expected a numpy array or bytes, not {type(value).__name__}")
        dtype = DTYPE_NAMES.get(value.dtype.name)
        if dtype is None:
            raise TypeError(f"{name!r}: dtype {value.dtype} is not supported")
        tensors.append((name, dtype, list(value.shape), _contiguous_le(value), None))
    return tensors, blobs


def _targets(into: Mapping[str, "np.ndarray | Tensor"]) -> Tuple[List[_RawTensor], Dict[str, np.ndarray]]:
    """The arrays of `load(into=...)` that can be filled in place (writable,
    C-contiguous, little-endian, a known dtype), and name -> the array that
    a filled tensor is in the result."""
    targets: List[_RawTensor] = []
    given: Dict[str, np.ndarray] = {}
    for name, value in into.items():
        if isinstance(value, Tensor):
            dtype, shape, array = value.dtype, list(value.shape), value.data
        elif isinstance(value, np.ndarray):
            dtype = DTYPE_NAMES.get(value.dtype.name)  # type: ignore[assignment]
            shape, array = list(value.shape), value
        else:
            raise TypeError(f"{name!r}: expected a numpy array or a Tensor, not {type(value).__name__}")
        fits = (
            dtype is not None
            and isinstance(array, np.ndarray)
            and array.flags["C_CONTIGUOUS"]
            and array.flags["WRITEABLE"]
            and array.dtype.byteorder != ">"
        )
        if fits:
            targets.append((name, dtype, shape, array))
            given[name] = array
    return targets, given


def _contiguous_le(array: np.ndarray) -> np.ndarray:
    """`array` itself when C-contiguous and little-endian, else such a copy
    (ascontiguousarray would also turn a 0-d array into a 1-d one)."""
    if not array.flags["C_CONTIGUOUS"]:
        array = array.copy(order="C")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return array


def _metrics(metrics: Optional[Mapping[str, float]]) -> Dict[str, float]:
    return {str(k): float(v) for k, v in (metrics or {}).items()}


def _bytes_array(buffer: Any) -> np.ndarray:
    """A writable 1-D uint8 array viewing a loaded Buffer (no copy)."""
    return np.asarray(buffer)


def _numpy_dtype(store_dtype: str) -> Optional[np.dtype]:
    """The numpy dtype of a store dtype, or None where numpy lacks it
    (the F8 types; BF16 without ml_dtypes)."""
    name = _FROM_STORE.get(store_dtype)
    if name is None or name.startswith("float8"):
        return None
    if name == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401

            return np.dtype("bfloat16")
        except (ImportError, TypeError):
            return None
    return np.dtype(name)


def _array(dtype: str, shape: List[int], buffer: Any) -> np.ndarray:
    data = _bytes_array(buffer)
    np_dtype = _numpy_dtype(dtype)
    if np_dtype is None:
        # A dtype numpy lacks: the bytes.
        return data
    return data.view(np_dtype.newbyteorder("<")).reshape(tuple(shape))


def _checkpoint(d: Optional[Dict[str, Any]]) -> Optional[Checkpoint]:
    """A Checkpoint from a loaded step's dict, or None."""
    if d is None:
        return None
    tensors = {name: _array(dt, shape, data) for name, (dt, shape, data) in d["tensors"].items()}
    for name, data in d["blobs"].items():
        tensors[name] = _bytes_array(data)
    return Checkpoint(d["step"], d["timestamp"], d["loss_cid"], d["metrics"], tensors)


def step_number(step: Any) -> int:
    """`step` as a step number: an int (or anything `operator.index`
    takes), not a bool, float or str, from 0 to 2**64 - 1 (TypeError,
    ValueError otherwise). Every call that takes a step checks it so."""
    if isinstance(step, bool):
        raise TypeError(f"a step is an int, not a bool ({step!r})")
    try:
        n = operator.index(step)
    except TypeError:
        raise TypeError(f"a step is an int, not {type(step).__name__} ({step!r})") from None
    if not 0 <= n < 1 << 64:
        raise ValueError(f"step {n}: steps are 0 to 2**64 - 1")
    return n


_step = step_number


def _optional_step(step: Any) -> Optional[int]:
    return None if step is None else _step(step)


class Handle:
    """A background save: `result()` waits and returns its CommitInfo."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def done(self) -> bool:
        return bool(self._raw.done())

    def result(self) -> CommitInfo:
        """Wait for the save: its CommitInfo, or its error raised."""
        info: CommitInfo = self._raw.result()
        return info


class Store:
    """An open checkpoint store. Use `ckptstore.open`."""

    def __init__(
        self,
        path: "os.PathLike[str] | str",
        read_only: bool = False,
        cache_size: Optional[int] = None,
        replicate_to: "Remote | str | None" = None,
        threads: Optional[int] = None,
        background_threads: Optional[int] = None,
        pack_files: bool = True,
    ) -> None:
        url = replicate_to.url if isinstance(replicate_to, Remote) else replicate_to
        self._raw = RawStore(str(path), read_only, cache_size, url, threads, background_threads, pack_files)

    def save(
        self,
        step: int,
        state: Mapping[str, Value],
        metrics: Optional[Mapping[str, float]] = None,
        replace: bool = False,
    ) -> CommitInfo:
        """Commit `state` as `step`; durable when it returns. A stored step
        of that number raises StepExistsError, or with `replace=True` is
        replaced in the same transaction (a crash leaves one or the other)."""
        tensors, blobs = _split(state)
        return self._raw.save(_step(step), tensors, blobs, _metrics(metrics), replace)

    def save_async(
        self, step: int, state: Mapping[str, Value], metrics: Optional[Mapping[str, float]] = None
    ) -> Handle:
        """Queue `state` for commit in the background; the arrays are copied now."""
        tensors, blobs = _split(state)
        return Handle(self._raw.save_async(_step(step), tensors, blobs, _metrics(metrics)))

    def flush(self) -> None:
        self._raw.flush()

    def load(
        self, step: Optional[int] = None, into: Optional[Mapping[str, "np.ndarray | Tensor"]] = None
    ) -> Optional[Checkpoint]:
        """The step `step` (the latest if None), or None if it is not stored.

        `into` maps tensor names to arrays (or `Tensor`s over uint8 arrays)
        to read into in place: each whose dtype and shape are the stored
        tensor's, and which is writable and C-contiguous, is filled (every
        chunk hash-checked first; no new memory, no second copy) and is
        the very object found in the result's `tensors` (a `Tensor`'s
        `data`); the others are loaded as usual. Do not use the arrays from
        another thread meanwhile. On an error an array may hold part of the
        step, never bytes that failed a check."""
        if not into:
            return _checkpoint(self._raw.load(_optional_step(step)))
        targets, given = _targets(into)
        got = self._raw.load_into(_optional_step(step), targets)
        if got is None:
            return None
        d, filled = got
        ck = _checkpoint(d)
        assert ck is not None
        for name in filled:
            ck.tensors[name] = given[name]
        return ck

    def steps(self) -> List[int]:
        """The stored steps, ascending."""
        return self._raw.steps()

    def latest_step(self) -> Optional[int]:
        return self._raw.latest_step()

    def info(self, step: int) -> Optional[StepInfo]:
        """`step`'s metadata (metrics, blob lengths, tensor dtypes and
        shapes) without reading its data; None when it is not stored."""
        return self._raw.info(_step(step))

    def remove(self, step: int) -> bool:
        return self._raw.remove(_step(step))

    def content_digest(self, step: int) -> Optional[str]:
        """The identity of `step`'s content (hex BLAKE3 over its entries'
        names, dtypes, shapes and chunk hashes), read from its manifest;
        equal in two stores holding the same entries and bytes. None when
        the step is not stored."""
        return self._raw.content_digest(_step(step))

    def get_blob(self, step: int, name: str) -> Optional[bytes]:
        """The bytes of blob `name` of step `step`, hash-checked, without
        reading the step's other entries; None if either is not stored."""
        return self._raw.get_blob(_step(step), name)

    def read_ranges(
        self, step: int, reads: Sequence[Tuple[str, int, "np.ndarray"]], *, digest: Optional[str] = None
    ) -> bool:
        """Fill each `(name, start, array)` of `reads` (a writable
        C-contiguous array) with the bytes of entry `name` of step `step`
        from byte `start` on, as many as the array holds. Only the chunks
        holding those bytes are read, each hash-checked before its bytes
        reach the array: a step can be read in pieces of any size without
        holding it whole. False (nothing filled) if the step is not stored
        or, `digest` given, if its `content_digest` is another. An entry
        the step does not store, or bytes beyond its end: ValueError."""
        return self._raw.read_ranges(_step(step), digest, [(n, int(s), a) for n, s, a in reads])

    def gc(
        self,
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
        allow_deleting_all: bool = False,
    ) -> List[int]:
        """Apply a retention policy; the steps removed. A policy that keeps
        nothing (`keep_last=0`) needs `allow_deleting_all=True`."""
        return self._raw.gc(keep_last, keep_every, allow_deleting_all)

    def copy_to(self, path: "os.PathLike[str] | str") -> List[int]:
        """Copy every step and pin into a new store at `path`, its pack files
        with it (each step hash-checked; safe while another process writes
        this store; `path` is named only when the copy is complete). Returns
        the steps copied. Copying the store file alone would leave its pack
        files behind."""
        return self._raw.copy_to(path)

    def export_hf(
        self,
        step: int,
        directory: "os.PathLike[str] | str",
        max_shard_size: "int | str" = "5GB",
        prefix: Optional[str] = None,
        dtype: Any = None,
    ) -> HfExport:
        """Write step `step` into `directory` as a Hugging Face checkpoint
        (see `ckptstore.dcp.export_hf`)."""
        return _hf.export(self._raw, _step(step), directory, max_shard_size, prefix, dtype)

    def verify(self) -> VerifyReport:
        """Hash-check every step."""
        return self._raw.verify()

    def stats(self) -> StoreStats:
        return self._raw.stats()

    def push(self, remote: "Remote | str") -> PushReport:
        """Upload every step the bucket (a URL or a Remote, whose grace
        period is kept) lacks. Refused (ValueError) when the prefix holds
        another store's run: see `Remote.adopt`."""
        remote = remote if isinstance(remote, Remote) else Remote(str(remote))
        return remote._raw.push(self._raw)

    @property
    def store_id(self) -> str:
        """The store's UUID; it names the store's run in a bucket
        (`Remote.owner`)."""
        return self._raw.store_id()

    def replication_status(self) -> Optional[ReplicationStatus]:
        """Where background replication (`replicate_to`) stands, or None."""
        return self._raw.replication_status()

    def close(self) -> None:
        """Finish background saves, wait for background replication to
        cover every save (`replicate_to`), and close. Raises the first
        failure of either; uploads still missing are made by the next
        store opened with `replicate_to` on this file (it pushes what the
        bucket lacks when it opens), not by this one."""
        self._raw.close()

    def __len__(self) -> int:
        return len(self.steps())

    def __contains__(self, step: object) -> bool:
        return self._raw.contains(_step(step))

    def __getitem__(self, step: int) -> Checkpoint:
        ck = self.load(_step(step))
        if ck is None:
            raise KeyError(step)
        return ck

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False


def remove_store(path: "os.PathLike[str] | str") -> bool:
    """Delete the store at `path` and its pack files (`PATH.packs/`);
    False if there is none. Refused (LockedError) while another process
    writes it; a file that does not open as a store is left alone (the
    open's error)."""
    return RawStore.remove_store(path)


def open(  # noqa: A001
    path: "os.PathLike[str] | str",
    read_only: bool = False,
    cache_size: Optional[int] = None,
    replicate_to: "Remote | str | None" = None,
    threads: Optional[int] = None,
    background_threads: Optional[int] = None,
    pack_files: bool = True,
) -> Store:
    """Open (or create, unless read_only) the store at `path`; `cache_size`
    (bytes) sets the page cache (StoreOptions::cache_size in Rust);
    `replicate_to` (a URL or a Remote) uploads every commit to a bucket in
    the background, retried until it lands; `flush()` waits for it.
    `threads` (default: the machine's cores) caps the threads a save, load
    or verify hashes and copies on; `background_threads` (default 1) those
    of a `save_async`, so that training keeps its cores. With `pack_files`
    (the default) a save of 4 MiB or more writes its new chunks to a pack
    file beside the store (`PATH.packs/`) instead of the redb file: one
    copy fewer on save and load. A store is its file and that directory:
    move them together, copy with `Store.copy_to` (`ckpt cp`), remove with
    `remove_store`
    (StoreOptions::pack_files in Rust; docs/design.md)."""
    return Store(path, read_only, cache_size, replicate_to, threads, background_threads, pack_files)


# The bucket's classes build on the helpers above.
from ._cost import SaveCost  # noqa: E402
from ._remote import Remote, Shard  # noqa: E402
