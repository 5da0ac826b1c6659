"""The Python package: `import ckptstore` (built by `pip install ./python`)."""

import os
import shutil
import threading
import time

import numpy as np
import pytest

import ckptstore


def test_save_and_load_keep_dtypes_shapes_and_values(tmp_path):
    state = {
        "w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
        "m": np.arange(10, dtype=np.float64)[::2],  # not contiguous
        "ids": np.array([1, -2, 3], dtype=np.int64),
        "mask": np.array([True, False]),
        "half": np.ones((2, 2), dtype=np.float16),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.int32),
        "rng": b"\x01\x02\x03",
        "raw": bytearray(b"xyz"),
    }
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        info = store.save(7, state, metrics={"loss": 0.25})
        assert info.step == 7 and info.bytes_written > 0
        ck = store.load()
        assert ck.step == 7 and ck.metrics == {"loss": 0.25}
        for name, want in state.items():
            got = ck.tensors[name]
            if isinstance(want, (bytes, bytearray)):
                assert got.dtype == np.uint8 and bytes(got) == bytes(want)
            else:
                assert got.dtype == want.dtype and got.shape == want.shape, name
                np.testing.assert_array_equal(got, want)
        assert store.load(8) is None
        assert len(store) == 1 and 7 in store and 8 not in store
        assert store[7].step == 7
        with pytest.raises(KeyError):
            store[8]


def test_steps_remove_gc_verify_stats(tmp_path):
    frozen = np.arange(1 << 18, dtype=np.float32)  # 1 MiB, unchanged every step
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        for step in range(6):
            info = store.save(step, {"frozen": frozen, "x": np.full(4, step, dtype=np.int64)})
            if step > 0:
                assert info.bytes_reused >= frozen.nbytes
        assert store.steps() == list(range(6)) and store.latest_step() == 5
        assert store.remove(0) and not store.remove(0)
        assert store.gc(keep_last=2) == [1, 2, 3]
        report = store.verify()
        assert report.ok and report.steps_ok == 2
        stats = store.stats()
        assert stats["steps"] == 2 and stats["dedup_ratio"] > 1.5


def test_errors_are_typed(tmp_path):
    path = tmp_path / "run.ckpt"
    with ckptstore.open(path) as store:
        store.save(1, {"a": np.zeros(2)})
        with pytest.raises(ckptstore.StepExistsError):
            store.save(1, {"a": np.zeros(2)})
        with pytest.raises(ckptstore.LockedError):
            ckptstore.open(path)
        assert issubclass(ckptstore.StepExistsError, ckptstore.Error)
        with pytest.raises(TypeError):
            store.save(2, [1, 2, 3])
        with pytest.raises(TypeError):
            store.save(2, {"o": np.array([object()])})
        with pytest.raises(TypeError):
            store.save(2, {3: np.zeros(1)})
    with pytest.raises(OSError):
        ckptstore.open(tmp_path / "no" / "such" / "dir" / "run.ckpt")


def test_async_saves_and_readers_beside_the_writer(tmp_path):
    path = tmp_path / "run.ckpt"
    store = ckptstore.open(path)
    handles = [store.save_async(s, {"w": np.full(1000, s, dtype=np.float32)}) for s in range(4)]
    assert handles[-1].result().step == 3
    store.flush()
    assert all(h.done() for h in handles)
    reader = ckptstore.open(path, read_only=True)
    assert reader.steps() == [0, 1, 2, 3]
    store.save(4, {"w": np.zeros(3)})
    assert ckptstore.open(path, read_only=True).latest_step() == 4
    failed = store.save_async(4, {"w": np.zeros(3)})
    with pytest.raises(ckptstore.StepExistsError):
        failed.result()
    # A failure result() delivered is not raised again by flush(); one
    # nobody observed is.
    store.flush()
    unobserved = store.save_async(4, {"w": np.zeros(3)})
    del unobserved
    with pytest.raises(ckptstore.Error):
        store.flush()
    store.flush()
    with pytest.raises(ckptstore.Error):
        reader.save(9, {"w": np.zeros(1)})
    store.close()


