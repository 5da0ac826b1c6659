"""`ckptstore.Store`: a store on local disk, opened with `ckptstore.open`."""

import os
from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import _hf
from ._ckptstore import (
    ChunkSlice,
    CommitInfo,
    HfExport,
    PushReport,
    Range,
    RawRemote,
    RawStore,
    ReplicationStatus,
    SaveRecord,
    StepInfo,
    StoreStats,
    Tensor,
    VerifyReport,
)
from ._convert import Checkpoint, Value, checkpoint_of, fill_targets, metrics_of, optional_step, split_state, step_number

if TYPE_CHECKING:
    from ._remote import Remote

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
        url = replicate_to if replicate_to is None or isinstance(replicate_to, str) else replicate_to.url
        self._raw = RawStore(str(path), read_only, cache_size, url, threads, background_threads, pack_files)

    def save(
        self,
        step: int,
        state: Mapping[str, Value],
        metrics: Optional[Mapping[str, float]] = None,
        replace: bool = False,
        record: Optional[SaveRecord] = None,
    ) -> CommitInfo:
        """Commit `state` as `step`; durable when it returns. A stored step
        of that number raises StepExistsError, or with `replace=True` is
        replaced in the same transaction (a crash leaves one or the other).
        `record` says how the step was saved (`info(step).save_record`)."""
        tensors, blobs = split_state(state)
        return self._raw.save(step_number(step), tensors, blobs, metrics_of(metrics), replace, record)

    def save_async(
        self,
        step: int,
        state: Mapping[str, Value],
        metrics: Optional[Mapping[str, float]] = None,
        record: Optional[SaveRecord] = None,
    ) -> Handle:
        """Queue `state` for commit in the background; the arrays are copied now."""
        tensors, blobs = split_state(state)
        return Handle(self._raw.save_async(step_number(step), tensors, blobs, metrics_of(metrics), record))

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
            return checkpoint_of(self._raw.load(optional_step(step)))
        targets, given = fill_targets(into)
        d = self._raw.load_into(optional_step(step), targets)
        if d is None:
            return None
        filled: List[str] = d.pop("filled")
        ck = checkpoint_of(d)
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
        return self._raw.info(step_number(step))

    def save_dir(self, step: int, path: "os.PathLike[str] | str") -> CommitInfo:
        """Commit directory `path` (any framework's checkpoint folder) as
        step `step`, in one transaction: each regular file an entry,
        unchanged chunks of earlier steps not written again. A link or a
        special file under it is refused (`ValueError`); a step already
        stored raises. `load_dir` writes it back."""
        return self._raw.save_dir(step_number(step), os.fspath(path))

    def load_dir(self, step: int, path: "os.PathLike[str] | str") -> List[str]:
        """Write step `step` (saved by `save_dir`) into directory `path`,
        which must not exist or be empty, whole or not at all, every byte
        checked: the paths written."""
        return self._raw.load_dir(step_number(step), os.fspath(path))

    def remove(self, step: int) -> bool:
        return self._raw.remove(step_number(step))

    def content_digest(self, step: int) -> Optional[str]:
        """The identity of `step`'s content (hex BLAKE3 over its entries'
        names, dtypes, shapes and chunk hashes), read from its manifest;
        equal in two stores holding the same entries and bytes. None when
        the step is not stored."""
        return self._raw.content_digest(step_number(step))

    def get_blob(self, step: int, name: str) -> Optional[bytes]:
        """The bytes of blob `name` of step `step`, hash-checked, without
        reading the step's other entries; None if either is not stored."""
        return self._raw.get_blob(step_number(step), name)

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
        ranges = [Range(n, int(s), a.nbytes) for n, s, a in reads]
        return self._raw.read_ranges(step_number(step), digest, ranges, [a for _, _, a in reads])

    def slices(
        self, step: int, ranges: Sequence[Tuple[str, int, int]], *, digest: Optional[str] = None
    ) -> Optional[List[List[ChunkSlice]]]:
        """Where the bytes of each `(name, start, len)` of `ranges` of step
        `step` lie in the store's chunks: its slices (`ChunkSlice`: the
        chunk's hash and length, the start and end in it), in order. None
        as `read_ranges` gives False."""
        return self._raw.slices(step_number(step), digest, [Range(n, int(s), int(k)) for n, s, k in ranges])

    def chunk_map(self, step: int, *, digest: Optional[str] = None) -> Optional[bytes]:
        """The chunk map of step `step` (where its entries lie in its
        chunks) as bytes to send to a rank that does not hold it, which
        takes it with `_ckptstore.ChunkMap(step, sent, digest)` only if it
        is of the save `digest` names. None as `read_ranges` gives False."""
        return self._raw.chunk_map(step_number(step), digest)

    def read_ranges_proving(
        self,
        step: int,
        reads: Sequence[Tuple[str, int, "np.ndarray"]],
        proved: Sequence[Tuple[str, int, int]],
        *,
        digest: Optional[str] = None,
    ) -> Optional[List[bytes]]:
        """`read_ranges`, and for each `(name, start, len)` of `proved` the
        proofs of its `slices`, back to back, made from checked bytes: a
        rank handed the range checks it with them against the store's
        chunk hashes (`SliceCheck`). None as `read_ranges` gives False."""
        return self._raw.read_ranges_proving(
            step_number(step),
            digest,
            [Range(n, int(s), a.nbytes) for n, s, a in reads],
            [a for _, _, a in reads],
            [Range(n, int(s), int(k)) for n, s, k in proved],
        )

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

    def consolidate(self, step: int, path: "os.PathLike[str] | str", prefix: Optional[str] = None) -> List[str]:
        """Write step `step`, saved by `ckptstore.dcp`, to `path` as one
        safetensors file of whole tensors (see `ckptstore.dcp.consolidate`);
        the names written."""
        return self._raw.consolidate(step_number(step), path, prefix)

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
        return _hf.export(self._raw, step_number(step), directory, max_shard_size, prefix, dtype)

    def verify(self) -> VerifyReport:
        """Hash-check every step."""
        return self._raw.verify()

    def stats(self) -> StoreStats:
        return self._raw.stats()

    def push(self, remote: "Remote | str") -> PushReport:
        """Upload every step the bucket (a URL or a Remote, whose grace
        period is kept) lacks. Refused (ValueError) when the prefix holds
        another store's run: see `Remote.adopt`."""
        if isinstance(remote, str):
            return RawRemote(remote, None).push(self._raw)
        return remote.push(self)

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
        return self._raw.contains(step_number(step))

    def __getitem__(self, step: int) -> Checkpoint:
        ck = self.load(step_number(step))
        if ck is None:
            raise KeyError(step)
        return ck

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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




def raw_store(store: Store) -> RawStore:
    """The compiled core's store under `store`, for the package's other
    classes that hand it to the core (`Remote.pull`, `Remote.adopt`)."""
    return store._raw

