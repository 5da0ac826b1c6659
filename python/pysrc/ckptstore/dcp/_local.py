"""ckptstore.dcp's local-store target: one process's step of a store (a
path, opened and closed around each use, or an open `Store`), committed
in one transaction and read in place."""

import os
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .._ckptstore import HfExport, SaveRecord, ShardUpload
from .._store import Store
from .._store import open as open_store
from ._rank_local import SavedMetadata, SaveKind
from ._targets import METADATA, Deliver, Opened, Piece, Put, ShardWrite, Slice, describe, read_in_batches
from ._wire import Group


class LocalStore:
    """A local store (a path, opened and closed around each use, or an open
    `Store`): one process's step, committed in one transaction."""

    many_ranks = False
    takes_rank_local = False
    sendable = False
    fans_out = True
    readers: Optional[Dict[int, List[int]]] = None
    nodes: Optional[List[int]] = None
    group: Optional[Group] = None

    def __init__(self, target: Union[str, "os.PathLike[str]", Store]) -> None:
        self._target = target
        self.description = describe(target)
        self.pool_key: Hashable = id(target) if isinstance(target, Store) else os.fspath(target)

    def _use(self, read_only: bool = False) -> "_Using":
        return _Using(self._target, read_only)

    def committed(self, step: int) -> bool:
        with self._use() as store:
            return step in store.steps()

    def latest(self) -> Optional[int]:
        with self._use(read_only=True) as store:
            return store.latest_step()

    def put(self, write: ShardWrite) -> Put:
        if isinstance(write.then, ShardUpload.ChunksOnly):
            return Put("", 0, 0)  # the step is committed whole, by its shard
        if isinstance(write.then, ShardUpload.RankLocal):
            raise NotImplementedError("a local store takes no rank-local save of several ranks")
        # One process: its shard, committed, is the step.
        with self._use() as store:
            info = store.save(write.step, write.values, replace=write.replace, record=write.record)
        return Put("", info.bytes_written, info.bytes_reused)

    def layout_entries(self, sizes: List[Dict[str, int]]) -> Dict[str, bytes]:
        return {}

    def open(self, step: Optional[int], commit: Optional[str]) -> Opened:
        if step is None:
            step = self.latest()
            if step is None:
                raise FileNotFoundError(f"{self.description} holds no complete step")
        return OpenedLocal(self, step, commit)

    def consolidate(self, step: int, path: "os.PathLike[str] | str", prefix: Optional[str]) -> List[str]:
        with self._use(read_only=True) as store:
            if step not in store:
                raise FileNotFoundError(f"{self.description} has no step {step}")
            return store.consolidate(step, path, prefix)

    def export_hf(
        self, step: int, directory: "os.PathLike[str] | str", max_shard_size: "int | str", prefix: Optional[str], dtype: Any
    ) -> HfExport:
        with self._use(read_only=True) as store:
            return store.export_hf(step, directory, max_shard_size, prefix, dtype)


class OpenedLocal:
    """A local store's step, read in ranges: only the chunks holding a
    piece's bytes, each hash-checked, and only from the save opened (its
    content digest is the commit every rank reads). Every rank opens the
    store, so a rank handed bytes checks them against the chunk hashes of
    the manifest it read itself."""

    def __init__(self, target: LocalStore, step: int, commit: Optional[str]) -> None:
        self._target, self._step, self.step = target, step, step
        with target._use(read_only=True) as store:
            digest, info = store.content_digest(step), store.info(step)
            if digest is None or info is None:
                raise FileNotFoundError(f"{target.description} has no step {step}")
            if commit is not None and digest != commit:
                raise FileNotFoundError(f"step {step} of {target.description} was saved again while this load opened it")
            if METADATA not in info.blobs:
                raise ValueError(f"step {step} of {target.description} was not saved by ckptstore.dcp")
            self.commit: Optional[str] = digest
            self._lengths = dict(info.blobs)
            for name, t in info.tensors.items():
                self._lengths[name] = t.len
            self._metadata = np.empty(self._lengths[METADATA], dtype=np.uint8)
            self._fill(store, [(METADATA, 0, self._metadata)])

    def _fill(self, store: Store, reads: List[Tuple[str, int, np.ndarray]]) -> None:
        if not store.read_ranges(self._step, reads, digest=self.commit):
            raise self._gone()

    def saved_metadata(self, rank: int) -> SavedMetadata:
        return SavedMetadata(SaveKind.COLLECTIVE, 1, self._metadata.tobytes())  # one process's save

    def rank_document(self, rank: int) -> bytes:
        raise ValueError(f"step {self._step} of {self._target.description} is not a rank-local save")

    def length(self, rank: int, entry: str) -> int:
        if rank != 0 or entry not in self._lengths:
            raise ValueError(f"step {self._step} of {self._target.description}: rank {rank} stored no entry {entry!r}")
        return self._lengths[entry]

    def read(
        self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], deliver: Deliver, failure: Optional[BaseException]
    ) -> None:
        if failure is not None:
            raise failure
        with self._target._use(read_only=True) as store:

            def fill(batch: List[int], arrays: List[np.ndarray]) -> List[int]:
                self._fill(store, [(pieces[i][1], pieces[i][2], a) for i, a in zip(batch, arrays)])
                return batch

            read_in_batches(pieces, dest, deliver, fill)

    proves = True

    def _ranges(self, pieces: Sequence[Piece]) -> List[Tuple[str, int, int]]:
        for rank, entry, _, _ in pieces:
            self.length(rank, entry)  # a rank or entry the step does not have: ValueError
        return [(entry, start, n) for _, entry, start, n in pieces]

    def _gone(self) -> FileNotFoundError:
        return FileNotFoundError(
            f"step {self._step} of {self._target.description} was removed or saved again while this load read it"
        )

    def slices(self, pieces: Sequence[Piece]) -> List[List[Slice]]:
        with self._target._use(read_only=True) as store:
            found = store.slices(self._step, self._ranges(pieces), digest=self.commit)
        if found is None:
            raise self._gone()
        return found

    def read_proving(self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], proved: Sequence[Piece]) -> List[bytes]:
        reads = [(entry, start, dest[i]) for i, (entry, start, _) in enumerate(self._ranges(pieces))]
        with self._target._use(read_only=True) as store:
            proofs = store.read_ranges_proving(self._step, reads, self._ranges(proved), digest=self.commit)
        if proofs is None:
            raise self._gone()
        return proofs


class _Using:
    """A local target as a context manager: an open Store is used as it is;
    a path is opened and closed around the use."""

    def __init__(self, target: Union[str, "os.PathLike[str]", Store], read_only: bool) -> None:
        self._target, self._read_only = target, read_only
        self._opened: Optional[Store] = None

    def __enter__(self) -> Store:
        if isinstance(self._target, Store):
            return self._target
        self._opened = open_store(self._target, read_only=self._read_only)
        return self._opened

    def __exit__(self, *exc: object) -> None:
        if self._opened is not None:
            self._opened.close()
