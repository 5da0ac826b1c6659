"""ckptstore.dcp.StorageWriter as DCP's AsyncStager: `dcp.async_save`
stages through it into host memory that the next async save to the same
target reuses once the save before is done; the state may change as soon
as the call returns. One process (DCP's no_dist), a directory bucket."""

import threading

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from ckptstore import _dcp_write
from ckptstore.dcp import StorageReader, StorageWriter


def state(salt):
    return {
        "w": torch.arange(300_000, dtype=torch.float32) + salt,
        "b": torch.full((7, 3), salt, dtype=torch.bfloat16),
        "extra": {"epoch": salt},
    }


def loaded(url, step):
    out = {"w": torch.zeros(300_000), "b": torch.zeros((7, 3), dtype=torch.bfloat16), "extra": {"epoch": 0}}
    dcp.load(out, storage_reader=StorageReader(url, step), no_dist=True)
    return out


def same(a, b):
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["extra"] == b["extra"]


def test_the_writer_is_dcps_async_stager(tmp_path):
    assert isinstance(StorageWriter(f"file://{tmp_path}/b", 1), AsyncStager)


def test_a_state_changed_after_async_save_returns_is_saved_as_at_the_call(tmp_path):
    url = f"file://{tmp_path}/bucket"
    live = state(1)
    fut = dcp.async_save(live, storage_writer=StorageWriter(url, 1), no_dist=True)
    live["w"].add_(1000)
    live["b"].mul_(-2)
    live["extra"]["epoch"] = 99
    fut.result()
    assert same(loaded(url, 1), state(1))


def test_the_next_async_save_reuses_the_staged_copy_once_the_save_before_is_done(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/bucket"
    live = state(1)
    dcp.async_save(live, storage_writer=StorageWriter(url, 1), no_dist=True).result()
    staged = [v for k, v in _dcp_write._POOL._free.items() if k[1] == url]
    assert len(staged) == 1
    first = staged[0]["w"].data_ptr()
    live["w"].add_(5)
    dcp.async_save(live, storage_writer=StorageWriter(url, 2), no_dist=True).result()
    (again,) = [v for k, v in _dcp_write._POOL._free.items() if k[1] == url]
    assert again["w"].data_ptr() == first
    assert torch.equal(loaded(url, 2)["w"], torch.arange(300_000, dtype=torch.float32) + 6)
    assert same(loaded(url, 1), state(1))

    # A save still in flight keeps its copy: the next stages elsewhere.
    gate = threading.Event()
    slow = _dcp_write.StorageWriter.finish

    def finish_later(self, metadata, results):
        gate.wait(30)
        return slow(self, metadata, results)

    monkeypatch.setattr(_dcp_write.StorageWriter, "finish", finish_later)
    a = dcp.async_save(state(3), storage_writer=StorageWriter(url, 3), no_dist=True)
    b = dcp.async_save(state(4), storage_writer=StorageWriter(url, 4), no_dist=True)
    gate.set()
    a.result()
    b.result()
    assert same(loaded(url, 3), state(3)) and same(loaded(url, 4), state(4))
