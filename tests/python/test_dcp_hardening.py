"""ckptstore.dcp under real-world use (issue 38), with real processes over
gloo and a 20 s process-group timeout (a hang fails fast): one load reads
one save even while the step is saved again; a rank that cannot list the
bucket, or whose metadata read fails once, fails the load on every rank
at once; saves and loads in a subgroup and with no_dist; a reused reader
follows the latest step; overwrite=False refuses a committed step."""

import os
import pathlib
import subprocess
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
import forked
from ckptstore.dcp import StorageReader, StorageWriter

from test_dcp import WORKER, _port, run

HARD = pathlib.Path(__file__).parent / "dcp" / "hard_worker.py"


def start(mode, target, world, flags):
    port = _port()
    return [forked.start(HARD, [mode, target, r, world, port, flags], os.environ) for r in range(world)]


def finish(procs, timeout=120):
    return [p.communicate(timeout=timeout)[0] for p in procs]


def _load_while_saved_again(tmp_path, world):
    """Step 1 saved at 2 ranks, loaded at 2 while it is saved again (the
    documented recovery) at `world` ranks after rank 0 opened it and
    before rank 1 does: each rank's output, and the load's seconds from
    the re-save on."""
    url = f"file://{tmp_path}/bucket"
    run("save", url, 1, 2, salt=0)
    flags = tmp_path / "flags"
    flags.mkdir()
    loading = start("load-racing", url, 2, flags)
    deadline = time.monotonic() + 60
    while not (flags / "opened").exists():
        assert time.monotonic() < deadline, finish(loading)
        time.sleep(0.05)
    run("save", url, 1, world, salt=9)
    (flags / "resaved").touch()
    began = time.monotonic()
    outs = finish(loading)
    return outs, time.monotonic() - began


def test_one_load_reads_one_save_while_the_step_is_saved_again(tmp_path):
    outs, _ = _load_while_saved_again(tmp_path, 2)
    for rank, text in enumerate(outs):
        assert "ok" in text.splitlines(), f"rank {rank}:\n{text[-3000:]}"


def test_a_load_while_the_step_is_saved_again_with_another_layout_names_the_resave_on_every_rank(tmp_path):
    # Issue 65: rank 0 opened step 1 as saved at 2 ranks; it is saved again
    # at 1 rank (another layout of the same tensors) before rank 1 opens
    # it. Every rank refuses the load at once, naming the re-save (before,
    # the coordinator raised KeyError or "outside its stored chunk" from
    # planning with rank 1's plan of the other save).
    outs, took = _load_while_saved_again(tmp_path, 1)
    for rank, text in enumerate(outs):
        assert "failed:" in text and "saved again" in text, f"rank {rank}:\n{text[-3000:]}"
        assert "Timed out" not in text, f"rank {rank}:\n{text[-3000:]}"
    assert took < 60


def test_a_rank_that_cannot_open_the_chosen_save_fails_a_striped_load_on_every_rank(tmp_path):
    # Issue 65: rank 1 is given another bucket holding another save of the
    # step; it cannot open the coordinator's and raises before the striped
    # exchange. Every rank raises at once, naming it (before, rank 0 waited
    # out the fan-out group's timeout, 10 minutes by default).
    url = f"file://{tmp_path}/bucket"
    run("save", url, 1, 2, salt=0)
    run("save", url + "-other", 1, 2, salt=9)
    began = time.monotonic()
    outs = finish(start("load-apart", url, 2, tmp_path))
    for rank, text in enumerate(outs):
        assert "failed:" in text and "no longer holds the save of step 1" in text, f"rank {rank}:\n{text[-3000:]}"
        assert "Timed out" not in text, f"rank {rank} waited for the others:\n{text[-3000:]}"
    assert time.monotonic() - began < 60


def _fails_fast_on_every_rank(mode, tmp_path, expect):
    url = f"file://{tmp_path}/bucket"
    run("save", url, 1, 2)
    began = time.monotonic()
    outs = finish(start(mode, url, 2, tmp_path))
    took = time.monotonic() - began
    for rank, text in enumerate(outs):
        assert "failed:" in text and expect in text, f"rank {rank}:\n{text[-3000:]}"
        assert "Timed out" not in text, f"rank {rank} waited for the others:\n{text[-3000:]}"
    assert took < 60, f"{took:.0f} s: a rank waited on a collective"


def test_a_rank_that_cannot_list_the_bucket_fails_the_load_on_every_rank(tmp_path):
    _fails_fast_on_every_rank("load-unlisted", tmp_path, "the bucket cannot be listed")


