"""PyTorch checkpoints: model and optimizer state_dicts in a ckptstore.

    import ckptstore, ckptstore.torch as ct
    with ckptstore.open("run.ckpt") as store:
        ct.save(store, step, model=model, optimizer=opt, metrics={"loss": l})
        h = ct.save(store, step, model=model, optimizer=opt, blocking=False)
        step = ct.load(store, model=model, optimizer=opt)   # the latest

    # A multi-rank job: each rank saves its shard; the step is listed once
    # every rank's has landed.
    shard = ckptstore.Remote("s3://bucket/run").shard(rank, world_size)
    ct.save(shard, step, model=model, optimizer=opt)
    ct.load(shard, model=model, optimizer=opt)   # the latest complete step

Every tensor of the state dicts (and of `extra`) is stored as a typed
tensor named `model/<key>`, `optimizer/<path>` or `extra/<path>`; the rest
of their structure (nesting, ints and floats, param_groups, tuples) is one
JSON blob, `torch/structure`. Nothing is pickled, so loading runs no code
from the file. Unchanged tensors (a frozen part of a model) are stored
once across steps.

Copies: a blocking save writes CPU tensors from their own memory; CUDA
tensors are first copied to the host. `blocking=False` copies every tensor
before it returns, so in-place updates afterwards never reach the
checkpoint. `load` from a `Store` reads each tensor straight into the model's
and the optimizer's own tensor when it has the stored dtype and shape (a
plain, contiguous CPU tensor): one copy, no new memory. Other tensors are
built over the bytes the store read and `load_state_dict` copies them in.
"""

import json
from typing import Any, Dict, List, Literal, Mapping, Optional, Tuple, Union, overload

import numpy as np
import torch

from ._ckptstore import CommitInfo, ShardInfo, Tensor
from ._convert import DTYPE_NAMES
from ._remote import Shard
from ._store import Handle, Store
from ._structure import Flattener, Rebuilder, arrays, dtype_name, sharded_kind

_Model = Optional[torch.nn.Module]
_Optimizer = Optional[torch.optim.Optimizer]
_Metrics = Optional[Mapping[str, float]]

__all__ = ["save", "load", "load_extra", "state"]

_STRUCTURE = "torch/structure"
_FORMAT = 1


def state(
    model: _Model = None, optimizer: _Optimizer = None, extra: Any = None
) -> Tuple[Dict[str, torch.Tensor], bytes]:
    """The tensors (name -> torch.Tensor) and structure blob of a save."""
    f = Flattener()
    structure: Dict[str, Any] = {"format": _FORMAT}
    if model is not None:
        sd = model.state_dict()
        # A module's get_extra_state() is stored under its `_extra_state`
        # key like `extra`: tensors typed, the rest as structure.
        structure["model"] = [[k, f.walk(v, f"model/{k}")] for k, v in sd.items()]
    if optimizer is not None:
        structure["optimizer"] = f.walk(optimizer.state_dict(), "optimizer")
    if extra is not None:
        structure["extra"] = f.walk(extra, "extra")
    blob = json.dumps(structure, separators=(",", ":")).encode()
    return f.tensors, blob


@overload
def save(
    store: Store,
    step: int,
    model: _Model = None,
    optimizer: _Optimizer = None,
    metrics: _Metrics = None,
    extra: Any = None,
    blocking: Literal[True] = True,
) -> CommitInfo: ...
@overload
def save(
    store: Store,
    step: int,
    model: _Model = None,
    optimizer: _Optimizer = None,
    metrics: _Metrics = None,
    extra: Any = None,
    *,
    blocking: Literal[False],
) -> Handle: ...
@overload
def save(
    store: Shard,
    step: int,
    model: _Model = None,
    optimizer: _Optimizer = None,
    metrics: _Metrics = None,
    extra: Any = None,
    blocking: Literal[True] = True,
) -> ShardInfo: ...
def save(
    store: Union[Store, Shard],
    step: int,
    model: _Model = None,
    optimizer: _Optimizer = None,
    metrics: _Metrics = None,
    extra: Any = None,
    blocking: bool = True,
) -> Union[CommitInfo, ShardInfo, Handle]:
    """Store `model`'s and `optimizer`'s state (and `extra`: tensors, numbers,
    strings, lists, tuples, dicts) as `step`.

    blocking=True: durable when it returns; the CommitInfo.
    blocking=False: returns once every tensor is copied (a snapshot), with
    a handle whose `result()` waits for the commit.
    """
    tensors, blob = state(model, optimizer, extra)
    values: Dict[str, Any] = dict(arrays(tensors))
    if _STRUCTURE in values:
        raise ValueError(f"{_STRUCTURE!r} is the name of the structure blob")
    values[_STRUCTURE] = blob
    if blocking:
        return store.save(step, values, metrics)
    return store.save_async(step, values, metrics)


