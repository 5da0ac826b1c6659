"""The staging arena of a device's tensors (issue 54), on CPU: its
carving, reuse and hashing are device-neutral, so these tests stage host
tensors through it (`_arena.DEVICES` made to include "cpu"); the CUDA
lines (pinning, the side stream, events) run in scripts/gpu-check.sh."""

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore import _arena, _staging
from ckptstore.dcp import _writer as _dcp_write
from ckptstore._ckptstore import ChunkHasher, copy_hashed
from ckptstore.dcp import StagingBudgetError, StorageReader, StorageWriter


@pytest.fixture(autouse=True)
def host_as_device(monkeypatch):
    monkeypatch.setattr(_arena, "DEVICES", ("cpu",))
    # Pieces of one chunk: a tensor of a few MiB is copied and hashed in
    # several.
    monkeypatch.setattr(_arena, "PIECE", ChunkHasher.PIECE_ALIGN)


def model(salt=0.0):
    flat = torch.arange(3_000_000, dtype=torch.float32) + salt  # 12 MB: a dozen pieces
    return {
        "w": flat[: 2_000_000].view(1000, 2000),
        "w.T": flat[: 2_000_000].view(1000, 2000).t(),  # the same storage, strided
        "bias": flat[2_000_000 : 2_000_100],
        "emb": torch.full((300, 7), salt, dtype=torch.bfloat16),
        "step": torch.tensor(5),
        "extra": {"epoch": 3},
    }


def test_views_of_one_storage_share_one_copy_and_stage_their_values():
    live = model(1.0)
    out = _staging.staged(live)
    for k in ("w", "w.T", "bias", "emb", "step"):
        assert torch.equal(out.state[k], live[k]), k
        assert out.state[k].stride() == live[k].stride()
    assert out.state["extra"] == {"epoch": 3}
    w, wt, bias = out.state["w"], out.state["w.T"], out.state["bias"]
    assert w.untyped_storage().data_ptr() == wt.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()
    assert w.data_ptr() == wt.data_ptr() and bias.data_ptr() == w.data_ptr() + 2_000_000 * 4
    # The copy is a copy: the state changes, it does not.
    live["w"].add_(7)
    assert torch.equal(out.state["w"], model(1.0)["w"])


