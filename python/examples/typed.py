"""The whole public API of `ckptstore`, typed: CI runs `mypy --strict` on
this file and then runs it. Usage: python typed.py [DIR] (a temporary
directory by default)."""

import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

import ckptstore
import ckptstore.torch as ct
from ckptstore import (
    Checkpoint,
    CommitInfo,
    PushReport,
    Remote,
    ReplicationStatus,
    Shard,
    ShardInfo,
    ShardStatus,
    StepInfo,
    Store,
    StoreStats,
    Tensor,
    Value,
    VerifyReport,
)


def local(dir: Path) -> Store:
    state: Dict[str, Value] = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "rng": b"\x01\x02",
        "h": Tensor("BF16", [2], np.zeros(4, dtype=np.uint8)),
    }
    store = ckptstore.open(dir / "run.ckpt", cache_size=16 << 20)
    info: CommitInfo = store.save(1, state, metrics={"loss": 0.5})
    assert info.step == 1 and info["step"] == 1 and info.seconds >= 0
    handle = store.save_async(2, state)
    assert handle.result().step == 2 and handle.done()
    store.flush()
    ck: Optional[Checkpoint] = store.load()
    assert ck is not None and ck.step == 2
    w: np.ndarray = store[1].tensors["w"]
    assert w.shape == (3, 4)
    steps: List[int] = store.steps()
    assert steps == [1, 2] and store.latest_step() == 2 and 1 in store and len(store) == 2
    report: VerifyReport = store.verify()
    assert report.ok and report.damaged == []
    stats: StoreStats = store.stats()
    assert stats.steps == 2 and stats.dedup_ratio >= 1.0
    record = ckptstore.SaveRecord(staging_seconds=0.5, blocked_seconds=0.1, names=["mine:w"])
    again: CommitInfo = store.save(2, {"w": state["w"]}, metrics={"loss": 0.25}, replace=True, record=record)
    assert again.step == 2
    meta: Optional[StepInfo] = store.info(2)
    assert meta is not None and meta.metrics == {"loss": 0.25} and meta.blobs == {}
    assert meta.save_record == record and meta.save_record.names == ["mine:w"]
    w_info = meta.tensors["w"]
    assert (w_info.dtype, w_info.shape, w_info.len) == ("F32", [3, 4], 48) and store.info(9) is None
    assert store.gc(keep_last=5) == [] and not store.remove(7)
    status: Optional[ReplicationStatus] = store.replication_status()
    assert status is None
    assert len(store.store_id) == 36
    return store


def remote(dir: Path, store: Store) -> None:
    bucket = Remote(f"file://{dir}/bucket", grace_period=60.0)
    pushed: PushReport = store.push(bucket)
    assert pushed.steps_pushed == [1, 2] and bucket.url.startswith("file://")
    assert bucket.owner() == store.store_id
    bucket.adopt(store)
    assert bucket.steps() == [1, 2] and bucket.latest_step() == 2
    loaded = bucket.load(1)
    assert loaded is not None and loaded.metrics == {"loss": 0.5}
    with ckptstore.open(dir / "copy.ckpt") as copy:
        assert bucket.pull(2, copy).step == 2
    assert bucket.verify().ok and bucket.gc(keep_last=10) == []

    ranks = Remote(f"file://{dir}/ranks")
    for rank in range(2):
        shard: Shard = ranks.shard(rank, 2)
        done: ShardInfo = shard.save(5, {"x": np.full(3, rank, dtype=np.int64)})
        assert done.complete == (rank == 1)
    status: ShardStatus = ranks.shards(5)
    assert status.complete and status.landed == [0, 1]
    mine = ranks.shard(1, 2).load()
    assert mine is not None and int(mine.tensors["x"][0]) == 1

    # A step a coordinator completes, read piece by piece.
    coord = Remote(f"file://{dir}/coordinated")
    data = {"x": np.arange(8, dtype=np.int64)}
    early: ShardInfo = coord.upload_shard(7, 0, 1, data, data_only=True)
    named: ShardInfo = coord.upload_shard(7, 0, 1, data)
    assert early.shard == named.shard and coord.steps() == []
    coord.commit_global(7, [named.shard])
    opened = coord.open_global(7)
    assert opened is not None and opened.world_size == 1
    x = coord.entries(opened, 0)["x"]
    assert (x.dtype, x.shape, x.len) == ("I64", [8], 64)
    (piece,) = coord.read_pieces(opened, [(0, "x", 8, 16)])
    assert piece.view(np.int64).tolist() == [1, 2]


def pytorch(dir: Path) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    with ckptstore.open(dir / "torch.ckpt") as store:
        ct.save(store, 10, model=model, optimizer=opt, metrics={"loss": 1.0}, extra={"epoch": 3})
        handle = ct.save(store, 11, model=model, blocking=False)
        assert handle.result().step == 11
        assert ct.load(store, model=model, optimizer=opt, step=10) == 10
        assert ct.load_extra(store, step=10) == {"epoch": 3}


def tiers(dir: Path) -> None:
    # One process: a single node, no copies (with a warning).
    import warnings

    from ckptstore.dcp import SaveCost, Tiers

    state = {"w": torch.arange(6, dtype=torch.float32), "epoch": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tier = Tiers(str(dir / "tier-{node}"), f"file://{dir}/tier-bucket", keep_local=1)
    cost: SaveCost = tier.save(state, 1)
    assert cost.step == 1 and cost.bytes_new > 0
    response = tier.async_save(state, 2)
    response.upload_completion.result()
    tier.wait()
    into = {"w": torch.zeros(6), "epoch": 0}
    assert tier.load(into) == 2 and into["epoch"] == 3
    tier.close()
    assert cost.as_metrics()["checkpoint/durable_s"] == cost.durable_seconds
    assert ckptstore.SaveCost is SaveCost


def staging(dir: Path) -> None:
    # DCP's async_save staging through ckptstore's writer, in the background.
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

    from ckptstore._ckptstore import ChunkHashes, copy_hashed
    from ckptstore.dcp import StorageReader, StorageWriter

    src, dst = np.arange(1 << 17, dtype=np.uint8), np.zeros(1 << 17, dtype=np.uint8)
    (hashes,) = copy_hashed([src], [dst])
    assert isinstance(hashes, ChunkHashes) and hashes.nbytes == src.nbytes and (dst == src).all()
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    writer = StorageWriter(f"file://{dir}/staging-bucket", 1, background_staging=True)
    response = async_save(state, storage_writer=writer, no_dist=True)
    assert isinstance(response, AsyncSaveResponse)  # the staging is a future of its own
    response.staging_completion.result()
    state["w"].add_(1)  # staged: the save keeps the values of the call
    response.upload_completion.result()
    back = {"w": torch.zeros(1 << 16)}
    dcp_load(back, storage_reader=StorageReader(f"file://{dir}/staging-bucket", 1), no_dist=True)
    assert torch.equal(back["w"], torch.arange(1 << 16, dtype=torch.float32))


def main(dir: Path) -> None:
    store = local(dir)
    remote(dir, store)
    store.close()
    pytorch(dir)
    tiers(dir)
    staging(dir)
    try:
        ckptstore.open(dir / "run.ckpt", read_only=True).save(3, {})
    except ckptstore.Error as e:
        print("refused as expected:", type(e).__name__)
    print("typed example: ok")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as d:
            main(Path(d))
