"""Object storage from Python: push, background replication, loads and
pulls from a bucket alone, and multi-rank global steps (numpy and torch).
Against a directory bucket, and against the Garage server `.ci/run` starts
when its variables are set (CKPT_TEST_BUCKET and the AWS_* ones)."""

import os
import uuid

import numpy as np
import pytest

import ckptstore


def _buckets(tmp_path):
    yield f"file://{tmp_path}/bucket"
    bucket = os.environ.get("CKPT_TEST_BUCKET")
    if bucket:
        yield f"s3://{bucket}/py-{uuid.uuid4().hex}"


def _state(step):
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((256, 256), dtype=np.float32),
        "frozen": np.arange(1 << 18, dtype=np.int32),
        "rng": bytes([step % 256]) * 16,
    }


def _same(ck, state):
    for name, want in state.items():
        got = ck.tensors[name]
        if isinstance(want, bytes):
            assert bytes(got) == want
        else:
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_push_then_load_and_pull_from_the_bucket_alone(tmp_path):
    for url in _buckets(tmp_path):
        path = tmp_path / f"run-{uuid.uuid4().hex}.ckpt"
        with ckptstore.open(path) as store:
            for step in range(3):
                store.save(step, _state(step), metrics={"loss": 1.0 / (step + 1)})
            report = store.push(url)
            assert report["steps_pushed"] == [0, 1, 2]
            # The frozen tensor went up once.
            assert report["bytes_skipped"] >= 2 * (1 << 20)
            assert store.push(url)["steps_pushed"] == []
        remote = ckptstore.Remote(url)
        assert remote.steps() == [0, 1, 2] and remote.latest_step() == 2
        ck = remote.load()
        assert ck.step == 2 and ck.metrics == {"loss": 1.0 / 3}
        _same(ck, _state(2))
        assert remote.load(9) is None
        with ckptstore.open(tmp_path / f"fresh-{uuid.uuid4().hex}.ckpt") as fresh:
            info = remote.pull(1, fresh)
            assert info.step == 1
            _same(fresh.load(1), _state(1))
        assert remote.verify().ok
        assert remote.gc(keep_last=1) == [0, 1]
        assert remote.steps() == [2]


def test_replicate_to_uploads_every_commit_and_flush_waits(tmp_path):
    url = f"file://{tmp_path}/bucket"
    with ckptstore.open(tmp_path / "run.ckpt", replicate_to=url) as store:
        store.save(1, _state(1))
        store.save_async(2, _state(2))
        store.flush()
        status = store.replication_status()
        assert status["pending"] == [] and status["last_error"] is None
        assert status["url"] == url
    assert ckptstore.Remote(url).steps() == [1, 2]
    with ckptstore.open(tmp_path / "plain.ckpt") as plain:
        assert plain.replication_status() is None
    with pytest.raises(ValueError):
        ckptstore.open(tmp_path / "x.ckpt", replicate_to="ftp://nowhere/x")


def test_a_global_step_is_listed_once_every_rank_saved_it(tmp_path):
    for url in _buckets(tmp_path):
        remote = ckptstore.Remote(url)
        ranks = [remote.shard(rank, 3) for rank in range(3)]
        for step in (10, 11):
            for shard in ranks[:2]:
                info = shard.save(step, _state(step * 10 + shard.rank))
                assert not info.complete
        assert remote.steps() == []
        status = remote.shards(11)
        assert (status["landed"], status["missing"]) == ([0, 1], [2])
        assert ranks[2].save(10, _state(102)).complete
        assert remote.steps() == [10] and remote.latest_step() == 10
        for shard in ranks:
            _same(shard.load(), _state(100 + shard.rank))
        with pytest.raises(ValueError):
            remote.load(10)  # a global step: load each shard
        with pytest.raises(ValueError):
            remote.shard(0, 2).save(10, _state(100))  # 2 ranks, not 3


