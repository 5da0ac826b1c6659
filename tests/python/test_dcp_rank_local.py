"""DCP's rank-local mode through ckptstore.dcp (issue 66): real processes
over gloo, `dcp.save(..., use_collectives=False)` to a bucket. A step is
listed only once every rank's shard of one save is there; a rank killed
before its shard leaves no step, and a later save of the step completes;
loads at the world size it was saved at read each rank's own shard
alone, and at other sizes every rank's metadata, bit-identical; against
a directory bucket and the Garage server."""

import os
import time
import uuid
from typing import Dict

import pytest

import ckptstore
from test_dcp import run

LONG = os.environ.get("CKPT_LONG") == "1"


@pytest.fixture(params=["dir", "garage"])
def url(request, tmp_path):
    if request.param == "dir":
        return f"file://{tmp_path}/bucket"
    bucket = os.environ.get("CKPT_TEST_BUCKET")
    if not bucket:
        pytest.skip("no Garage (CKPT_TEST_BUCKET unset)")
    return f"s3://{bucket}/rank-local-{uuid.uuid4().hex}"


def _lines(text, prefix):
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def _saved_rank_locally(url, step, world, salt=0, env=None):
    out = run("save_local", url, step, world, salt=salt, env=env)
    for rank, (_, text) in enumerate(out):
        assert "failed" not in text, f"rank {rank}:\n{text[-3000:]}"
        # No collective but DCP's closing barrier.
        assert _lines(text, "collectives ") == ["['barrier']"], f"rank {rank}:\n{text[-3000:]}"


def _loaded(url, step, world, salt=0, env=None):
    out = run("load", url, step, world, salt=salt, env=env)
    for rank, (_, text) in enumerate(out):
        assert text.strip().endswith(f"ok {step}"), f"rank {rank}:\n{text[-3000:]}"
    return out


@pytest.mark.parametrize("world", [2, 4, 8] if LONG else [2, 4])
def test_a_rank_local_save_loads_at_its_world_size_reading_each_rank_s_own_shard(url, world):
    _saved_rank_locally(url, 3, world)
    remote = ckptstore.Remote(url)
    assert remote.steps() == [3]
    assert remote.shards(3).complete and remote.shards(3).world_size == world
    for rank, (_, text) in enumerate(_loaded(url, 3, world)):
        # Its own shard's metadata and data, nothing of another's; no
        # collective of ckptstore's (DCP's plan exchange and its last
        # gather, as in every dcp.load of torch 2.15).
        assert _lines(text, "shards ") == [f"[{rank}]"], text
        calls = eval(_lines(text, "collectives ")[0])  # noqa: S307 - the worker's own list
        assert sorted(calls) == ["all_gather_object", "gather_object", "scatter_object_list"], calls
    assert remote.verify().ok


@pytest.mark.parametrize("saved,loaded", [(4, 2), (4, 1), (2, 4)])
def test_a_rank_local_save_loads_at_other_world_sizes_bit_identical(tmp_path, saved, loaded):
    url = f"file://{tmp_path}/bucket"
    _saved_rank_locally(url, 5, saved, salt=2)
    _loaded(url, 5, loaded, salt=2)


def test_a_resharded_load_given_its_group_reads_each_rank_s_metadata_once_and_hands_it_on(tmp_path):
    url = f"file://{tmp_path}/bucket"
    _saved_rank_locally(url, 5, 4, salt=3)
    group = {"CKPT_LOAD_GROUP": "1"}
    for env, reads in (({}, [[0, 1, 2, 3]] * 2), (group, [[0, 2], [1, 3]])):
        for rank, (_, text) in enumerate(_loaded(url, 5, 2, salt=3, env=env)):
            assert _lines(text, "metadata ") == [str(reads[rank])], text
            calls = eval(_lines(text, "collectives ")[0])  # noqa: S307 - the worker's own list
            # The exchange is one all_gather_object beside DCP's and the
            # striped load's own.
            assert calls.count("all_gather_object") == (2 if env else 1), calls
    # A rank that fails to read its part fails the load on every rank,
    # and none waits out the groups' timeout (20 s here).
    failing = {**group, "CKPT_FAIL_IN_READ": "1", "CKPT_PG_TIMEOUT": "20"}
    started = time.monotonic()
    out = run("load", url, 5, 2, salt=3, env=failing, expect_ok=False)
    assert time.monotonic() - started < 20, "a rank waited out the timeout"
    assert "injected: the bucket failed this read" in out[1][1], out[1][1]
    assert "member 1 of the load's process group failed" in out[0][1], out[0][1]


