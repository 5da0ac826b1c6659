"""Python values to and from the compiled core's: states (arrays,
bytes, `Tensor`s) into what it commits, loaded steps into `Checkpoint`s,
step numbers checked; the package's one dtype table."""

import importlib
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ._ckptstore import ChunkHashes, Tensor

# What a state maps names to: an array, bytes (an untyped blob), or a
# Tensor given by its bytes.
Value = Union[np.ndarray, bytes, bytearray, memoryview, Tensor]

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


def split_state(state: Mapping[str, Value]) -> Tuple[Dict[str, Tensor], Dict[str, bytes]]:
    """A state's tensors (arrays as `Tensor`s over their memory) and its
    untyped blobs, by name."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of name -> array or bytes, not {type(state).__name__}")
    tensors: Dict[str, Tensor] = {}
    blobs: Dict[str, bytes] = {}
    for name, value in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state keys must be str, not {type(name).__name__}")
        if isinstance(value, (bytes, bytearray, memoryview)):
            blobs[name] = bytes(value)
            continue
        if isinstance(value, Tensor):
            tensors[name] = value
            continue
        if not isinstance(value, np.ndarray):
            raise TypeError(f"{name!r}: expected a numpy array or bytes, not {type(value).__name__}")
        dtype = DTYPE_NAMES.get(value.dtype.name)
        if dtype is None:
            raise TypeError(f"{name!r}: dtype {value.dtype} is not supported")
        tensors[name] = Tensor(dtype, list(value.shape), contiguous_le(value))
    return tensors, blobs


def fill_targets(into: Mapping[str, "np.ndarray | Tensor"]) -> Tuple[Dict[str, Tensor], Dict[str, np.ndarray]]:
    """The arrays of `load(into=...)` that can be filled in place (writable,
    C-contiguous, little-endian, a known dtype), as `Tensor`s, and name ->
    the array that a filled tensor is in the result."""
    targets: Dict[str, Tensor] = {}
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
            targets[name] = Tensor(dtype, shape, array)
            given[name] = array
    return targets, given


def contiguous_le(array: np.ndarray) -> np.ndarray:
    """`array` itself when C-contiguous and little-endian, else such a copy
    (ascontiguousarray would also turn a 0-d array into a 1-d one)."""
    if not array.flags["C_CONTIGUOUS"]:
        array = array.copy(order="C")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return array


def metrics_of(metrics: Optional[Mapping[str, float]]) -> Dict[str, float]:
    return {str(k): float(v) for k, v in (metrics or {}).items()}


def bytesarray_of(buffer: Any) -> np.ndarray:
    """A writable 1-D uint8 array viewing a loaded Buffer (no copy)."""
    return np.asarray(buffer)


def numpy_dtype(store_dtype: str) -> Optional[np.dtype]:
    """The numpy dtype of a store dtype, or None where numpy lacks it
    (the F8 types; BF16 without ml_dtypes)."""
    name = _FROM_STORE.get(store_dtype)
    if name is None or name.startswith("float8"):
        return None
    if name == "bfloat16":
        try:
            importlib.import_module("ml_dtypes")  # registers bfloat16 with numpy

            return np.dtype("bfloat16")
        except (ImportError, TypeError):
            return None
    return np.dtype(name)


def array_of(dtype: str, shape: List[int], buffer: Any) -> np.ndarray:
    data = bytesarray_of(buffer)
    np_dtype = numpy_dtype(dtype)
    if np_dtype is None:
        # A dtype numpy lacks: the bytes.
        return data
    return data.view(np_dtype.newbyteorder("<")).reshape(tuple(shape))


def checkpoint_of(d: Optional[Dict[str, Any]]) -> Optional[Checkpoint]:
    """A Checkpoint from a loaded step's dict, or None."""
    if d is None:
        return None
    tensors = {name: array_of(dt, shape, data) for name, (dt, shape, data) in d["tensors"].items()}
    for name, data in d["blobs"].items():
        tensors[name] = bytesarray_of(data)
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



def optional_step(step: Any) -> Optional[int]:
    return None if step is None else step_number(step)