def test_an_arena_holds_each_storage_span_on_a_page_and_no_more():
    live = model()
    layout = _arena.Layout.of([_staging._local(v) for k, v in live.items() if k != "extra"])
    page = _arena.PAGE
    assert [n for _, n in layout.spans] == [2_000_100 * 4, 300 * 7 * 2, 8]
    assert all(o % page == 0 for o in layout.offsets)
    assert layout.nbytes == sum(-(-n // page) * page for _, n in layout.spans)
    arena = _arena.Arena(layout, torch.device("cpu"), False, None)
    assert arena.memory.data_ptr() % page == 0 and arena.memory.numel() == layout.nbytes


def test_the_staged_hashes_are_those_of_the_staged_bytes():
    live = model(2.0)
    out = _staging.staged(live)
    for k in ("w", "bias", "emb"):
        t = out.state[k]
        want = copy_hashed([_staging._bytes(t)], [_staging._bytes(torch.empty_like(t))])[0]
        assert out.hashes_of(t) == want, k
    assert out.hashes_of(out.state["w.T"]) is None  # strided: the save hashes it


def test_the_next_save_of_the_layout_reuses_the_arena_and_a_save_in_flight_keeps_its_own():
    pool = _staging.Pool()
    first = pool.stage("k", model(1.0))
    ptr = first.state["w"].data_ptr()
    pool.give_back("k", first.state)
    again = pool.stage("k", model(2.0))
    assert again.state["w"].data_ptr() == ptr and torch.equal(again.state["w"], model(2.0)["w"])
    # `again` is lent (a save still writing it): the next stages elsewhere,
    # and `again` keeps its bytes.
    third = pool.stage("k", model(3.0))
    assert third.state["w"].data_ptr() != ptr
    assert torch.equal(again.state["w"], model(2.0)["w"])
    pool.give_back("k", again.state)
    # A new layout: a new arena.
    other = model(4.0)
    other["emb"] = torch.zeros(301, 7, dtype=torch.bfloat16)
    grown = pool.stage("k", other)
    assert grown.state["w"].data_ptr() != ptr and torch.equal(grown.state["emb"], other["emb"])


def test_shared_memory_arenas_are_shared():
    out = _staging.Pool().stage("k", model(), shared=True)
    assert out.state["w"].is_shared() and out.state["emb"].is_shared()


@pytest.mark.parametrize("shared", [False, True])
def test_a_state_of_empty_tensors_stages(shared):
    live = {"a": torch.empty(0), "b": torch.empty(3, 0, dtype=torch.bfloat16)}
    out = _staging.Pool().stage("k", live, shared=shared)
    assert out.state["a"].shape == (0,) and out.state["b"].shape == (3, 0) and out.state["b"].dtype == torch.bfloat16


def test_a_state_over_the_budget_is_refused_before_anything_is_allocated(monkeypatch):
    made = []
    monkeypatch.setattr(_arena, "_page_aligned", lambda n, shared: made.append(n))
    with pytest.raises(StagingBudgetError, match=r"takes \d+ bytes of host memory, over the budget of 1000000"):
        _staging.Pool().stage("k", model(), budget=1_000_000)
    monkeypatch.setattr(_arena, "available_bytes", lambda: 4096)
    with pytest.raises(StagingBudgetError, match="the host has 4096 available"):
        _staging.Pool().stage("k", model())
    assert made == []


def test_a_smaller_budget_is_checked_when_an_arena_is_reused():
    # Issue 65: the arena of an earlier save, of the same layout, was reused
    # under a budget it exceeds.
    pool = _staging.Pool()
    first = pool.stage("k", model())
    pool.give_back("k", first.state)
    with pytest.raises(StagingBudgetError, match="over the budget of 1000000"):
        pool.stage("k", model(), budget=1_000_000)
    # The copy stays in the pool: a save within the budget reuses it.
    again = pool.stage("k", model(2.0), budget=100_000_000)
    assert torch.equal(again.state["w"], model(2.0)["w"])
    assert again.state["w"].data_ptr() == first.state["w"].data_ptr()


def test_hashing_waits_for_each_piece_and_not_for_the_rest(monkeypatch):
    # The hashes of a piece are taken once its copy has landed, before the
    # later pieces' (the copy's events, in order).
    order = []
    real = _arena.Copy._wait

    def spy(self, end):
        order.append(("wait", end))
        return real(self, end)

    class Hasher:
        def __init__(self, n):
            self._h = ChunkHasher(n)

        def update(self, piece):
            order.append(("hash", piece.size))
            self._h.update(piece)

        def finish(self):
            return self._h.finish()

    monkeypatch.setattr(_arena.Copy, "_wait", spy)
    monkeypatch.setattr(_arena, "ChunkHasher", Hasher)
    _staging.staged({"x": torch.ones(3 * ChunkHasher.PIECE_ALIGN // 4)})
    piece = ChunkHasher.PIECE_ALIGN
    assert order[:6] == [("wait", piece), ("hash", piece), ("wait", 2 * piece), ("hash", piece), ("wait", 3 * piece), ("hash", piece)]


def test_an_async_save_through_the_arena_saves_the_state_at_the_call_and_loads_bit_identical(tmp_path, monkeypatch):
    used = []
    real = _dcp_write.hashes_of
    monkeypatch.setattr(_dcp_write, "hashes_of", lambda known, t: used.append(real(known, t) is not None) or real(known, t))
    url = f"file://{tmp_path}/bucket"
    live = model(1.0)
    del live["w.T"]  # DCP saves each storage's tensors apart
    response = dcp.async_save(live, storage_writer=StorageWriter(url, 1, background_staging=True), no_dist=True)
    response.staging_completion.result(timeout=60)
    live["w"].add_(1000)
    live["emb"].mul_(-2)
    response.upload_completion.result(timeout=60)
    assert used == [True] * 4, used  # the save wrote the hashes the staging took
    back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in model().items() if k != "w.T"}
    back["extra"] = {"epoch": 0}
    dcp.load(back, storage_reader=StorageReader(url, 1), no_dist=True)
    want = model(1.0)
    for k in ("w", "bias", "emb", "step"):
        assert torch.equal(back[k], want[k]), k
    assert back["extra"] == {"epoch": 3}


def test_block_on_staging_returns_with_the_copy_made(tmp_path, monkeypatch):
    gate = threading.Event()
    real = _arena.Copy.finish

    def held(self):
        assert gate.wait(30)
        return real(self)

    monkeypatch.setattr(_arena.Copy, "finish", held)
    url = f"file://{tmp_path}/bucket"
    threading.Timer(0.5, gate.set).start()
    writer = StorageWriter(url, 1, background_staging=True, block_on_staging=True)
    response = dcp.async_save({"x": torch.ones(1000)}, storage_writer=writer, no_dist=True)
    assert response.staging_completion.done() and gate.is_set()
    response.upload_completion.result(timeout=60)
    assert writer.cost.blocked_seconds == writer.cost.staging_seconds >= 0.4


def test_lightnings_async_save_stages_through_the_arena(tmp_path):
    import ckptstore.lightning as cl
    from test_lightning import _checkpoint

    io = cl.CheckpointIO(tmp_path / "run.ckpt", asynchronous=True)
    w = torch.randn(256, 1024)
    want = w.clone()
    io.save_checkpoint(_checkpoint(3, "last", w), tmp_path / "last.ckpt")
    w.add_(1)  # after the call: not in step 3
    assert torch.equal(io.load_checkpoint(tmp_path / "last.ckpt")["state_dict"]["w"], want)  # waits
    # The copy, given back with its arena, held the tensors in it.
    ((copy, arena),) = io._pool._free.values()
    staged = [t for t in copy.values() if t.numel() > 0]
    start, end = arena.memory.data_ptr(), arena.memory.data_ptr() + arena.memory.numel()
    assert staged and all(start <= t.data_ptr() < end for t in staged)
    # The next save of the same layout stages into the same arena.
    io.save_checkpoint(_checkpoint(4, "last", w), tmp_path / "last.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "last.ckpt")["state_dict"]["w"], w)
    ((_, again),) = io._pool._free.values()
    assert again is arena
    io.teardown()
