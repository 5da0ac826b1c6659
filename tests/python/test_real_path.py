"""A store is its real path (issue 37, as a Python user meets it): a store
opened by a relative name keeps its pack files beside its file after
os.chdir, even where another run's store of the same name is; two names of
one store are one store; verify says why when it is not ok."""

import os
import subprocess
import sys

import numpy as np
import pytest

import ckptstore


def _big(step):
    # 8 MiB: every save writes a pack file.
    return {"w": np.full((2048, 1024), step, dtype=np.float32)}


# In a process of its own: chdir is process-wide.
_CHDIR = r"""
import os, sys
import numpy as np
import pytest
import ckptstore

def big(step):
    return {"w": np.full((2048, 1024), step, dtype=np.float32)}

os.chdir(sys.argv[1])
store = ckptstore.open("run.ckpt")
store.save(1, big(1))
os.chdir(sys.argv[2])          # where another run's run.ckpt is
store.save(2, big(2))
store.close()
"""


def test_a_relative_store_survives_chdir_and_spares_the_other_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with ckptstore.open(str(b / "run.ckpt")) as other:
        other.save(7, _big(7))
    subprocess.run([sys.executable, "-c", _CHDIR, str(a), str(b)], check=True)
    with ckptstore.open(str(a / "run.ckpt"), read_only=True) as store:
        assert store.steps() == [1, 2]
        assert (store.load(2).tensors["w"] == 2).all()
        assert store.verify().ok
    with ckptstore.open(str(b / "run.ckpt"), read_only=True) as other:
        assert other.steps() == [7]
        report = other.verify()
        assert report.ok, report.problems
        assert report.stray_pack_files == 0 and report.in_flight_pack_files == 0


def test_two_names_are_one_store_and_verify_says_why(tmp_path):
    real = tmp_path / "run-7.ckpt"
    link = tmp_path / "latest.ckpt"
    os.symlink("run-7.ckpt", link)
    with ckptstore.open(str(link)) as store:
        store.save(1, _big(1))
    with ckptstore.open(str(real)) as store:
        store.save(2, _big(2))
        assert store.verify().ok
    with ckptstore.open(str(link), read_only=True) as store:
        assert store.steps() == [1, 2]
        assert (store.load(1).tensors["w"] == 1).all()
    # Damage is reported with its reason, not as a bare ok=False.
    pack = sorted((tmp_path / "run-7.ckpt.packs").iterdir())[0]
    data = bytearray(pack.read_bytes())
    data[1000] ^= 0x40
    pack.write_bytes(bytes(data))
    with ckptstore.open(str(link), read_only=True) as store:
        report = store.verify()
        assert not report.ok and report.damaged == [1]
        assert len(report.problems) == 1 and "step 1" in report.problems[0]
        assert "hash" in report.problems[0], report.problems
        assert report.accounting == [] and report.pack_files == 2


def test_a_damaged_store_raises_no_errno_0(tmp_path):
    path = tmp_path / "run.ckpt"
    with ckptstore.open(str(path)) as store:
        for step in range(3):
            store.save(step, {"w": np.full((64, 64), step, dtype=np.float32)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises((ckptstore.Error, OSError)) as raised:
        with ckptstore.open(str(path), read_only=True) as store:
            store.load(2)
    # An errno only where the system gave one ("[Errno 0]" says nothing).
    assert getattr(raised.value, "errno", None) != 0, repr(raised.value)
    assert "[Errno 0]" not in str(raised.value)