def test_one_failed_metadata_read_fails_the_load_on_every_rank(tmp_path):
    _fails_fast_on_every_rank("load-flaky", tmp_path, "one metadata read failed")


def test_a_ckptstore_error_on_one_rank_reaches_every_rank_as_itself(tmp_path):
    # DCP pickles a rank's failure to the coordinator: the error and its
    # words arrive, not a PicklingError.
    _fails_fast_on_every_rank("save-error", tmp_path, "ckptstore.Error: injected: rank 1 cannot write")


def test_every_exception_type_of_the_package_survives_pickle():
    import importlib
    import pickle
    import pkgutil

    found = set()
    for info in pkgutil.walk_packages(ckptstore.__path__, "ckptstore."):
        if info.name.split(".")[-1].startswith("bench"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__.startswith("ckptstore"):
                found.add(value)
    assert {ckptstore.Error, ckptstore.CorruptError, ckptstore.LockedError, ckptstore.StepExistsError} <= found
    for kind in found:
        e = kind("step 3: injected")
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is kind and back.args == e.args and str(back) == str(e), kind
    assert repr(ckptstore.Error("x")) == "Error('x')"


def test_a_subgroup_and_no_dist_save_and_load(tmp_path):
    url = f"file://{tmp_path}/bucket"
    outs = finish(start("subgroup", url, 3, tmp_path))
    for rank, text in enumerate(outs):
        assert "ok" in text.splitlines(), f"rank {rank}:\n{text[-3000:]}"
    assert ckptstore.Remote(url).shards(1).world_size == 2
    assert ckptstore.Remote(url + "-alone").shards(1).world_size == 1


def _state(value):
    return {"w": torch.full((4, 4), float(value)), "step": torch.tensor(value)}


@pytest.mark.parametrize("kind", ["bucket", "store"])
def test_a_reused_reader_follows_the_latest_step(tmp_path, kind):
    target = f"file://{tmp_path}/bucket" if kind == "bucket" else str(tmp_path / "run.ckpt")
    reader = StorageReader(target)
    for step in (1, 2):
        dcp.save(_state(step), storage_writer=StorageWriter(target, step))
        loaded = _state(0)
        dcp.load(loaded, storage_reader=reader)
        assert reader.step == step and loaded["step"].item() == step


@pytest.mark.parametrize("kind", ["bucket", "store"])
def test_overwrite_false_refuses_a_committed_step(tmp_path, kind):
    from torch.distributed.checkpoint.api import CheckpointException

    target = f"file://{tmp_path}/bucket" if kind == "bucket" else str(tmp_path / "run.ckpt")
    dcp.save(_state(1), storage_writer=StorageWriter(target, 1))
    # DCP's own writer's words, with the step and the target.
    with pytest.raises(CheckpointException, match="Checkpoint already exists.* step 1 is already in"):
        dcp.save(_state(7), storage_writer=StorageWriter(target, 1, overwrite=False))
    loaded = _state(0)
    dcp.load(loaded, storage_reader=StorageReader(target, 1))
    assert loaded["step"].item() == 1
    # DCP's default, as FileSystemWriter's: a re-save replaces.
    dcp.save(_state(7), storage_writer=StorageWriter(target, 1))
    dcp.load(loaded, storage_reader=StorageReader(target, 1))
    assert loaded["step"].item() == 7


@pytest.mark.parametrize("kind", ["bucket", "store"])
def test_dtypes_safetensors_cannot_hold_round_trip_and_consolidation_names_them(tmp_path, kind):
    from ckptstore.dcp import consolidate

    target = f"file://{tmp_path}/bucket" if kind == "bucket" else str(tmp_path / "run.ckpt")
    z = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    state = {
        "model.w": torch.ones(2, 3),
        "extra.z128": torch.complex(z, -z),
        "extra.z32": torch.complex(z[0].half(), z[1].half()),
    }
    dcp.save(state, storage_writer=StorageWriter(target, 1))
    loaded = {n: torch.zeros_like(t) for n, t in state.items()}
    dcp.load(loaded, storage_reader=StorageReader(target, 1))
    for name, want in state.items():
        got = loaded[name]
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    out = tmp_path / "all.safetensors"
    with pytest.raises(ValueError, match="extra.z128 is torch.complex128"):
        consolidate(target, 1, out)
    assert not out.exists()
    assert consolidate(target, 1, out, prefix="model.") == ["w"]
    if kind == "bucket":
        ckpt = os.environ.get("CKPT_BIN", "ckpt")
        shown = subprocess.run([ckpt, "show", target, "1", "--json"], check=True, capture_output=True, text=True)
        assert '"torch.complex128"' in shown.stdout, shown.stdout
