"""A step of files (issue 76): any directory a framework wrote, saved as
one step of a store or a bucket and written back byte for byte."""

import os

import pytest

import ckptstore


def _framework_dir(root, salt):
    os.makedirs(root / "global_step100", exist_ok=True)
    (root / "global_step100" / "model.pt").write_bytes(bytes(range(256)) * 8192)  # 2 MiB
    (root / "global_step100" / "optim.pt").write_bytes(bytes([salt]) * 100_000)
    (root / "latest").write_text("global_step100")


def _contents(root):
    found = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                found[os.path.relpath(path, root)] = fh.read()
    return found


def test_a_store_saves_a_directory_as_one_step_and_writes_it_back(tmp_path):
    saved = tmp_path / "saved"
    _framework_dir(saved, 1)
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        first = store.save_dir(100, saved)
        _framework_dir(saved, 2)
        second = store.save_dir(101, saved)
        assert second.bytes_written * 3 < first.bytes_written, (first, second)
        assert store.load_dir(100, tmp_path / "back") == [
            "global_step100/model.pt", "global_step100/optim.pt", "latest"
        ]
        _framework_dir(saved, 1)
        assert _contents(tmp_path / "back") == _contents(saved)
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "mine").write_bytes(b"keep")
        with pytest.raises(OSError):
            store.load_dir(100, tmp_path / "full")
        assert _contents(tmp_path / "full") == {"mine": b"keep"}
        os.symlink(saved / "latest", saved / "link")
        with pytest.raises(ValueError, match="not a regular file"):
            store.save_dir(102, saved)
        assert store.steps() == [100, 101]


def test_a_bucket_saves_a_directory_as_one_step(tmp_path):
    saved = tmp_path / "saved"
    _framework_dir(saved, 1)
    remote = ckptstore.Remote(f"file://{tmp_path}/bucket")
    first = remote.save_dir(5, saved)
    _framework_dir(saved, 2)
    second = remote.save_dir(6, saved)
    assert second.bytes_uploaded * 3 < first.bytes_uploaded, (first, second)
    assert remote.steps() == [5, 6]
    remote.load_dir(6, tmp_path / "back")
    assert _contents(tmp_path / "back") == _contents(saved)
