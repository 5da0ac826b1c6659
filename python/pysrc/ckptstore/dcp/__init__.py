"""The storage layer under `torch.distributed.checkpoint` (DCP).

    import torch.distributed.checkpoint as dcp
    from ckptstore.dcp import StorageWriter, StorageReader

    dcp.save(state, storage_writer=StorageWriter("s3://bucket/run", step=100))
    dcp.load(state, storage_reader=StorageReader("s3://bucket/run"))  # latest

DCP decides *what* is saved (global shapes, shard offsets, resharding on
load); ckptstore decides *where the bytes go*. A target is a bucket URL
(`s3://`, `file://`) for any number of ranks, or a local store (a path or
an open `ckptstore.Store`) for one process.

In a bucket, each rank's write items become its shard of global step
`step` (chunks deduplicated against everything in the bucket, every chunk
hash-checked on load). The coordinator's `finish` uploads its own shard
with DCP's metadata and then writes the step's commit naming exactly the
shards of this save: the step is listed (`Remote.steps()`, `ckpt ls`)
only after every rank's data and the metadata have landed. A rank that
dies at any point leaves the step invisible; saving again completes it,
and shards of the dead attempt are named by no commit.

Loading at any world size: each read item names a box of a stored shard;
the reader fetches only the chunks that cover the bytes of that box (for
a box of a row-major tensor, the span from its first to its last element)
and checks each chunk's hash; a damaged chunk fails the load with
`ckptstore.CorruptError` (carried inside DCP's `CheckpointException`).

Formats: DCP's metadata is stored as JSON (`.dcp/metadata.json` in the
coordinator's shard: names, global shapes, dtypes, chunk boxes, where each
box is) and rebuilt from it on load: no pickle. Non-tensor values are
DCP's own bytes (`torch.save` by its planner), which DCP's planner loads
with `torch.load(weights_only=False)`: trust a bucket as you would trust
DCP's files.

Memory: the coordinator keeps its own write items (CPU tensors by
reference; device tensors copied to the host) from `write_data` to
`finish`. Its data is uploaded in `write_data`, beside the other ranks';
`finish` uploads its shard manifest with the metadata (the chunks are
there: they are hashed again, not uploaded again).

Async saves (`dcp.async_save(state, storage_writer=StorageWriter(...))`)
stage through the writer: host tensors are copied on every core and
hashed in the same pass; a GPU's tensors go into an arena of host memory
pinned once and kept for the next save of the same layout, copied on a
side stream after the work queued before the call and hashed piece by
piece as the copies land (`StagingBudgetError` where the arena would
take more host memory than allowed or available). The GPU lines are
few (`_arena._Cuda`: `cudaHostRegister` through `torch.cuda.cudart()`,
a `torch.cuda.Stream`, events) and are checked by scripts/gpu-check.sh
on a machine with a GPU (written for torch 2.11 and later; not yet run
on one); everything else of staging is tested on the CPU (torch 2.15).
"""

from .._cost import SaveCost
from .._arena import StagingBudgetError
from ._export import consolidate, export_hf
from ._reader import StorageReader
from ._writer import StorageWriter
from ._targets import METADATA
from .tiers._tiers import Tiers

__all__ = [
    "StorageWriter", "StorageReader", "Tiers", "SaveCost", "METADATA", "StagingBudgetError", "consolidate", "export_hf",
]
