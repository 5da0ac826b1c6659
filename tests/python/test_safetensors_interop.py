"""ckpt's safetensors files against the real Python safetensors library.

Run by .ci/run with CKPT_BIN pointing at the ckpt binary:
    CKPT_BIN=target/debug/ckpt python -m pytest tests/python
"""

import json
import os
import struct
import subprocess

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

CKPT = os.environ.get("CKPT_BIN", "target/debug/ckpt")


def ckpt(*args):
    done = subprocess.run([CKPT, *map(str, args)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def raw_tensors(path):
    """name -> (dtype, shape, bytes), read by hand (for dtypes numpy lacks)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], body[start:end])
    return out


def test_a_step_exported_by_ckpt_loads_in_python(tmp_path):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    ids = np.arange(5, dtype=np.int64)
    bf16 = bytes(range(12))  # 6 BF16 elements, numpy has no BF16
    fp8 = bytes([1, 2, 3, 4])
    # A checkpoint in the JSON format, tensors included, imported by ckpt.
    checkpoint = {
        "graph": {"nodes": {}, "edges": []},
        "step": 12,
        "loss_cid": "cid_loss",
        "optimizer_state": {"rng": [9, 8, 7]},
        "timestamp": 1700000000,
        "metrics": {"loss": 0.125},
        "tensors": {
            "w": {"dtype": "F32", "shape": [3, 4], "data": list(w.tobytes())},
            "ids": {"dtype": "I64", "shape": [5], "data": list(ids.tobytes())},
            "h": {"dtype": "BF16", "shape": [2, 3], "data": list(bf16)},
            "q": {"dtype": "F8_E4M3", "shape": [4], "data": list(fp8)},
        },
    }
    src = tmp_path / "step12.json"
    src.write_text(json.dumps(checkpoint))
    store = tmp_path / "run.ckpt"
    ckpt("import", store, src)
    out = tmp_path / "step12.safetensors"
    ckpt("export", store, 12, "-o", out)

    with safe_open(str(out), framework="numpy") as f:
        meta = f.metadata()
        names = set(f.keys())
    assert names == {"w", "ids", "h", "q", "rng"}
    assert meta["ckptstore.step"] == "12"
    assert json.loads(meta["ckptstore.metrics"]) == {"loss": 0.125}
    assert json.loads(meta["ckptstore.blobs"]) == ["rng"]

    raw = raw_tensors(out)
    assert raw["h"] == ("BF16", [2, 3], bf16)
    assert raw["q"] == ("F8_E4M3", [4], fp8)
    assert raw["rng"] == ("U8", [3], bytes([9, 8, 7]))
    assert raw["w"][0] == "F32" and raw["w"][1] == [3, 4]
    np.testing.assert_array_equal(np.frombuffer(raw["w"][2], dtype="<f4").reshape(3, 4), w)
    np.testing.assert_array_equal(np.frombuffer(raw["ids"][2], dtype="<i8"), ids)


def test_a_file_python_wrote_goes_through_ckpt_unchanged(tmp_path):
    tensors = {
        "f32": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
        "f64": np.array([1.0 / 3.0, -0.0, 1e300]),
        "f16": np.arange(6, dtype=np.float16).reshape(2, 3),
        "i8": np.array([-128, 0, 127], dtype=np.int8),
        "u16": np.array([1, 65535], dtype=np.uint16),
        "b": np.array([True, False, True]),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.int32),
    }
    src = tmp_path / "python.safetensors"
    save_file(tensors, str(src), metadata={"source": "numpy"})
    store = tmp_path / "run.ckpt"
    ckpt("import", store, src, "--step", 3)
    show = ckpt("show", store, 3)
    assert "F16" in show and "[0, 3]" in show
    back = tmp_path / "back.safetensors"
    ckpt("export", store, 3, "-o", back)
    loaded = load_file(str(back))
    assert set(loaded) == set(tensors)
    for name, want in tensors.items():
        got = loaded[name]
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)


def test_an_empty_file_imports(tmp_path):
    src = tmp_path / "empty.safetensors"
    save_file({}, str(src))
    store = tmp_path / "run.ckpt"
    ckpt("import", store, src, "--step", 0)
    assert "1 steps" in ckpt("ls", store)
