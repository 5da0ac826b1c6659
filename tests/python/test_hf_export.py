"""Hugging Face export (issue 42): a tiny GPT-2 trained and saved under DCP
at 2 ranks (real processes, gloo) is exported as shards with an index,
through ckptstore.dcp.export_hf and `ckpt export --hf`, and loaded by
transformers' from_pretrained with the same logits; a local store's DCP
step exports too; a kill at any moment of an export never leaves an index
naming a shard that is not whole."""

import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
import safetensors.numpy
import torch

import ckptstore
import ckptstore.dcp
import forked

WORKER = pathlib.Path(__file__).parent / "hf" / "gpt2_worker.py"


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_and_save(url, out):
    port = str(_port())
    procs = [forked.start(WORKER, [url, r, 2, port, out], os.environ) for r in range(2)]
    for r, p in enumerate(procs):
        text, _ = p.communicate(timeout=300)
        done = "saved" in text.splitlines()
        assert p.returncode == 0 or done, f"rank {r}:\n{text[-3000:]}"


def _shards(directory):
    """Tensors by name from the shards an index names (or model.safetensors)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for f in files:
        tensors.update(safetensors.numpy.load_file(str(directory / f)))
    return tensors


def test_a_gpt2_saved_at_2_ranks_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    url = f"file://{tmp_path}/bucket"
    out = tmp_path / "hf"
    out.mkdir()
    _train_and_save(url, out)
    written = ckptstore.dcp.export_hf(url, None, out, max_shard_size="60KB")
    assert len(written.shards) >= 3, written.shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = _shards(out)
    assert index["weight_map"] == written.weight_map
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for f in written.shards:
        assert (out / f).stat().st_size <= 60_000 + 4096 or len(safetensors.numpy.load_file(str(out / f))) == 1
    model = AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    with torch.no_grad():
        logits = model(torch.arange(16).reshape(1, 16)).logits
    assert torch.equal(logits, torch.load(out / "logits.pt"))

    # The CLI writes the same bytes; a bf16 cast halves the floats.
    cli = tmp_path / "cli"
    ckpt = os.environ.get("CKPT_BIN", "ckpt")
    subprocess.run([ckpt, "export", url, "latest", "--hf", "-o", str(cli), "--max-shard-size", "60KB"], check=True)
    for f in written.shards:
        assert (cli / f).read_bytes() == (out / f).read_bytes(), f
    half = ckptstore.dcp.export_hf(url, 3, tmp_path / "bf16", dtype=torch.bfloat16)
    assert half.shards == ["model.safetensors"]
    assert half.total_size * 2 == written.total_size
    assert not (tmp_path / "bf16" / "model.safetensors.index.json").exists()


def test_a_local_store_dcp_step_exports_whole(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model.w": torch.arange(12, dtype=torch.float32).reshape(4, 3), "model.b": torch.ones(3)}
    path = tmp_path / "run.ckpt"
    dcp.save(state, storage_writer=ckptstore.dcp.StorageWriter(str(path), step=5))
    written = ckptstore.dcp.export_hf(str(path), 5, tmp_path / "hf", prefix="model.")
    assert written.shards == ["model.safetensors"]
    got = _shards(tmp_path / "hf")
    assert sorted(got) == ["b", "w"]
    assert np.array_equal(got["w"], state["model.w"].numpy())
    with pytest.raises(ValueError, match="max_shard_size"):
        ckptstore.dcp.export_hf(str(path), 5, tmp_path / "x", max_shard_size="5 parsecs")


def test_a_killed_export_never_leaves_an_index_naming_a_partial_shard(tmp_path):
    store_path = tmp_path / "big.ckpt"
    rng = np.random.default_rng(0)
    state = {f"t{i:02d}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(24)}
    with ckptstore.open(store_path) as store:
        store.save(1, state)
    ckpt = os.environ.get("CKPT_BIN", "ckpt")
    out = tmp_path / "hf"
    # Exports alternate between f32 and casts to f16 at half the shard
    # size: the same 12 shard names, other bytes, so an index left naming
    # shards another export overwrote would show as a mix. Each kind is
    # timed whole first; kills land anywhere in that time.
    kinds = [["--max-shard-size", "9MB"], ["--max-shard-size", "4500KB", "--dtype", "f16"]]
    took = []
    for kind in kinds:
        start = time.monotonic()
        subprocess.run([ckpt, "export", str(store_path), "1", "--hf", "-o", str(out), *kind], check=True)
        took.append(time.monotonic() - start)
    halves = {name: t.astype(np.float16) for name, t in state.items()}
    random.seed(7)
    kills = 0
    for attempt in range(16):
        kind = attempt % 2
        p = subprocess.Popen(
            [ckpt, "export", str(store_path), "1", "--hf", "-o", str(out), *kinds[kind]],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(random.uniform(0.0, took[kind]))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
        index = out / "model.safetensors.index.json"
        if index.exists():
            names = json.loads(index.read_text())["weight_map"]
            got = _shards(out)
            assert set(got) == set(names) == set(state), attempt
            want = halves if got["t00"].dtype == np.float16 else state
            for name, t in want.items():
                assert got[name].dtype == t.dtype and np.array_equal(got[name], t), (attempt, name)
    assert kills > 0, "no export was killed part way"
