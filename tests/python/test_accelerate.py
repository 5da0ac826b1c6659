"""ckptstore.accelerate (issue 76): Accelerate's save_state/load_state
into a store and a bucket, at 1 and 2 processes on CPU, the state back
bit-identical."""

import os
import socket
import subprocess
import sys

import pytest

import ckptstore

WORKER = os.path.join(os.path.dirname(__file__), "integrations", "accelerate_worker.py")


def _run(target, world, extra=None):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
               **(extra or {})}
        procs.append(subprocess.Popen([sys.executable, WORKER, str(target)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    if extra and "CKPT_DIE_AT_SAVE" in extra:
        # The main process dies in the commit; the others wait for it at
        # Accelerate's barrier: stopped here.
        out, err = procs[0].communicate(timeout=300)
        assert procs[0].returncode == 9, f"{out[-2000:]}\n{err[-3000:]}"
        for p in procs[1:]:
            p.kill()
            p.communicate()
        return
    outs = [p.communicate(timeout=300) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and "OK" in out, f"rank {rank}:\n{out[-2000:]}\n{err[-3000:]}"
    return [out for out, _ in outs]


@pytest.mark.parametrize("world", [1, 2])
def test_accelerate_state_saves_into_a_store_and_loads_back(tmp_path, world):
    _run(tmp_path / "run.ckpt", world)
    with ckptstore.open(tmp_path / "run.ckpt", read_only=True) as store:
        assert store.steps() == [3]


def test_accelerate_state_saves_into_a_bucket(tmp_path):
    url = f"file://{tmp_path}/bucket"
    _run(url, 2)
    assert ckptstore.Remote(url).steps() == [3]


def test_a_failed_commit_raises_on_every_process_and_the_job_goes_on(tmp_path):
    path = tmp_path / "run.ckpt"
    outs = _run(path, 2, extra={"CKPT_FAIL_COMMIT": "1"})
    assert "raised ValueError: injected" in outs[0], outs[0][-2000:]
    assert "raised RuntimeError: process 0 of the save or load failed: ValueError" in outs[1], outs[1][-2000:]
    with ckptstore.open(path, read_only=True) as store:
        assert store.steps() == [3]


def test_a_job_killed_in_its_save_leaves_the_step_before_it(tmp_path):
    path = tmp_path / "run.ckpt"
    _run(path, 2, extra={"CKPT_DIE_AT_SAVE": "1"})
    with ckptstore.open(path, read_only=True) as store:
        assert store.steps() == [3]
        assert store.verify().ok