def test_torch_models_of_each_rank_resume_from_the_bucket(tmp_path):
    torch = pytest.importorskip("torch")
    import ckptstore.torch as ct

    url = f"file://{tmp_path}/bucket"
    remote = ckptstore.Remote(url)
    torch.manual_seed(0)
    models = [torch.nn.Linear(64, 64) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    for m, o in zip(models, opts):
        m(torch.randn(8, 64)).sum().backward()
        o.step()
    for rank, (m, o) in enumerate(zip(models, opts)):
        info = ct.save(remote.shard(rank, 2), 5, model=m, optimizer=o, metrics={"loss": 0.5})
        assert info.complete == (rank == 1)
    with pytest.raises(ValueError):
        ct.save(remote.shard(0, 2), 6, model=models[0], blocking=False)
    assert remote.latest_step() == 5
    for rank in range(2):
        fresh = torch.nn.Linear(64, 64)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        assert ct.load(remote.shard(rank, 2), model=fresh, optimizer=fresh_opt) == 5
        for a, b in zip(fresh.state_dict().values(), models[rank].state_dict().values()):
            assert torch.equal(a, b)
        got = fresh_opt.state_dict()["state"][0]["exp_avg"]
        assert torch.equal(got, opts[rank].state_dict()["state"][0]["exp_avg"])


def test_a_redone_step_replaces_the_old_one_and_a_prefix_holds_one_run(tmp_path):
    for url in _buckets(tmp_path):
        remote = ckptstore.Remote(url, grace_period=3600.0)
        with ckptstore.open(tmp_path / f"a-{uuid.uuid4().hex}.ckpt") as store:
            for step in range(1, 4):
                store.save(step, _state(step))
            assert store.push(remote)["steps_pushed"] == [1, 2, 3]
            for round_ in range(3):
                store.remove(3)
                store.save(3, _state(100 + round_))
                assert store.push(remote)["steps_pushed"] == [3]
                _same(remote.load(3), _state(100 + round_))
            assert remote.owner() == store.store_id
            with ckptstore.open(tmp_path / f"b-{uuid.uuid4().hex}.ckpt") as other:
                other.save(1, _state(9))
                with pytest.raises(ValueError, match="holds the run of store"):
                    other.push(url)
                remote.adopt(other)
                assert other.push(remote)["steps_pushed"] == [1]
                _same(remote.load(1), _state(9))


def test_absurd_world_sizes_are_refused():
    remote = ckptstore.Remote("file:///nonexistent-ckptstore-bucket")
    for rank, world in [(0, 10**9), (0, 0), (3, 3), (-1, 2)]:
        with pytest.raises(ValueError, match="world size"):
            remote.shard(rank, world)
    assert remote.shard(1, ckptstore.MAX_WORLD_SIZE).world_size == ckptstore.MAX_WORLD_SIZE


def test_a_shard_name_that_is_no_hash_is_refused_before_anything_is_written(tmp_path):
    remote = ckptstore.Remote(f"file://{tmp_path}/bucket")
    state = {"w": np.arange(1000, dtype=np.float32)}
    own = remote.upload_shard(1, 0, 2, state).shard
    for bad in ["x", own.upper(), own[:-1], ""]:
        with pytest.raises(ValueError, match=r"shard 1: .* is not a hash"):
            remote.commit_global(1, [own, bad])
        with pytest.raises(ValueError, match=r"shard 1: .* is not a hash"):
            remote.upload_shard(2, 0, 2, state, commit=["", bad])
    assert remote.steps() == []
    # This rank's own entry is not read: any string will do.
    other = remote.upload_shard(2, 1, 2, state).shard
    remote.upload_shard(2, 0, 2, state, commit=["not read", other])
    assert remote.steps() == [2]


# Peak memory of reading 256 MiB of a global step into arrays allocated
# before: each chunk is placed as it arrives and let go, so the peak grows
# by the downloads in flight, not by the step (it grew by all of it when
# every chunk was held until the end).
PIECES_MEMORY_SCRIPT = """
import os, resource, sys, numpy as np, ckptstore
url = sys.argv[1]
remote = ckptstore.Remote(url)
a = np.frombuffer(os.urandom(256 << 20), dtype=np.uint8)
info = remote.upload_shard(1, 0, 1, {"a": a})
remote.commit_global(1, [info.shard])
del a, info
opened = remote.open_global(1)
halves = [np.empty(128 << 20, dtype=np.uint8) for _ in range(2)]
for h in halves:
    h.fill(1)
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
before = peak()
remote.read_pieces_into(opened, [(0, "a", 0, 128 << 20), (0, "a", 128 << 20, 128 << 20)], halves)
print(peak() - before)
"""


def test_reading_pieces_into_arrays_holds_only_the_chunks_in_flight(tmp_path):
    import subprocess
    import sys

    url = f"file://{tmp_path / 'bucket'}"
    os.makedirs(tmp_path / "bucket")
    out = subprocess.run([sys.executable, "-c", PIECES_MEMORY_SCRIPT, url],
                         check=True, capture_output=True, text=True).stdout
    grew = int(out.split()[-1])
    assert grew < 96, f"reading 256 MiB into arrays grew the peak by {grew} MiB"
