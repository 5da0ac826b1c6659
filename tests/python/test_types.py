"""The typed boundary: frozen result classes from the compiled core, and
Tensor inputs for dtypes numpy lacks."""

import numpy as np
import pytest

import ckptstore


def test_results_are_frozen_and_read_by_name_or_key(tmp_path):
    with ckptstore.open(tmp_path / "s.ckpt") as store:
        info = store.save(1, {"w": np.ones(4, dtype=np.float32)})
        assert isinstance(info, ckptstore.CommitInfo)
        assert info.step == info["step"] == 1
        assert info.logical_bytes == 16
        with pytest.raises(AttributeError):
            info.step = 2
        with pytest.raises(KeyError):
            info["nope"]
        assert "CommitInfo(step=1" in repr(info)
        report = store.verify()
        assert isinstance(report, ckptstore.VerifyReport) and report.ok
        assert store.stats().steps == 1


def test_a_tensor_given_by_its_bytes_keeps_its_dtype(tmp_path):
    raw = np.arange(8, dtype=np.uint8)
    with ckptstore.open(tmp_path / "s.ckpt") as store:
        store.save(1, {"h": ckptstore.Tensor("BF16", [2, 2], raw)})
        store.save(2, {"f8": ckptstore.Tensor("F8_E4M3", [8], raw)})
        h = store.load(1).tensors["h"]
        # bfloat16 is numpy's only with ml_dtypes; the bytes are kept either way.
        assert h.tobytes() == raw.tobytes()
        assert store.load(2).tensors["f8"].tobytes() == raw.tobytes()


def test_a_tensor_with_a_bad_dtype_or_size_is_refused(tmp_path):
    with pytest.raises(TypeError, match="unknown dtype"):
        ckptstore.Tensor("F128", [1], np.zeros(16, dtype=np.uint8))
    with ckptstore.open(tmp_path / "s.ckpt") as store:
        with pytest.raises(ValueError, match='"h".*needs 6 bytes'):
            store.save(1, {"h": ckptstore.Tensor("BF16", [3], np.zeros(4, dtype=np.uint8))})
        assert store.steps() == []
