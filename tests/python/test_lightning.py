"""ckptstore.lightning.CheckpointIO under a real Lightning Trainer: a run
SIGKILLed at a random step resumes from "last" bit-identical to an
uninterrupted run; two paths at one global step are one step; top-k
rotation removes steps; nothing unsafe is stored or loaded."""

import json
import os
import uuid
import pathlib

import pytest
import torch

import ckptstore
import ckptstore.lightning as cl
from integrations import common

RUN = pathlib.Path(__file__).parent / "integrations" / "lightning_run.py"
MARKER_MAX = 1024  # a marker is a few hundred bytes


def run(*args, expect_kill=False):
    return common.run(RUN, *args, done="done 60", expect_kill=expect_kill)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("whole")
    run(d / "run.ckpt", d / "checkpoints", d / "params.pt")
    return d


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killed_run_resumes_from_last_bit_identical(tmp_path, uninterrupted, mode):
    # Async: the kill may land while a save commits in the background.
    kill_at, seed = common.kill_point(11, 59)  # after the first checkpoint (step 10)
    store, dirpath = tmp_path / "run.ckpt", tmp_path / "checkpoints"
    extra = ["--async"] if mode == "async" else []
    run(store, dirpath, tmp_path / "params.pt", "--kill-at", kill_at, *extra, expect_kill=True)
    run(store, dirpath, tmp_path / "params.pt", "--resume", *extra)

    common.assert_same_params(uninterrupted / "params.pt", tmp_path / "params.pt",
                              f"kill at step {kill_at}, seed {seed}")

    with ckptstore.open(store, read_only=True) as s:
        steps = s.steps()
        names = {n for step in steps for n in s.info(step).save_record.names}
        assert not any(n.startswith("lightning:") for step in steps for n in s.info(step).metrics)
    assert 1 <= len(steps) <= 3, steps
    # Every file left in the directory is a marker, and the markers are
    # exactly the names the store holds.
    files = sorted(dirpath.iterdir())
    assert files and all(f.stat().st_size <= MARKER_MAX for f in files), files
    # (Names are relative to the store's directory: the run moves whole.)
    assert {"lightning:" + str(f.relative_to(tmp_path)) for f in files} == names
    assert any(f.name == "last.ckpt" for f in files)
    last = json.loads((dirpath / "last.ckpt").read_text())
    assert last["step"] == 60 and last["name"] == "checkpoints/last.ckpt"
    assert last["ckptstore.lightning"] == "../run.ckpt"


def _checkpoint(step, tag, w):
    return {
        "global_step": step,
        "epoch": 0,
        "state_dict": {"w": w, "b": torch.zeros(3, dtype=torch.bfloat16)},
        "callbacks": {"ModelCheckpoint{'monitor': 'val'}": {"tag": tag, "score": torch.tensor(0.5)}},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"betas": (0.9, 0.99)}]}],
        "hyper_parameters": {"lr": 0.1, "dtype": torch.float32},
    }