def test_plain_tensors_each_rank_holds_alone_load_at_the_same_and_a_smaller_world(tmp_path):
    # Not DTensors: `own.<rank>` is in rank <rank>'s shard only.
    url = f"file://{tmp_path}/bucket"
    env = {"CKPT_PER_RANK": "1"}
    out = run("save_local", url, 2, 4, salt=5, env=env)
    assert all("failed" not in text for _, text in out), out
    _loaded(url, 2, 4, salt=5, env=env)
    _loaded(url, 2, 2, salt=5, env=env)


def test_a_state_sharded_otherwise_at_the_same_world_size_is_refused_or_read_whole(tmp_path):
    url = f"file://{tmp_path}/bucket"
    _saved_rank_locally(url, 1, 2)
    # Every tensor replicated: each rank's own shard holds half of each.
    out = run("load", url, 1, 2, env={"CKPT_REPLICATE": "1", "CKPT_PG_TIMEOUT": "20"}, expect_ok=False)
    for rank, (code, text) in enumerate(out):
        assert code != 0 and "does not hold all of model.a" in text, f"rank {rank}:\n{text[-3000:]}"
    _loaded(url, 1, 2, env={"CKPT_REPLICATE": "1", "CKPT_RANK_LOCAL": "0"})


@pytest.mark.parametrize("phase", ["CKPT_DIE_BEFORE_SAVE", "CKPT_DIE_AFTER_WRITE"])
def test_a_rank_killed_before_its_shard_leaves_no_step_and_a_later_save_completes(tmp_path, phase):
    url = f"file://{tmp_path}/bucket"
    _saved_rank_locally(url, 1, 2)
    # Step 2: rank 1 dies before its save (rank 0 fails in the state's
    # own collectives, or lands its shard), or once it wrote its data and
    # before its shard (rank 0's shard lands; its closing barrier fails).
    env = {phase: "1", "CKPT_PG_TIMEOUT": "10"}
    out = run("save_local", url, 2, 2, salt=7, env=env, expect_ok=False)
    assert out[1][0] == 9
    remote = ckptstore.Remote(url)
    assert remote.steps() == [1]
    status = remote.shards(2)
    assert 1 not in status.landed and not status.complete, status
    if phase == "CKPT_DIE_AFTER_WRITE":
        assert status.landed == [0]
    # The relaunched job saves step 2 again, with other values: its rank 1
    # finds rank 0's shard of the dead save and does not take it.
    _saved_rank_locally(url, 2, 2, salt=1)
    assert remote.steps() == [1, 2]
    _loaded(url, 2, 2, salt=1)
    _loaded(url, 2, 1, salt=1)


def test_a_rank_killed_once_its_shard_landed_leaves_the_step_listed_exactly_when_whole(tmp_path):
    # The listing path (CKPT_RANK_LOCAL_RENDEZVOUS=0): each rank lists the
    # step's shards once its own landed.
    url = f"file://{tmp_path}/bucket"
    env = {"CKPT_RANK_LOCAL_RENDEZVOUS": "0", "CKPT_DIE_AFTER_SHARD": "1", "CKPT_PG_TIMEOUT": "10"}
    out = run("save_local", url, 3, 2, salt=4, env=env, expect_ok=False)
    assert out[1][0] == 9
    remote = ckptstore.Remote(url)
    status = remote.shards(3)
    # Both shards landed: listed whether rank 1 or rank 0 found them
    # both there (the other finds them at its own shard).
    assert status.landed == [0, 1] and status.complete and remote.steps() == [3], status
    _loaded(url, 3, 2, salt=4)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_complete_the_step_through_the_job_s_store_write_one_commit(tmp_path, world):
    # Issue 75 (the default): each rank writes its shard only and tells
    # the others through the default process group's store, under its
    # bucket lock; the rank that completes the count commits the names
    # told in that lock cycle.
    url = f"file://{tmp_path}/bucket"
    env = {"CKPT_TRACE_SHARDS": "1"}
    for step in (3, 4):
        out = run("save_local", url, step, world, salt=step, env=env)
        commits = []
        for rank, (_, text) in enumerate(out):
            assert _lines(text, "collectives ") == ["['barrier']"], f"rank {rank}:\n{text[-3000:]}"
            assert _lines(text, "upload ") == ["RankLocalShard"], f"rank {rank}:\n{text[-3000:]}"
            assert _lines(text, "keys left ") == ["False"], f"rank {rank}:\n{text[-3000:]}"
            commits += _lines(text, "commit ")
        assert commits == ["announced"], commits  # by the rank that completed the count
    remote = ckptstore.Remote(url)
    assert remote.steps() == [3, 4]
    commits = sorted(os.listdir(tmp_path / "bucket" / "commits"))
    assert [c.split("-")[0] for c in commits] == [f"{3:020}", f"{4:020}"], commits
    status = remote.shards(4)
    assert status.complete and status.world_size == world and status.saves == 1, status
    _loaded(url, 4, world, salt=4, env=env)
    _loaded(url, 4, 1, salt=4)
    assert remote.verify().ok