def test_the_gil_is_released_while_saving(tmp_path):
    big = np.random.default_rng(0).standard_normal(16 << 20).astype(np.float32)  # 64 MiB
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    with ckptstore.open(tmp_path / "run.ckpt") as store:
        t = threading.Thread(target=count)
        t.start()
        time.sleep(0.01)
        before = len(ticks)
        start = time.perf_counter()
        store.save(1, {"big": big})
        took = time.perf_counter() - start
        during = len(ticks) - before
        stop.set()
        t.join()
    # The other thread ran while the save hashed and wrote.
    assert took > 0.02 and during >= 5, (took, during)


def test_a_step_saved_from_python_exports_to_safetensors(tmp_path):
    ckpt_bin = os.environ.get("CKPT_BIN")
    if ckpt_bin is None:
        pytest.skip("CKPT_BIN not set")
    import subprocess

    from safetensors.numpy import load_file

    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        store.save(3, {"w": w})
    out = tmp_path / "s.safetensors"
    subprocess.run([ckpt_bin, "export", str(tmp_path / "run.ckpt"), "3", "-o", str(out)], check=True)
    np.testing.assert_array_equal(load_file(str(out))["w"], w)


def test_loaded_arrays_view_the_bytes_the_store_read(tmp_path):
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        store.save(1, {"w": np.arange(1 << 16, dtype=np.float32).reshape(256, 256),
                       "e": np.zeros((0, 3), dtype=np.int32), "b": b"xy"})
        ck = store.load()
    for name in ("w", "e", "b"):
        base = ck.tensors[name]
        while isinstance(base.base, np.ndarray):
            base = base.base
        assert type(base.base).__name__ == "Buffer", name  # no copy made in Python
    w = ck.tensors["w"]
    assert w.flags.writeable and w.flags.aligned
    w[0, 0] = 7.0  # the array owns its bytes
    assert w[0, 0] == 7.0 and w[255, 255] == (1 << 16) - 1
    assert ck.tensors["e"].shape == (0, 3) and bytes(ck.tensors["b"]) == b"xy"


# Peak memory of a 256 MiB save and load in a fresh process: a copy of the
# array during the save, or a second copy during the load, would show.
MEMORY_SCRIPT = """
import os, resource, sys, numpy as np, ckptstore
a = np.frombuffer(os.urandom(256 << 20), dtype=np.uint8)
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
before = peak()
with ckptstore.open(sys.argv[1], pack_files=sys.argv[2] == "1") as s:
    s.save(1, {"a": a})
    mid = peak()
    ck = s.load()
    assert ck.tensors["a"].nbytes == a.nbytes
print(mid - before, peak() - mid)
"""


@pytest.mark.parametrize("pack_files", [False, True])
def test_save_reads_arrays_in_place_and_load_copies_once(tmp_path, pack_files):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "m.ckpt"), str(int(pack_files))],
                         check=True, capture_output=True, text=True).stdout
    save_mib, load_mib = map(int, out.split())
    assert save_mib < 128, f"the save grew the peak by {save_mib} MiB for a 256 MiB array"
    assert load_mib < 384, f"the load grew the peak by {load_mib} MiB for a 256 MiB array"
    if pack_files:
        # Chunks go from the array to the pack file and back into the
        # result: no page buffers (measured: 4 MiB and 256 MiB).
        assert save_mib < 32 and load_mib < 256 + 32, (save_mib, load_mib)


def test_save_async_snapshots_the_arrays(tmp_path):
    a = np.arange(1 << 18, dtype=np.float64)
    want = a.copy()
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        h = store.save_async(1, {"a": a})
        a += 1.0  # after the call: never in the checkpoint
        assert h.result().step == 1
        np.testing.assert_array_equal(store.load(1).tensors["a"], want)


def test_a_handled_background_failure_does_not_fail_the_with_block(tmp_path):
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        store.save(1, {"w": np.zeros(3)})
        handle = store.save_async(1, {"w": np.ones(3)})
        with pytest.raises(ckptstore.StepExistsError):
            handle.result()
    # Leaving the block closed the store without raising it again.
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        np.testing.assert_array_equal(store.load(1).tensors["w"], np.zeros(3))


