"""ckptstore.dcp's bucket target: shards uploaded by every rank, the
coordinator's commit naming exactly them (or, rank-locally, each rank's
commit of its own shard), read in ranged reads of neighbouring bytes;
one `Remote` per bucket URL in a process."""

import os
from typing import TYPE_CHECKING, Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

from .._ckptstore import EntryInfo, HfExport, SaveRecord, ShardId, ShardUpload, ShardValues
from .._remote import Remote, values_of
from . import _rank_local
from ._rank_local import RANK_METADATA, SavedMetadata, SaveKind
from ._targets import Deliver, Opened, Piece, Put, ShardWrite, Slice, read_in_batches
from ._wire import Group


# One Remote per bucket URL in a process, and one beside it per other
# compression setting sharing its knowledge (`Remote.compressing`): it
# remembers where the chunks written or read lie in the bucket's packs, so
# a save of unchanged tensors uploads nothing and asks nothing per chunk,
# whatever the setting of the save that wrote them. Keyed by process too:
# a forked child opens its own.
_REMOTES: Dict[Tuple[int, str, Optional[bool]], Remote] = {}


def remote_of(url: str, compress: Optional[bool] = None) -> Remote:
    """This process's `Remote` of bucket `url` (storing new chunks
    compressed or not; None: as the bucket's scheme says, `Remote`)."""
    base_key = (os.getpid(), str(url), None)
    base = _REMOTES.get(base_key)
    if base is None:
        base = _REMOTES[base_key] = Remote(str(url))
    if compress is None or compress == base.compression:
        return base
    key = (os.getpid(), str(url), compress)
    found = _REMOTES.get(key)
    if found is None:
        found = _REMOTES[key] = base.compressing(compress)
    return found


class Bucket:
    """A bucket: shards uploaded by every rank, the coordinator's commit
    naming exactly them."""

    many_ranks = True
    takes_rank_local = True
    sendable = True
    fans_out = True
    readers: Optional[Dict[int, List[int]]] = None
    nodes: Optional[List[int]] = None
    group: Optional[Group] = None

    def __init__(self, url: str, compress: Optional[bool] = None) -> None:
        self.url = self.description = url
        self.compress = None if compress is None else bool(compress)
        self.pool_key: Hashable = url

    @property
    def _remote(self) -> Remote:
        # Looked up at each use, not kept: a process forked after this
        # target was made uses a Remote of its own.
        return remote_of(self.url, self.compress)

    def committed(self, step: int) -> bool:
        return self._remote.open_global(step) is not None

    def latest(self) -> Optional[int]:
        return self._remote.latest_step()

    def put(self, write: ShardWrite) -> Put:
        w, then = write, write.then
        if isinstance(then, (ShardUpload.Commit, ShardUpload.CommitReported)):
            # One lock cycle: the coordinator's shard, then the commit.
            missing = [r for r, s in enumerate(then.shards) if not s and r != w.rank]
            if missing:
                raise ValueError(f"step {w.step}: no shard reported by ranks {missing}")
        # Data ahead of its shard is named by no shard yet: no record.
        record = None if isinstance(then, ShardUpload.ChunksOnly) else w.record
        shard, values = ShardId(w.step, w.rank, w.world), values_of(w.values, None, record)
        store = _rank_local.rendezvous() if isinstance(then, ShardUpload.RankLocal) else None
        if store is not None and isinstance(then, ShardUpload.RankLocal):
            return self._put_announced(shard, then.save, values, store)
        info = self._remote.write_shard(shard, then, values)
        return Put(info.shard, info.bytes_uploaded, info.bytes_skipped)

    def _put_announced(self, shard: ShardId, save: str, values: ShardValues, store: "Store") -> Put:
        """A rank-local save's shard, its step completed through the job's
        store: this rank's shard only, announced under its bucket lock
        (`_rank_local.announce`); the rank whose announcement completes the
        save commits the names told in the same lock cycle, then clears
        the save's keys. A relaunch's rank 0 first completes what a
        completing rank that died left whole."""
        if shard.rank == 0 and _rank_local.first_save_to(self.url):
            self._remote.complete_landed()

        def announce(name: str) -> Optional[List[str]]:
            return _rank_local.announce(store, save, shard.rank, shard.world, name)

        info = self._remote.write_shard(shard, ShardUpload.RankLocalShard(save=save), values, announce)
        if info.complete:
            _rank_local.forget(store, save, shard.world)
        return Put(info.shard, info.bytes_uploaded, info.bytes_skipped)

    def layout_entries(self, sizes: List[Dict[str, int]]) -> Dict[str, bytes]:
        return {}

    def open(self, step: Optional[int], commit: Optional[str]) -> Opened:
        return OpenedBucket(self._remote, step, commit, self.url)

    def consolidate(self, step: int, path: "os.PathLike[str] | str", prefix: Optional[str]) -> List[str]:
        return self._remote.consolidate(step, path, prefix)

    def export_hf(
        self, step: int, directory: "os.PathLike[str] | str", max_shard_size: "int | str", prefix: Optional[str], dtype: Any
    ) -> HfExport:
        return self._remote.export_hf(step, directory, max_shard_size, prefix, dtype)


