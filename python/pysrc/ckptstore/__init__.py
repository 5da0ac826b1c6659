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

from ._ckptstore import (
    MAX_WORLD_SIZE,
    ChunkSlice,
    CommitInfo,
    HfExport,
    Piece,
    PushReport,
    Range,
    ReplicationStatus,
    SaveRecord,
    ShardId,
    ShardInfo,
    ShardStatus,
    ShardUpload,
    ShardValues,
    StepInfo,
    StoreStats,
    StoreStep,
    Tensor,
    VerifyReport,
    __version__,
)
from ._convert import DTYPE_NAMES, Checkpoint, Value, step_number
from ._cost import SaveCost
from ._errors import CorruptError, Error, LockedError, StepExistsError
from ._remote import Remote, Shard
from ._store import Handle, Store, open, remove_store

__all__ = [
    "__version__",
    "open",
    "remove_store",
    "Store",
    "Remote",
    "Shard",
    "ShardId",
    "Piece",
    "Range",
    "ChunkSlice",
    "ShardInfo",
    "ShardStatus",
    "ShardUpload",
    "ShardValues",
    "StoreStep",
    "Checkpoint",
    "CommitInfo",
    "SaveCost",
    "SaveRecord",
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