def test_load_into_fills_matching_arrays_in_place(tmp_path):
    w = np.arange(3 << 18, dtype=np.float32).reshape(3, 1 << 18)  # 3 MiB: chunks
    with ckptstore.open(tmp_path / "run.ckpt", threads=3) as store:
        store.save(1, {"w": w, "b": np.ones(4, np.int64), "s": np.zeros(2, np.float16), "blob": b"xyz"})
        into_w = np.zeros_like(w)
        other_shape = np.zeros(5, np.int64)
        read_only = np.zeros(2, np.float16)
        read_only.flags.writeable = False
        ck = store.load(1, into={"w": into_w, "b": other_shape, "s": read_only, "absent": np.zeros(1)})
        assert ck.tensors["w"] is into_w and np.array_equal(into_w, w)
        # Not filled (another shape, read-only): loaded as usual, untouched.
        assert ck.tensors["b"] is not other_shape and ck.tensors["b"].tolist() == [1] * 4
        assert not other_shape.any() and ck.tensors["s"] is not read_only
        assert bytes(ck.tensors["blob"]) == b"xyz" and "absent" not in ck.tensors
        # A Tensor over a uint8 array, for dtypes numpy lacks.
        raw = np.zeros(32, np.uint8)
        ck = store.load(into={"b": ckptstore.Tensor("I64", [4], raw)})
        assert ck.tensors["b"] is raw and raw.view(np.int64).tolist() == [1] * 4
        # Two arrays over the same memory are refused.
        both = np.zeros(8, np.int64)
        with pytest.raises(ValueError, match="share memory"):
            store.load(1, into={"b": both[:4], "w2": both[2:6]})
        assert store.load(9, into={"w": into_w}) is None