def load(
    store: Union[Store, Shard],
    model: _Model = None,
    optimizer: _Optimizer = None,
    step: Optional[int] = None,
    strict: bool = True,
) -> Optional[int]:
    """Restore `model` and `optimizer` in place from `step` (the latest if
    None) and return the step; None (and nothing restored) when the store is
    empty; KeyError when `step` is not stored. `load_extra` gives `extra`.
    """
    own = _in_place(model, optimizer) if isinstance(store, Store) else {}
    step, structure, tensors, filled = _load(store, step, own)
    if step is None:
        return None
    rebuild = Rebuilder(tensors, {name: own[name][0] for name in filled})
    if model is not None:
        if "model" not in structure:
            raise KeyError(f"step {step} has no model state")
        sd = {k: rebuild.walk(ref) for k, ref in structure["model"]}
        model.load_state_dict(sd, strict=strict)
    if optimizer is not None:
        if "optimizer" not in structure:
            raise KeyError(f"step {step} has no optimizer state")
        optimizer.load_state_dict(rebuild.walk(structure["optimizer"]))
    return step


def load_extra(store: Union[Store, Shard], step: Optional[int] = None) -> Any:
    """The `extra` saved with `step` (the latest if None), or None."""
    step, structure, tensors, _ = _load(store, step, {})
    if step is None or "extra" not in structure:
        return None
    return Rebuilder(tensors).walk(structure["extra"])


def _in_place(model: _Model, optimizer: _Optimizer) -> Dict[str, Tuple[torch.Tensor, Tensor]]:
    """name -> (tensor, ckptstore.Tensor over its memory) for each tensor of
    the model's and the optimizer's current state that a load can fill in
    place: plain CPU tensors, contiguous, of a dtype the store knows."""
    out: Dict[str, Tuple[torch.Tensor, Tensor]] = {}

    def add(name: str, t: torch.Tensor) -> None:
        dtype = DTYPE_NAMES.get(dtype_name(t.dtype))
        plain = t.device.type == "cpu" and t.layout == torch.strided and sharded_kind(t) is None
        if dtype is None or not plain or t.is_quantized or not t.is_contiguous() or name in out:
            return
        t = t.detach()
        out[name] = (t, Tensor(dtype, list(t.shape), t.reshape(-1).view(torch.uint8).numpy()))

    def walk(obj: Any, name: str) -> None:
        if isinstance(obj, torch.Tensor):
            add(name, obj)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{name}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{name}/{i}")

    if model is not None:
        for k, v in model.state_dict().items():
            walk(v, f"model/{k}")
    if optimizer is not None:
        walk(optimizer.state_dict(), "optimizer")
    return out


def _load(
    store: Union[Store, Shard], step: Optional[int], own: Dict[str, Tuple[torch.Tensor, Tensor]]
) -> Tuple[Any, Any, Any, List[str]]:
    """(step, structure, name -> uint8 array over the loaded bytes, names of
    `own` read into in place)."""
    if own:
        assert isinstance(store, Store)
        ck = store.load(step, into={name: t for name, (_, t) in own.items()})
    else:
        ck = store.load(step)
    if ck is None:
        if step is not None:
            raise KeyError(step)
        return None, None, None, []
    filled = [name for name, (_, t) in own.items() if ck.tensors.get(name) is t.data]
    for name in filled:
        del ck.tensors[name]
    blob = ck.tensors.pop(_STRUCTURE, None)
    if blob is None:
        raise ValueError(f"step {ck.step} was not saved by ckptstore.torch")
    structure = json.loads(blob.tobytes())
    if structure.get("format") != _FORMAT:
        raise ValueError(f"step {ck.step}: unknown ckptstore.torch format {structure.get('format')}")
    # Each array views the bytes the store read: as uint8, no copy.
    tensors = {name: a.reshape(-1).view(np.uint8) for name, a in ck.tensors.items()}
    return ck.step, structure, tensors, filled
