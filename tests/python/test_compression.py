"""Bucket format 4 from Python (issue 67): `StorageWriter(url, step,
compress=True)` and `Remote(url, compress=True)` store chunks
compressed where that saves bytes; loads read them bit-identical,
whether their reader compresses or not."""

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.dcp import StorageReader, StorageWriter


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(1024, 1100, generator=g) * 0.02).to(torch.bfloat16),
        "m": torch.randn(300_000, generator=g) * 1e-3,
        "noise": torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "extra": {"epoch": 3},
    }


def _formats(bucket):
    """The formats of step 1's shard manifests."""
    folder = os.path.join(bucket, "shards", f"{1:020}")
    formats = []
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            formats.append(json.load(f)["format"])
    return formats


def _packs(bucket):
    folder = os.path.join(bucket, "packs")
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))


@pytest.mark.parametrize("compress", [True, False])
def test_a_dcp_save_stores_compressed_when_asked_and_loads_bit_identical(tmp_path, compress):
    bucket = tmp_path / "bucket"
    state = _state(1)
    dcp.save(state, storage_writer=StorageWriter(f"file://{bucket}", 1, compress=compress), no_dist=True)
    assert _formats(bucket) == [4 if compress else 3]
    raw = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    if compress:
        # bf16 weights and small f32 values shrink; the random bytes do not.
        assert _packs(bucket) < raw * 0.85, (_packs(bucket), raw)
    else:
        assert _packs(bucket) >= raw
    loaded = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else {"epoch": 0}) for k, v in state.items()}
    dcp.load(loaded, storage_reader=StorageReader(f"file://{bucket}", 1), no_dist=True)
    for name, t in state.items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(loaded[name].view(-1).view(torch.uint8) if t.numel() else loaded[name], t.view(-1).view(torch.uint8) if t.numel() else t), name
    assert loaded["extra"] == {"epoch": 3}
    # Ranged reads of a shard, through the Remote API, by a remote that
    # compresses or not.
    for reader in (ckptstore.Remote(f"file://{bucket}"), ckptstore.Remote(f"file://{bucket}", compress=True)):
        assert reader.verify().ok


def test_a_remote_pushes_compressed_and_a_local_store_refuses_it(tmp_path):
    w = (np.random.default_rng(2).standard_normal(1 << 20) * 0.02).astype(np.float32)
    store = ckptstore.open(tmp_path / "run.ckpt")
    store.save(1, {"w": w})
    report = ckptstore.Remote(f"file://{tmp_path}/bucket", compress=True).push(store)
    assert report.bytes_uploaded < w.nbytes * 0.9, report
    assert np.array_equal(ckptstore.Remote(f"file://{tmp_path}/bucket").load(1).tensors["w"], w)
    with pytest.raises(ValueError, match="only a bucket URL"):
        StorageWriter(tmp_path / "other.ckpt", 1, compress=True)
