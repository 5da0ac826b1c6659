"""`ckptstore.dcp.export_hf` and `consolidate`: a DCP step of a target out
as a Hugging Face checkpoint or one safetensors file, written by the Rust
core."""

import os
from typing import Any, List, Optional

from .._ckptstore import HfExport
from ._choose import target_of
from ._targets import UserTarget


def export_hf(
    target: UserTarget,
    step: Optional[int],
    directory: "os.PathLike[str] | str",
    max_shard_size: "int | str" = "5GB",
    prefix: Optional[str] = None,
    dtype: Any = None,
) -> HfExport:
    """Write DCP step `step` of `target` (a bucket URL or a local store; the
    latest step if None) into `directory` as a Hugging Face checkpoint:
    safetensors shards of at most `max_shard_size` ("5GB", "500MB", "2GiB"
    or bytes; one shard is written as `model.safetensors`), named and split
    as `save_pretrained` does, and `model.safetensors.index.json` (its
    `weight_map` and `metadata.total_size` exact). Tensors are whole, under
    their fully qualified names; with `prefix` (e.g. "model."), only those
    under it, stripped. `dtype` ("bf16", "f16", "f32" or a torch dtype)
    casts floating tensors, lossily when it narrows. One tensor is in
    memory at a time, every chunk hash-checked; an index already in
    `directory` is removed first and the new one written last, each shard
    durably under a temporary name first, so a killed export never leaves
    an index naming a missing, partial or overwritten shard. The model's
    `config.json` is the caller's to write beside (`model.config.save_pretrained`).
    As `ckpt export TARGET STEP --hf -o DIR`."""
    source = target_of(target)
    resolved = step if step is not None else source.latest()
    if resolved is None:
        raise FileNotFoundError(f"{source.description} holds no complete step")
    return source.export_hf(resolved, directory, max_shard_size, prefix, dtype)


def consolidate(
    target: UserTarget, step: Optional[int], path: "os.PathLike[str] | str", prefix: Optional[str] = None
) -> List[str]:
    """Write DCP step `step` of `target` (the latest if None) to `path` as one
    safetensors file of whole, unsharded tensors under their fully
    qualified names; with `prefix` (e.g. "model."), only the names under
    it, stripped, so that an unsharded model's `load_state_dict` and
    `safetensors.torch.load_file` take it. Non-tensor values are left out.
    The names written.

    One tensor is in memory at a time (read in 32 MiB windows from a
    bucket, every chunk hash-checked), written durably by the Rust core,
    as `ckpt export URL STEP -o FILE --prefix P` does."""
    source = target_of(target)
    resolved = step if step is not None else source.latest()
    if resolved is None:
        raise FileNotFoundError(f"{source.description} holds no complete step")
    return source.consolidate(resolved, path, prefix)