def test_a_save_whose_rank_died_before_telling_the_others_is_completed_by_the_relaunch(tmp_path):
    # Rank 1's shard lands and it dies before telling rank 0: the count
    # never completes, no commit. The relaunch's rank 0 completes the
    # step (every rank's shard of its save is there) before its own save.
    url = f"file://{tmp_path}/bucket"
    flag: Dict[str, str] = {}
    env = {**flag, "CKPT_DIE_AFTER_SHARD": "1", "CKPT_PG_TIMEOUT": "10"}
    out = run("save_local", url, 3, 2, salt=4, env=env, expect_ok=False)
    assert out[1][0] == 9
    remote = ckptstore.Remote(url)
    status = remote.shards(3)
    assert status.landed == [0, 1] and not status.complete and remote.steps() == [], status
    _saved_rank_locally(url, 4, 2, salt=5, env=flag)
    assert remote.steps() == [3, 4]
    _loaded(url, 3, 2, salt=4)
    _loaded(url, 4, 2, salt=5)


def test_an_async_rank_local_save_is_listed_when_its_futures_resolve(tmp_path):
    # Thread mode: DCP's rank-local save ends with its barrier, on the
    # saving thread; each rank's future resolves after it.
    url = f"file://{tmp_path}/bucket"
    run("async_save_local", url, 6, 2, salt=3)
    assert ckptstore.Remote(url).steps() == [6]
    _loaded(url, 6, 2, salt=3)
    _loaded(url, 6, 1, salt=3)


def test_a_rank_local_save_in_dcp_s_process_mode_completes_through_the_background_processes(tmp_path):
    # Process mode: each rank's save runs in a background process of its
    # own, whose process group (DCP's) holds the store the ranks announce
    # their shards through.
    url = f"file://{tmp_path}/bucket"
    out = run("async_save_local_process", url, 6, 2, salt=3, env={"CKPT_TRACE_SHARDS": "1"})
    assert "listed [6]" in out[0][1], out[0][1][-3000:]
    assert ckptstore.Remote(url).steps() == [6]
    _loaded(url, 6, 2, salt=3)


def test_a_local_store_refuses_a_rank_local_save_of_several_ranks(tmp_path):
    path = tmp_path / "run.ckpt"
    for rank, (_, text) in enumerate(run("save_local", path, 1, 2)):
        assert "failed NotImplementedError: a rank-local save" in text, f"rank {rank}:\n{text[-3000:]}"
    if path.exists():
        with ckptstore.open(path, read_only=True) as store:
            assert store.steps() == []


def test_a_rank_local_save_of_one_process_is_an_ordinary_save(tmp_path):
    url = f"file://{tmp_path}/bucket"
    out = run("save_local", url, 1, 1)
    assert "failed" not in out[0][1], out[0][1]
    _loaded(url, 1, 1)
    _loaded(url, 1, 2)


def test_a_rank_local_step_consolidates_and_shows_as_any(tmp_path):
    import json
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    from ckptstore.dcp import consolidate
    from test_dcp import WORKER

    sys.path.insert(0, str(WORKER.parent))
    try:
        import worker
    finally:
        sys.path.pop(0)
    url = f"file://{tmp_path}/bucket"
    _saved_rank_locally(url, 4, 2)
    out = tmp_path / "model.safetensors"
    names = consolidate(url, 4, out, prefix="model.")
    assert sorted(names) == ["a", "b", "big", "c"]
    got = load_file(str(out))
    for name in names:
        want = worker.full(f"model.{name}", 0)
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    ckpt = os.environ.get("CKPT_BIN", "ckpt")
    shown = subprocess.run([ckpt, "show", url, "4", "--json"], check=True, capture_output=True, text=True)
    index = json.loads(shown.stdout)
    assert index["world_size"] == 2 and index["dcp"]
    assert index["tensors"]["model.big"]["shape"] == [1100, 300]
    assert index["values"] == ["extra.epoch", "extra.name"]
