"""What ckptstore.dcp's writer and reader share: the target (a bucket URL
or a local store), one Remote per bucket per process, and how either is
sent to another process."""

import os
from typing import Any, Dict, Optional, Tuple, Union

from . import Remote, Store, step_number
from . import open as _open_store

METADATA = ".dcp/metadata.json"
"""The entry of the coordinator's shard that holds DCP's metadata."""

Target = Union[str, "os.PathLike[str]", Store]


# One Remote per bucket URL in a process: it remembers where the chunks it
# wrote lie in the bucket's packs, so a save of unchanged tensors uploads
# nothing and asks nothing per chunk. Keyed by process too: a forked child
# opens its own.
_REMOTES: Dict[Tuple[int, str], Remote] = {}


def _remote(target: Any) -> Remote:
    key = (os.getpid(), str(target))
    found = _REMOTES.get(key)
    if found is None:
        found = _REMOTES[key] = Remote(str(target))
    return found


def _is_url(target: Any) -> bool:
    return isinstance(target, str) and target.split("://", 1)[0] in ("s3", "file")


class _SentAsUrl:
    """Pickles as its target URL and arguments (DCP's process mode sends
    the writer to another process); a local store stays in its process."""

    _target: Any

    def _arguments(self) -> Dict[str, Any]:
        raise NotImplementedError

    def __getstate__(self) -> Dict[str, Any]:
        if not _is_url(self._target):
            raise TypeError(
                f"a {type(self).__name__} over a local store cannot be sent to another process "
                "(dcp.async_save in process mode): use a bucket URL, or thread mode"
            )
        return self._arguments()

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]


class _local:
    """A local target as a context manager: an open Store is used as it is;
    a path is opened and closed around the use."""

    def __init__(self, target: Target, read_only: bool = False) -> None:
        self._target, self._read_only = target, read_only
        self._opened: Optional[Store] = None

    def __enter__(self) -> Store:
        if isinstance(self._target, Store):
            return self._target
        self._opened = _open_store(self._target, read_only=self._read_only)
        return self._opened

    def __exit__(self, *exc: object) -> None:
        if self._opened is not None:
            self._opened.close()


def _describe(target: Target) -> str:
    return str(target) if not isinstance(target, Store) else "the store"


def _is_step_id(checkpoint_id: Any) -> bool:
    """Whether `checkpoint_id` is a step number (DCP's checkpoint id for
    ckptstore.dcp)."""
    try:
        step_number(checkpoint_id)
        return True
    except (TypeError, ValueError):
        return False
