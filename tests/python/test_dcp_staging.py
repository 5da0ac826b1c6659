"""ckptstore.dcp.StorageWriter as DCP's AsyncStager: `dcp.async_save`
stages through it into host memory that the next async save to the same
target reuses once the save before is done; the state may change as soon
as the call returns. One process (DCP's no_dist), a directory bucket."""

import threading

import pytest

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from ckptstore.dcp import _writer as _dcp_write
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
    staged = [v for k, (v, _) in _dcp_write._POOL._free.items() if k[1] == url]
    assert len(staged) == 1
    first = staged[0]["w"].data_ptr()
    live["w"].add_(5)
    dcp.async_save(live, storage_writer=StorageWriter(url, 2), no_dist=True).result()
    (again,) = [v for k, (v, _) in _dcp_write._POOL._free.items() if k[1] == url]
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


def test_background_staging_returns_before_the_copy_and_says_when_it_is_done(tmp_path, monkeypatch):
    from ckptstore import _staging

    url = f"file://{tmp_path}/bucket"
    gate = threading.Event()
    real = _staging.copy_hashed

    def held(sources, destinations):
        assert gate.wait(30)
        return real(sources, destinations)

    monkeypatch.setattr(_staging, "copy_hashed", held)
    live = state(1)
    response = dcp.async_save(live, storage_writer=StorageWriter(url, 1, background_staging=True), no_dist=True)
    # Returned with the copy not made: the state must stay until it is.
    assert not response.staging_completion.done()
    gate.set()
    response.staging_completion.result(timeout=30)
    live["w"].add_(1000)
    live["b"].mul_(-2)
    live["extra"]["epoch"] = 99
    response.upload_completion.result(timeout=60)
    assert same(loaded(url, 1), state(1))


def test_the_save_writes_the_hashes_its_staging_took(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/bucket"
    used = []
    real = _dcp_write.hashes_of

    def spy(known, t):
        found = real(known, t)
        used.append(found is not None)
        return found

    monkeypatch.setattr(_dcp_write, "hashes_of", spy)
    dcp.async_save(state(1), storage_writer=StorageWriter(url, 1), no_dist=True).result()
    assert used == [True, True], used  # "w" and "b"; a load checks every hash
    assert same(loaded(url, 1), state(1))
    used.clear()
    dcp.save(state(2), storage_writer=StorageWriter(url, 2), no_dist=True)
    assert used == [False, False], "a save not staged hashes its bytes itself"
    assert same(loaded(url, 2), state(2))


def test_staged_hashes_go_with_the_state_to_dcps_process(tmp_path):
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from ckptstore._staging import hashes_of

    writer = StorageWriter(f"file://{tmp_path}/b", 1, shared_memory=True)
    staged = writer.stage(state(1))
    assert staged["w"].is_shared()
    buf = io.BytesIO()
    ForkingPickler(buf).dump((staged, writer))  # as DCP sends them, in one message
    there, sent = pickle.loads(buf.getvalue())
    assert hashes_of(sent._hashes, there["w"]) is not None
    assert hashes_of(sent._hashes, there["b"]) is not None
    assert hashes_of(sent._hashes, there["w"][1:]) is None, "a part of a staged tensor has no hashes"


def test_process_mode_stages_into_shared_memory_reused_and_saves_the_state_at_the_call(tmp_path):
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "dcp", "process_mode.py")
    done = subprocess.run(
        [sys.executable, script, f"file://{tmp_path}/bucket"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "OK" in done.stdout and "REUSED" in done.stdout, done.stdout


def test_a_failed_background_save_reaches_the_caller(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    url = f"file://{tmp_path}/bucket"
    dcp.save(state(1), storage_writer=StorageWriter(url, 1), no_dist=True)
    writer = StorageWriter(url, 1, overwrite=False, background_staging=True)
    response = dcp.async_save(state(2), storage_writer=writer, no_dist=True)
    response.staging_completion.result(timeout=30)
    try:
        response.upload_completion.result(timeout=60)
    except CheckpointException as e:
        assert "already" in str(e), e
    else:
        raise AssertionError("a save of a committed step without overwrite must fail")
    assert same(loaded(url, 1), state(1))


def test_each_save_reports_its_cost_and_the_step_keeps_its_staging(tmp_path):
    import json
    import os
    import subprocess

    url = f"file://{tmp_path}/bucket"
    writer = StorageWriter(url, 1, background_staging=True)
    response = dcp.async_save(state(1), storage_writer=writer, no_dist=True)
    response.upload_completion.result(timeout=60)
    cost = writer.cost
    assert cost is not None and cost.step == 1
    # Blocked: the call alone (the copy's structure made on the caller's
    # thread), not the copy.
    assert 0 <= cost.blocked_seconds < cost.staging_seconds < cost.durable_seconds
    assert cost.bytes_new >= 1_200_000 and cost.bytes_deduplicated == 0
    # The same state again: nothing new to write.
    again = StorageWriter(url, 2)
    dcp.save(state(1), storage_writer=again, no_dist=True)
    assert again.cost.bytes_deduplicated >= 1_200_000 and again.cost.staging_seconds == 0
    assert again.cost.blocked_seconds == again.cost.durable_seconds > 0

    ckpt = os.environ.get("CKPT_BIN", "ckpt")
    listed = subprocess.run([ckpt, "ls", url, "--json"], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    rows = {r["step"]: r for r in json.loads(listed.stdout)}
    assert rows[1]["save_record"]["staging"]["staging_seconds"] == pytest.approx(cost.staging_seconds)
    assert not rows[1]["metrics"]  # the record is not a metric
    assert "save_record" not in rows[2]  # not staged
