"""ckptstore.torchtitan.CheckpointManager driven as torchtitan 0.3.0's
trainer drives its manager, with real processes (gloo on 127.0.0.1, FSDP2
over a CPU mesh: DTensor-sharded parameters and optimizer state) and
ckptstore's real writer and reader underneath: resumes bit-identical after
a kill -9 at a random moment in each async mode, at another world size,
keep_latest_k, the last step in Hugging Face's format, and the same state
restored as torchtitan's own checkpointer restores."""

import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan is not installed")

import ckptstore  # noqa: E402

WORKER = pathlib.Path(__file__).parent / "torchtitan" / "worker.py"
STEPS = 6


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(folder, world, steps, options, target="-"):
    port = _port() if world > 1 else 0
    args = [f"{k}={v}" for k, v in options.items()]
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(folder), target, str(r), str(world), str(port), str(steps), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def run(folder, world=2, steps=STEPS, target="-", **options):
    """A run of `world` ranks to `steps`: rank 0's lines, each split."""
    procs = _start(folder, world, steps, options, target)
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, text))
    for rank, (code, text) in enumerate(out):
        assert code == 0 and "done" in text.splitlines(), f"rank {rank} of {world} failed ({code}):\n{text[-3000:]}"
    keep = (["resumed"], ["step"], ["final"], ["committed"])
    return [line.split() for line in out[0][1].splitlines() if line.split()[:1] in keep]


def killed(folder, world, at, **options):
    """A run whose every process is killed (SIGKILL, as a preempted job)
    once rank 0 reports step `at` done and a random moment after, in
    the middle of that step's save or of the next step: the step reached."""
    procs = _start(folder, world, STEPS, options)
    reached = 0
    deadline = time.monotonic() + 120
    for line in procs[0].stdout:
        words = line.split()
        if words[:1] == ["step"]:
            reached = int(words[1])
            if reached >= at:
                time.sleep(random.uniform(0, 0.3))
                break
        assert time.monotonic() < deadline, "the run never reached the step"
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)
    return reached


def by_step(lines):
    return {int(w[1]): w[2] for w in lines if w[0] == "step"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run at two ranks: each step's state, and the last."""
    lines = run(tmp_path_factory.mktemp("reference"))
    return by_step(lines), next(w[1] for w in lines if w[0] == "final"), lines[0][2]


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_a_run_killed_at_a_random_moment_resumes_bit_identical(tmp_path, reference, mode):
    steps, final, fresh = reference
    reached = killed(tmp_path, 2, random.randint(3, STEPS - 1), **{"async": mode})
    lines = run(tmp_path, **{"async": mode})
    resumed = lines[0]
    step = int(resumed[1])
    # The newest committed step, whole (its state exactly as trained): at
    # most two behind the step rank 0 had reported (its save and the one
    # before, in flight when the kill came).
    assert step >= reached - 2, (step, reached)
    assert resumed[2] == (steps[step] if step else fresh), (mode, step)
    assert int(resumed[3]) == step  # the dataloader's position
    assert next(w[1] for w in lines if w[0] == "final") == final


def test_a_save_at_two_ranks_loads_at_one_and_at_three(tmp_path, reference):
    steps, _, _ = reference
    run(tmp_path)
    for world in (1, 3):
        # torchtitan's dataloader state is per data-parallel rank: a load
        # at another world size leaves it out, as torchtitan's own does.
        resumed = run(tmp_path, world=world, exclude="dataloader")[0]
        assert resumed[1:3] == [str(STEPS), steps[STEPS]], world
        assert resumed[3] == "0"


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_close_waits_for_the_save_in_flight(tmp_path, mode):
    # Each save's writes start a second late; the loop leaves after step
    # 3's save returned (in flight) and closes: step 3 is committed when
    # close returns (torchtitan 0.3.0's own close does not wait).
    lines = run(tmp_path, world=1, stop_at=3, slow_save=1, **{"async": mode})
    committed = next(w[1:] for w in lines if w[0] == "committed")
    assert committed == ["1", "2", "3"], lines


def test_keep_latest_k_keeps_the_newest_steps_in_the_bucket(tmp_path):
    bucket = f"file://{tmp_path}/bucket"
    run(tmp_path, world=1, target=bucket, keep=2)
    assert ckptstore.Remote(bucket).steps() == [STEPS - 1, STEPS]


def test_keep_latest_k_with_the_local_tier_keeps_k_steps_in_the_bucket(tmp_path):
    # Issue 65: retention ran as each save returned, before its upload
    # landed, and never after: k + 1 steps were left.
    bucket, local = f"file://{tmp_path}/bucket", f"{tmp_path}/node{{node}}"
    run(tmp_path, world=1, target=bucket, local=local, keep=2)
    assert ckptstore.Remote(bucket).steps() == [STEPS - 1, STEPS]


def test_the_local_tier_saves_every_step_and_uploads_every_kth(tmp_path, reference):
    steps, _, _ = reference
    bucket, local = f"file://{tmp_path}/bucket", f"{tmp_path}/node{{node}}"
    run(tmp_path, target=bucket, local=local, upload_every=3)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("node")) == ["node0", "node1"]
    assert ckptstore.Remote(bucket).steps() == [3, 6]
    resumed = run(tmp_path, target=bucket, local=local, upload_every=3)[0]
    assert resumed[1:] == [str(STEPS), steps[STEPS], str(STEPS)], resumed


def test_the_last_step_in_hugging_face_format_reads_back_with_safetensors(tmp_path):
    import torch
    from safetensors.torch import load_file

    run(tmp_path, world=2, last_hf=1)
    exported = tmp_path / "ckpt" / f"step-{STEPS}"
    files = sorted(p.name for p in exported.iterdir())
    assert "model.safetensors" in files or "model.safetensors.index.json" in files, files
    loaded = {}
    for name in files:
        if name.endswith(".safetensors"):
            loaded.update(load_file(exported / name))
    weights = torch.load(tmp_path / "final-model.pt")
    assert sorted(loaded) == sorted(f"model.{k}" for k in weights)
    for k, v in weights.items():
        assert torch.equal(loaded[f"model.{k}"], v), k


def test_torchtitans_own_checkpointer_and_ckptstore_restore_the_same_state(tmp_path):
    own, ours, initial = tmp_path / "own", tmp_path / "ours", tmp_path / "initial"
    run(own, steps=4, manager="torchtitan", interval=2, **{"async": "async"})
    saved = by_step(run(ours, steps=4, interval=2, **{"async": "async"}))
    back = [run(own, steps=4, manager="torchtitan")[0], run(ours, steps=4)[0]]
    assert back[0][1:] == back[1][1:] == ["4", saved[4], "4"], back
    # A directory torchtitan wrote starts a ckptstore run (initial_load_path).
    resumed = run(initial, steps=4, initial=str(own / "ckpt" / "step-4"))[0]
    assert resumed[1:] == ["4", saved[4], "4"], resumed


def test_a_target_that_is_no_bucket_url_is_refused():
    from ckptstore.torchtitan import CheckpointManager

    with pytest.raises(ValueError, match="a bucket URL"):
        CheckpointManager.Config(target=f"/tmp/{uuid.uuid4().hex}")
    for wait in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout_seconds"):
            CheckpointManager.Config(timeout_seconds=wait)
