"""A store survives fork, misuse and bad input: a forked child cannot write
or close the parent's store, steps are integers, torch modules with extra
state or unsupported layouts are handled, retention that keeps nothing
needs saying so, and close() says what becomes of pending replication."""

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

import ckptstore


def _state(step):
    return {"w": np.full((64, 64), step, dtype=np.float32), "rng": bytes([step % 256]) * 8}


# The fork scenario runs in a plain interpreter: a forked child must leave
# through sys.exit or an uncaught exception (interpreter shutdown drops the
# store), which pytest would catch inside a test.
_FORKING = r"""
import json, os, signal, sys
import numpy as np
import ckptstore

def state(step):
    return {"w": np.full((64, 64), step, dtype=np.float32)}

def child(store, action):
    if action == "read-and-exit":
        try:
            store.steps()
            os._exit(5)  # a read from the child must be refused
        except ckptstore.Error as e:
            assert "fork" in str(e), e
        sys.exit(0)
    if action == "save":
        try:
            store.save(50, state(50))
            os._exit(3)  # a write from the child must not succeed
        except ckptstore.Error as e:
            assert "fork" in str(e), e
        sys.exit(0)
    if action == "raise":
        raise RuntimeError("a child that dies of an exception")
    if action == "killed":
        os.kill(os.getpid(), signal.SIGKILL)

path = sys.argv[1]
store = ckptstore.open(path)
for step in range(3):
    store.save(step, state(step))
codes = {}
for i, action in enumerate(["read-and-exit", "save", "raise", "killed"]):
    pid = os.fork()
    if pid == 0:
        child(store, action)
        sys.exit(0)
    store.save(100 + i, state(100 + i))  # the parent goes on meanwhile
    codes[action] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
try:
    ckptstore.open(path)
    locked = False
except ckptstore.LockedError:
    locked = True
report = store.verify()
print(json.dumps({"codes": codes, "locked": locked, "steps": store.steps(),
                  "ok": report.ok}))
store.close()
"""


def test_forked_children_never_touch_the_parents_store(tmp_path):
    path = tmp_path / "run.ckpt"
    run = subprocess.run(
        [sys.executable, "-c", _FORKING, str(path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["codes"] == {
        "read-and-exit": 0,
        "save": 0,
        "raise": 1,
        "killed": -signal.SIGKILL,
    }, run.stderr
    # The parent's writer lock still excluded a second writer.
    assert result["locked"] is True
    assert result["steps"] == [0, 1, 2, 100, 101, 102, 103]
    assert result["ok"] is True
    with ckptstore.open(path) as again:
        assert again.steps() == [0, 1, 2, 100, 101, 102, 103]
        report = again.verify()
        assert report.ok and report.steps_ok == 7
        np.testing.assert_array_equal(
            again.load(102).tensors["w"], np.full((64, 64), 102, dtype=np.float32)
        )


def test_steps_are_integers(tmp_path):
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        store.save(3, _state(3))
        store.save(np.int64(4), _state(4))  # operator.index takes numpy ints
        assert store.steps() == [3, 4]
        for bad in [2.9, 1.5, "7", 3.0, True, None]:
            with pytest.raises(TypeError):
                store.save(bad, _state(1))
            with pytest.raises(TypeError):
                store.remove(bad)
            with pytest.raises(TypeError):
                bad in store  # noqa: B015
            with pytest.raises(TypeError):
                store[bad]
        for bad in [2.9, "7", True]:
            with pytest.raises(TypeError):
                store.load(bad)
        for bad in [-1, 1 << 64]:
            with pytest.raises(ValueError):
                store.save(bad, _state(1))
            with pytest.raises(ValueError):
                store.load(bad)
            with pytest.raises(ValueError):
                bad in store  # noqa: B015
        assert 3 in store and 5 not in store
        assert store.steps() == [3, 4]
        remote = ckptstore.Remote(f"file://{tmp_path}/bucket")
        with pytest.raises(TypeError):
            remote.shard(0, 2).save(1.5, _state(1))


def test_retention_that_keeps_nothing_must_say_so(tmp_path):
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        for step in range(3):
            store.save(step, _state(step))
        with pytest.raises(ValueError, match="allow_deleting_all=True"):
            store.gc(keep_last=0)
        assert store.steps() == [0, 1, 2]
        assert store.gc(keep_last=0, allow_deleting_all=True) == [0, 1, 2]
        assert store.steps() == []


def test_close_says_what_becomes_of_pending_replication(tmp_path):
    # A bucket no one can write: /proc refuses new files, even to root.
    store = ckptstore.open(tmp_path / "run.ckpt", replicate_to="file:///proc/ckptstore-bucket")
    store.save(1, _state(1))
    with pytest.raises(ckptstore.Error) as failed:
        store.close()
    message = str(failed.value)
    assert "is closing" in message and "[1]" in message, message
    assert "retrying in the background" not in message, message


# A background commit that fails on the device, never observed through its
# handle: flush() raises OSError with the errno (EFBIG from RLIMIT_FSIZE,
# in a process of its own), and the store goes on.
_EFBIG = r"""
import os, resource, signal, sys
import numpy as np
import ckptstore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
path = sys.argv[1]
store = ckptstore.open(path)
store.save(1, {"w": np.zeros(1000, np.float32)})
limit = os.path.getsize(path) + (1 << 20)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
del_me = store.save_async(2, {"w": np.arange(16 << 20, dtype=np.float32)})  # 64 MiB, distinct chunks
del del_me
try:
    store.flush()
    print("flush raised nothing")
except OSError as e:
    print("errno", e.errno)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
store.flush()  # reported once
store.save(3, {"w": np.zeros(10, np.float32)})
print("steps", store.steps(), store.verify().ok)
store.close()
"""


def test_flush_raises_an_unobserved_device_failure_as_oserror(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", _EFBIG, str(tmp_path / "run.ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "errno 27" in lines, run.stdout  # EFBIG
    assert "steps [1, 3] True" in lines, run.stdout
