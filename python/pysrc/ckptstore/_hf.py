"""Hugging Face export: what `Store.export_hf`, `Remote.export_hf` and
`ckptstore.dcp.export_hf` share (the size and dtype arguments)."""

import os
import re
from typing import Any, Optional, Union

from ._ckptstore import HfExport

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def shard_bytes(size: Union[int, str]) -> int:
    """A shard size as Hugging Face's `max_shard_size` takes it: bytes, or
    a string such as "5GB" (10**9 bytes), "500MB", "2GiB"."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(size))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"max_shard_size {size!r}: give bytes or a size such as '5GB', '500MB', '2GiB'")
        n = int(m.group(1)) * _UNITS[unit]
    if n <= 0:
        raise ValueError(f"max_shard_size {size!r} is not above 0 bytes")
    return n


def export(
    raw: Any,
    step: int,
    directory: "os.PathLike[str] | str",
    max_shard_size: Union[int, str],
    prefix: Optional[str],
    dtype: Any,
) -> HfExport:
    """Call `raw.export_hf` (a RawStore's or a RawRemote's) with the
    directory made and the arguments checked."""
    os.makedirs(directory, exist_ok=True)
    name = None if dtype is None else str(dtype)
    written: HfExport = raw.export_hf(int(step), os.fspath(directory), shard_bytes(max_shard_size), prefix, name)
    return written