def test_two_paths_at_one_step_are_one_step_and_rotate(tmp_path):
    io = cl.CheckpointIO(tmp_path / "run.ckpt")
    w = torch.randn(512, 1024)
    io.save_checkpoint(_checkpoint(7, "topk", w), tmp_path / "epoch=0-step=7.ckpt")
    io.save_checkpoint(_checkpoint(7, "last", w), tmp_path / "last.ckpt")
    store = ckptstore.open(tmp_path / "run.ckpt", read_only=True)
    assert store.steps() == [7]
    stats = store.stats()
    assert stats.logical_bytes > 2 * w.nbytes and stats.stored_bytes < 1.1 * w.nbytes, stats  # shared
    store.close()

    a = io.load_checkpoint(tmp_path / "epoch=0-step=7.ckpt")
    b = io.load_checkpoint(tmp_path / "last.ckpt")
    assert a["callbacks"]["ModelCheckpoint{'monitor': 'val'}"]["tag"] == "topk"
    assert b["callbacks"]["ModelCheckpoint{'monitor': 'val'}"]["tag"] == "last"
    assert torch.equal(a["state_dict"]["w"], w) and a["state_dict"]["b"].dtype == torch.bfloat16
    assert b["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert b["hyper_parameters"]["dtype"] is torch.float32

    # last.ckpt moves to the next step; the top-k name keeps step 7.
    io.save_checkpoint(_checkpoint(9, "last", w * 2), tmp_path / "last.ckpt")
    assert io.names() == {str(tmp_path / "epoch=0-step=7.ckpt"): 7, str(tmp_path / "last.ckpt"): 9}
    # Top-k rotation: the marker and the step go.
    io.remove_checkpoint(tmp_path / "epoch=0-step=7.ckpt")
    assert not (tmp_path / "epoch=0-step=7.ckpt").exists()
    assert io.names() == {str(tmp_path / "last.ckpt"): 9}
    io.teardown()
    with ckptstore.open(tmp_path / "run.ckpt", read_only=True) as s:
        assert s.steps() == [9]


def test_refuses_an_object_naming_its_key(tmp_path):
    io = cl.CheckpointIO(tmp_path / "run.ckpt")
    ck = _checkpoint(1, "x", torch.ones(2))
    ck["hyper_parameters"]["optimizer_cls"] = torch.optim.AdamW
    with pytest.raises(TypeError, match="hyper_parameters/optimizer_cls"):
        io.save_checkpoint(ck, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists() and not (tmp_path / "run.ckpt").exists()


def test_the_store_is_the_truth_when_a_save_dies_before_its_marker(tmp_path, monkeypatch):
    io = cl.CheckpointIO(tmp_path / "run.ckpt")
    io.save_checkpoint(_checkpoint(5, "old", torch.ones(4)), tmp_path / "last.ckpt")

    def die(*_):
        raise KeyboardInterrupt("killed before the marker")

    with monkeypatch.context() as m:
        m.setattr(cl, "write_marker", die)
        with pytest.raises(KeyboardInterrupt):
            io.save_checkpoint(_checkpoint(8, "new", torch.ones(4) * 2), tmp_path / "last.ckpt")
        with pytest.raises(KeyboardInterrupt):
            io.save_checkpoint(_checkpoint(8, "topk", torch.ones(4) * 2), tmp_path / "epoch=1.ckpt")
    io.teardown()
    # The old marker loads the newer state the store committed.
    again = cl.CheckpointIO(tmp_path / "run.ckpt")
    ck = again.load_checkpoint(tmp_path / "last.ckpt")
    assert ck["global_step"] == 8 and ck["callbacks"]["ModelCheckpoint{'monitor': 'val'}"]["tag"] == "new"
    # The top-k name without a marker is swept by the next save there.
    assert str(tmp_path / "epoch=1.ckpt") in again.names()
    again.save_checkpoint(_checkpoint(12, "next", torch.ones(4) * 3), tmp_path / "last.ckpt")
    assert again.names() == {str(tmp_path / "last.ckpt"): 12}
    again.teardown()
    with ckptstore.open(tmp_path / "run.ckpt", read_only=True) as s:
        assert s.steps() == [12]


def test_a_marker_file_half_written_by_a_killed_process_is_swept(tmp_path):
    """A process killed between writing a marker's temporary file and
    renaming it leaves `.<marker>.tmp<pid>-<uuid>` (the crate's durable
    write; 0.4 wrote `<marker>.<pid>.tmp`): the next save there removes it
    (a dead process's, empty or a marker), and nothing else."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    d = tmp_path / "checkpoints"
    first = cl.CheckpointIO(tmp_path / "run.ckpt")
    first.save_checkpoint(_checkpoint(5, "old", torch.ones(4)), d / "last.ckpt")
    first.teardown()
    (d / f"last.ckpt.{pid}.tmp").write_bytes((d / "last.ckpt").read_bytes())
    (d / f"epoch=0.ckpt.{pid}.tmp").write_bytes(b"")
    (d / f"notes.{pid}.tmp").write_text("not a marker")
    (d / f"mine.ckpt.{os.getpid()}.tmp").write_bytes(b"")  # a live process's
    crate = f"tmp{pid}-{uuid.uuid4()}"
    (d / f".last.ckpt.{crate}").write_bytes((d / "last.ckpt").read_bytes())
    (d / f".epoch=1.ckpt.{crate}").write_bytes(b"")
    (d / f".notes.{crate}").write_text("not a marker")
    live = f".mine.ckpt.tmp{os.getpid()}-{uuid.uuid4()}"
    (d / live).write_bytes(b"")
    again = cl.CheckpointIO(tmp_path / "run.ckpt")
    again.save_checkpoint(_checkpoint(8, "new", torch.ones(4)), d / "last.ckpt")
    again.teardown()
    kept = ["last.ckpt", f"notes.{pid}.tmp", f"mine.ckpt.{os.getpid()}.tmp", f".notes.{crate}", live]
    assert sorted(f.name for f in d.iterdir()) == sorted(kept)


def test_loads_a_regular_checkpoint_file_and_reports_missing_names(tmp_path):
    torch.save({"global_step": 3, "state_dict": {"w": torch.ones(2)}}, tmp_path / "old.ckpt")
    io = cl.CheckpointIO(tmp_path / "run.ckpt")
    assert io.load_checkpoint(tmp_path / "old.ckpt")["global_step"] == 3
    io.save_checkpoint(_checkpoint(1, "x", torch.ones(2)), tmp_path / "a.ckpt")
    with pytest.raises(FileNotFoundError, match="b.ckpt"):
        io.load_checkpoint(tmp_path / "b.ckpt")
    io.teardown()


def test_async_saves_the_state_as_staged_and_returns_before_the_commit(tmp_path, monkeypatch):
    io = cl.CheckpointIO(tmp_path / "run.ckpt", asynchronous=True)
    gate = common.held(monkeypatch, cl.CheckpointIO, "_commit")
    w = torch.randn(256, 1024)
    want = w.clone()
    io.save_checkpoint(_checkpoint(3, "last", w), tmp_path / "last.ckpt")
    # Returned with nothing committed; the trainer changes the weights.
    assert not (tmp_path / "last.ckpt").exists()
    w.add_(1)
    gate.set()
    ck = io.load_checkpoint(tmp_path / "last.ckpt")  # waits for the save
    assert torch.equal(ck["state_dict"]["w"], want)
    cost = io.last_cost
    assert cost is not None and cost.step == 3
    assert 0 < cost.staging_seconds <= cost.blocked_seconds + 1e-3 < cost.durable_seconds
    assert cost.bytes_new >= w.nbytes and cost.bytes_deduplicated == 0
    # The next save of the same layout stages into the same memory, and
    # the top-k rotation queued behind it leaves only the new name.
    io.save_checkpoint(_checkpoint(4, "topk", w), tmp_path / "epoch=0.ckpt")
    io.save_checkpoint(_checkpoint(5, "last", w), tmp_path / "last.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=0.ckpt")
    assert io.names() == {str(tmp_path / "last.ckpt"): 5}
    assert io.last_cost.bytes_deduplicated >= w.nbytes  # w as at step 4
    io.teardown()
    with ckptstore.open(tmp_path / "run.ckpt", read_only=True) as s:
        assert s.steps() == [5]
        record = s.info(5).save_record
        assert record.staging_seconds > 0 and record.blocked_seconds > 0
        assert len(record.names) == 1 and record.names[0].startswith("lightning:"), record
        assert record.names[0].endswith("last.ckpt"), record
        assert not s.info(5).metrics  # the record is not a metric
    import os
    import subprocess

    ckpt = os.environ.get("CKPT_BIN", "ckpt")
    shown = subprocess.run([ckpt, "show", str(tmp_path / "run.ckpt"), "5"], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert "save:      blocked " in shown.stdout and "shared with earlier steps" in shown.stdout, shown.stdout


def test_a_failed_async_save_is_raised_by_the_next_save_and_by_teardown(tmp_path, monkeypatch):
    io = cl.CheckpointIO(tmp_path / "run.ckpt", asynchronous=True)
    io.save_checkpoint(_checkpoint(1, "last", torch.ones(4)), tmp_path / "last.ckpt")
    assert io.names() == {str(tmp_path / "last.ckpt"): 1}  # waits for it

    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cl, "write_marker", full)
    io.save_checkpoint(_checkpoint(2, "last", torch.ones(4)), tmp_path / "last.ckpt")  # fails behind
    with pytest.raises(OSError, match="No space"):
        io.save_checkpoint(_checkpoint(3, "last", torch.ones(4)), tmp_path / "last.ckpt")
    io.save_checkpoint(_checkpoint(4, "last", torch.ones(4)), tmp_path / "last.ckpt")  # raised once
    with pytest.raises(OSError, match="No space"):
        io.teardown()


def test_save_costs_are_logged_with_the_trainers_logger(tmp_path):
    import csv

    store, dirpath = tmp_path / "run.ckpt", tmp_path / "checkpoints"
    run(store, dirpath, tmp_path / "params.pt", "--async", "--costs", tmp_path / "logs")
    (metrics,) = (tmp_path / "logs").rglob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("checkpoint/durable_s")]
    # Checkpoints each epoch: the last epoch's may be in flight at the end.
    assert len(rows) >= 5, rows
    for r in rows:
        assert float(r["checkpoint/durable_s"]) >= float(r["checkpoint/blocked_s"]) > 0
        assert float(r["checkpoint/new_mib"]) > 0
    # Two saves each epoch end (top-k and last): one or both logged.
    steps = {int(r["step"]) for r in rows}
    assert {10, 20, 30, 40, 50} <= steps <= {10, 20, 30, 40, 50, 60}, steps