class OpenedBucket:
    """A global step of a bucket: the shards a load takes boxes from, each
    read when first used, in ranged reads of neighbouring bytes."""

    def __init__(self, remote: Remote, step: Optional[int], commit: Optional[str], url: str) -> None:
        self._remote = remote
        opened = remote.open_global(step, commit)  # None: the newest, in one listing
        if opened is None:
            if step is None:
                raise FileNotFoundError(f"{url} holds no complete step")
            if commit is None:
                raise FileNotFoundError(f"{url} has no complete step {step}")
            raise FileNotFoundError(
                f"{url} no longer holds the save of step {step} this load chose (commit {commit}): "
                "the step was saved again or removed meanwhile; load again"
            )
        self._opened = opened
        self.commit: Optional[str] = opened.commit
        self._by_rank: Dict[int, Dict[str, EntryInfo]] = {}
        self.step: int = opened.step
        self._step, self._url = opened.step, url
        self._document: Optional[bytes] = None  # DCP's metadata, once read

    def _entries(self, rank: int) -> Dict[str, EntryInfo]:
        """Rank `rank`'s entries, its shard read once."""
        found = self._by_rank.get(rank)
        if found is None:
            found = self._by_rank[rank] = self._remote.entries(self._opened, rank)
        return found

    def _global_document(self) -> Optional[bytes]:
        """DCP's metadata of a save with collectives (rank 0's shard, read
        once: what every load of such a step reads first); None for a
        rank-local save (told by rank 0's shard) or no DCP save."""
        if self._document is None:
            self._document = self._remote.dcp_metadata(self._opened)
        return self._document

    def saved_metadata(self, rank: int) -> SavedMetadata:
        # A step saved with collectives costs its load nothing more here.
        world = self._opened.world_size
        document = self._global_document()
        if document is not None:
            return SavedMetadata(SaveKind.COLLECTIVE, world, document)
        return SavedMetadata(SaveKind.RANK_LOCAL, world, self.rank_document(rank % world))

    def rank_document(self, rank: int) -> bytes:
        found = self._entries(rank).get(RANK_METADATA)
        if found is None:
            raise ValueError(f"step {self._step} of {self._url} was not saved by ckptstore.dcp (rank {rank}'s shard has no metadata)")
        read = self._remote.read_pieces(self._opened, [(rank, RANK_METADATA, 0, found.len)])
        return read[0].tobytes()

    def length(self, rank: int, entry: str) -> int:
        return self._entries(rank)[entry].len

    def read(
        self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], deliver: Deliver, failure: Optional[BaseException]
    ) -> None:
        if failure is not None:
            raise failure
        # Pieces with memory of their own in one call (no copy is held, so
        # the bucket gets as many ranges in flight as it takes).

        def fill(batch: List[int], arrays: List[np.ndarray]) -> List[int]:
            self._remote.read_pieces_into(self._opened, [pieces[i] for i in batch], arrays)
            return batch

        read_in_batches(pieces, dest, deliver, fill)

    proves = True

    def slices(self, pieces: Sequence[Piece]) -> List[List[Slice]]:
        return self._remote.slices(self._opened, pieces)

    def read_proving(self, pieces: Sequence[Piece], dest: Dict[int, np.ndarray], proved: Sequence[Piece]) -> List[bytes]:
        return self._remote.read_pieces_proving(self._opened, pieces, [dest[i] for i in range(len(pieces))], proved)