def test_pack_files_hold_large_saves_and_damage_is_caught(tmp_path):
    path = tmp_path / "run.ckpt"
    big = np.arange(2 << 20, dtype=np.float32)  # 8 MiB: above the 4 MiB threshold
    with ckptstore.open(path, pack_files=True) as store:
        store.save(1, {"w": big, "small": np.zeros(3)})
        store.save(2, {"w": big + 1})
        stats = store.stats()
        # Each file: a 32-byte header naming the store, then the chunks.
        assert stats["pack_files"] == 2 and stats["pack_bytes"] == 2 * (big.nbytes + 32)
        assert os.path.getsize(path) < big.nbytes  # the chunks are not in the redb file
        out = np.empty_like(big)
        store.load(2, into={"w": out})
        assert np.array_equal(out, big + 1)
    packs = sorted(os.listdir(f"{path}.packs"))
    assert packs == ["00000000.pack", "00000001.pack"]
    # Read without the option; a flipped byte fails the load of its step only.
    with open(os.path.join(f"{path}.packs", packs[1]), "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 1]))
    with ckptstore.open(path, read_only=True) as store:
        assert np.array_equal(store.load(1).tensors["w"], big)
        with pytest.raises(ckptstore.CorruptError, match="00000001.pack"):
            store.load(2)
        report = store.verify()
        assert not report.ok and report.damaged == [2]


def test_copy_to_takes_the_pack_files_with_the_store(tmp_path):
    path, copy = tmp_path / "run.ckpt", tmp_path / "copy.ckpt"
    big = np.arange(2 << 20, dtype=np.float32)  # 8 MiB: in a pack file
    with ckptstore.open(path) as store:
        store.save(1, {"w": big}, metrics={"loss": 0.5})
        store.save(2, {"w": big + 1, "small": np.zeros(3)})
        assert store.copy_to(copy) == [1, 2]
        with pytest.raises(OSError, match="copy.ckpt"):
            store.copy_to(copy)  # never over an existing store
    with ckptstore.open(copy, read_only=True) as backup:
        assert backup.stats()["pack_files"] >= 2
        ck = backup.load(1)
        assert np.array_equal(ck.tensors["w"], big) and ck.metrics == {"loss": 0.5}
        assert np.array_equal(backup.load(2).tensors["w"], big + 1)
        assert backup.verify().ok
    # The store file copied alone names the directory it lacks.
    shutil.copy(path, tmp_path / "alone.ckpt")
    with ckptstore.open(tmp_path / "alone.ckpt", read_only=True) as alone:
        with pytest.raises(ckptstore.CorruptError, match=r"alone\.ckpt\.packs.*ckpt cp"):
            alone.load(1)
    # remove_store takes the pack files with the store, and only a store.
    with ckptstore.open(copy):
        with pytest.raises(ckptstore.LockedError):
            ckptstore.remove_store(copy)
    assert ckptstore.remove_store(copy) and not ckptstore.remove_store(copy)
    assert sorted(os.listdir(tmp_path)) == ["alone.ckpt", "run.ckpt", "run.ckpt.packs"]


def test_get_blob_reads_one_blob_of_a_step(tmp_path):
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        big = bytes(range(256)) * 1024  # chunked
        store.save(3, {"w": np.ones((4, 4), np.float32), "meta": b"{}", "big": big})
        assert store.get_blob(3, "meta") == b"{}"
        assert store.get_blob(3, "big") == big
        assert store.get_blob(3, "nope") is None and store.get_blob(4, "meta") is None


def test_read_ranges_reads_bytes_of_entries_into_arrays(tmp_path):
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        w = np.arange(3 << 20, dtype=np.uint8)  # three chunks and more
        store.save(3, {"w": w, "meta": b"0123456789"})
        digest = store.content_digest(3)
        a, b = np.zeros(1 << 20, np.uint8), np.zeros(4, np.uint8)
        assert store.read_ranges(3, [("w", 1_000_000, a), ("meta", 3, b)], digest=digest)
        assert np.array_equal(a, w[1_000_000 : 1_000_000 + (1 << 20)]) and b.tobytes() == b"3456"
        # Another save of the step, or none: nothing filled.
        assert not store.read_ranges(3, [("w", 0, b)], digest="0" * 64) and b.tobytes() == b"3456"
        assert not store.read_ranges(4, [("w", 0, b)])
        for reads in ([("w", (3 << 20) - 2, b)], [("nope", 0, b)]):
            with pytest.raises(ValueError, match="step 3"):
                store.read_ranges(3, reads)
        with pytest.raises(ValueError, match="read-only"):
            store.read_ranges(3, [("w", 0, np.frombuffer(b"abcd", np.uint8))])


def test_a_save_record_is_a_typed_attribute_of_the_step(tmp_path):
    record = ckptstore.SaveRecord(staging_seconds=0.5, blocked_seconds=0.25, names=["lightning:b", "lightning:a"])
    assert (record.staging_seconds, record.blocked_seconds) == (0.5, 0.25)
    assert record.names == ["lightning:a", "lightning:b"] and record
    assert not ckptstore.SaveRecord() and ckptstore.SaveRecord(names=["x"]).staging_seconds is None
    for bad in [dict(staging_seconds=1.0), dict(staging_seconds=-1.0, blocked_seconds=0.0),
                dict(staging_seconds=float("nan"), blocked_seconds=0.0)]:
        with pytest.raises(ValueError):
            ckptstore.SaveRecord(**bad)
    with ckptstore.open(tmp_path / "s.ckpt") as s:
        s.save(1, {"w": np.ones(4)}, {"loss": 1.0}, record=record)
        s.save_async(2, {"w": np.ones(4)}, record=ckptstore.SaveRecord(names=["n"])).result()
        s.save(3, {"w": np.ones(4)})
        assert s.info(1).save_record == record and s.info(1).metrics == {"loss": 1.0}
        assert s.info(2).save_record.names == ["n"]
        assert not s.info(3).save_record
    remote = ckptstore.Remote(f"file://{tmp_path}/bucket")
    shard = remote.upload_shard(4, 0, 1, {"w": np.ones(4)}, record=record)
    remote.commit_global(4, [shard.shard])
    assert remote.info(4).save_record == record
