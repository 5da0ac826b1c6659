"""Bucket format 4 from Python (issue 67): `StorageWriter(url, step,
compress=True)` and `Remote(url, compress=True)` store chunks
compressed where that saves bytes (the default for `s3://`); loads read
them bit-identical, whether their reader compresses or not."""

import json
import os
import subprocess
import uuid

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


def _formats(bucket, step=1):
    """The formats of step `step`'s shard manifests."""
    folder = os.path.join(bucket, "shards", f"{step:020}")
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


def test_a_bucket_compresses_by_default_over_s3_and_not_in_a_directory(tmp_path):
    # The default follows the scheme (nothing is requested to open one).
    assert ckptstore.Remote("s3://some-bucket/run").compression
    assert not ckptstore.Remote("s3://some-bucket/run", compress=False).compression
    assert not ckptstore.Remote(f"file://{tmp_path}/bucket").compression
    state = _state(1)
    dcp.save(state, storage_writer=StorageWriter(f"file://{tmp_path}/bucket", 1), no_dist=True)
    assert _formats(tmp_path / "bucket") == [3]
    bucket = os.environ.get("CKPT_TEST_BUCKET")
    if not bucket:
        pytest.skip("the s3:// half: no S3 server (CKPT_TEST_BUCKET)")
    ckpt = os.environ.get("CKPT_BIN", "ckpt")
    for compress, compressed in ((None, True), (False, False)):
        url = f"s3://{bucket}/py-{uuid.uuid4().hex}"
        dcp.save(state, storage_writer=StorageWriter(url, 1, compress=compress), no_dist=True)
        said = subprocess.run([ckpt, "stats", url, "--json"], check=True, capture_output=True).stdout
        totals = json.loads(said)
        assert (totals["stored_bytes"] < totals["chunk_bytes"] * 0.85) == compressed, totals
        loaded = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else {"epoch": 0}) for k, v in state.items()}
        dcp.load(loaded, storage_reader=StorageReader(url, 1), no_dist=True)
        assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["m"], state["m"])


@pytest.mark.parametrize("first", [False, True])
def test_toggling_compression_in_one_process_keeps_dedup(tmp_path, first):
    """Issue 73, item 6: the same state saved with one setting, then the
    other, in one process. Raw chunks are reused either way; a save that
    does not compress uploads raw only the chunks it finds compressed (the
    random bytes, stored raw, are reused), so its step stays format 3."""
    url = f"file://{tmp_path / 'bucket'}"
    state = _state(1)
    dcp.save(state, storage_writer=StorageWriter(url, 1, compress=first), no_dist=True)
    before = _packs(tmp_path / "bucket")
    dcp.save(state, storage_writer=StorageWriter(url, 2, compress=not first), no_dist=True)
    grew = _packs(tmp_path / "bucket") - before
    noise = state["noise"].numel()
    raw = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    if first:
        # Compressed, then not: the compressed chunks again, raw.
        assert _formats(tmp_path / "bucket", 2) == [3]
        assert raw - noise - (64 << 10) < grew < raw - noise + (64 << 10), (grew, raw, noise)
    else:
        # Raw, then compressed: nothing but the small blobs.
        assert grew < 64 << 10, grew
    assert ckptstore.Remote(url).verify().ok
