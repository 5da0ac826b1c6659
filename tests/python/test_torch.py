"""`ckptstore.torch`: state_dicts round-trip exactly, training resumes
bit-identically, non-blocking saves snapshot, frozen tensors are stored once."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (.ci/run installs it)")

import ckptstore  # noqa: E402
import ckptstore.torch as ct  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.float16,
    torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.complex64,
    torch.float64, torch.int64, torch.uint64, torch.complex128, torch.complex32,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
]


def raw(t):
    """A tensor's bytes, whatever its dtype (compared bit for bit)."""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def random_of(dtype, shape, gen):
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        bits = bits % 2
    return bits.view(dtype).reshape(shape)


class AllDtypes(torch.nn.Module):
    def __init__(self, gen=None):
        super().__init__()
        for i, dtype in enumerate(DTYPES):
            shape = [(3, 4), (), (0, 5), (2, 1, 3)][i % 4]
            value = random_of(dtype, shape, gen) if gen else torch.zeros(shape, dtype=dtype)
            self.register_buffer(f"b{i}", value)


def test_every_dtype_round_trips_bit_for_bit(tmp_path):
    source = AllDtypes(torch.Generator().manual_seed(1))
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        ct.save(store, 3, model=source)
        target = AllDtypes()
        assert ct.load(store, model=target) == 3
    for (name, want), got in zip(source.state_dict().items(), target.state_dict().values()):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert raw(got) == raw(want), name


def make(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    return model, opt


def train_step(model, opt, step):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=gen)
    y = torch.randn(8, 4, generator=gen)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def test_resume_is_bit_identical(tmp_path):
    model, opt = make(0)
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        for step in range(5):
            loss = train_step(model, opt, step)
        ct.save(store, 4, model=model, optimizer=opt, metrics={"loss": loss}, extra={"epoch": 3})
        for step in range(5, 8):
            train_step(model, opt, step)
        uninterrupted = [p.detach().clone() for p in model.parameters()]

        resumed, resumed_opt = make(99)  # other weights, fresh optimizer state
        assert ct.load(store, model=resumed, optimizer=resumed_opt) == 4
        assert ct.load_extra(store) == {"epoch": 3}
        assert store.load().metrics == {"loss": loss}
    for step in range(5, 8):
        train_step(resumed, resumed_opt, step)
    for want, got in zip(uninterrupted, resumed.parameters()):
        assert torch.equal(want, got.detach())
    assert resumed_opt.param_groups[0]["betas"] == (0.8, 0.95)


def test_bf16_and_f16_models_resume_bit_identically(tmp_path):
    for dtype in (torch.bfloat16, torch.float16):
        model, opt = make(0)
        model.to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(4, 16, generator=gen).to(dtype)

        def step(m, o):
            o.zero_grad()
            m(x).float().square().mean().backward()
            o.step()

        step(model, opt)
        with ckptstore.open(tmp_path / f"{dtype}.ckpt") as store:
            ct.save(store, 1, model=model, optimizer=opt)
            step(model, opt)
            other, _ = make(7)
            other.to(dtype)
            other_opt = torch.optim.SGD(other.parameters(), lr=1e-2, momentum=0.9)
            ct.load(store, model=other, optimizer=other_opt, step=1)
        step(other, other_opt)
        for a, b in zip(model.parameters(), other.parameters()):
            assert a.dtype == dtype and raw(a) == raw(b)


def test_non_blocking_save_takes_its_snapshot_before_returning(tmp_path):
    model, opt = make(0)
    train_step(model, opt, 0)
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        handle = ct.save(store, 1, model=model, optimizer=opt, blocking=False)
        # In-place changes right after the call never reach the checkpoint.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        train_step(model, opt, 1)
        info = handle.result()
        assert info.step == 1 and handle.done()
        fresh, fresh_opt = make(3)
        ct.load(store, model=fresh, optimizer=fresh_opt)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at_call[k]), k
    for k, v in fresh_opt.state_dict()["state"][0].items():
        assert torch.equal(v, moments[k]), k


def test_a_frozen_part_is_stored_once(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 8))
    model[0].weight.requires_grad_(False)  # 4 MiB, frozen
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    frozen = model[0].weight.numel() * 4
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        first = ct.save(store, 1, model=model, optimizer=opt)
        assert first.bytes_written >= frozen
        for step in range(2, 5):
            opt.zero_grad()
            model(torch.tensor([[1, 2, 3]])).sum().backward()
            opt.step()
            info = ct.save(store, step, model=model, optimizer=opt)
            assert info.bytes_reused >= frozen, info
            assert info.bytes_written < frozen // 10, info
        assert store.verify().ok


def test_structure_and_errors(tmp_path):
    model, opt = make(0)
    rng = torch.get_rng_state()
    extra = {"epoch": 3, "rng": rng, "pair": (1, 2.5), "ids": {7: "seven"}, "none": None,
             "dtype": torch.bfloat16, "inf": float("inf")}
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        assert ct.load(store, model=model) is None  # empty store
        ct.save(store, 1, model=model, extra=extra)
        back = ct.load_extra(store, 1)
        assert torch.equal(back.pop("rng"), rng)
        extra.pop("rng")
        assert back == extra
        with pytest.raises(KeyError):
            ct.load(store, model=model, step=2)
        with pytest.raises(KeyError):
            ct.load(store, optimizer=opt, step=1)  # saved without one
        with pytest.raises(TypeError):
            ct.save(store, 2, model=model, extra={"f": open})
        with pytest.raises(ckptstore.StepExistsError):
            ct.save(store, 1, model=model)
        import numpy as np

        store.save(5, {"w": np.zeros(3)})
        with pytest.raises(ValueError):
            ct.load(store, model=model)  # not a ckptstore.torch step
        other = torch.nn.Linear(3, 3)
        with pytest.raises(RuntimeError):
            ct.load(store, model=other, step=1)  # load_state_dict's own strictness


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_tensors_are_moved_to_the_host(tmp_path):
    model = torch.nn.Linear(4, 4).cuda()
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        ct.save(store, 1, model=model)
        cpu = torch.nn.Linear(4, 4)
        ct.load(store, model=cpu)
    assert torch.equal(cpu.weight, model.weight.cpu())


class WithExtraState(torch.nn.Module):
    """A module whose get_extra_state() holds tensors and plain values."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.calls = 0
        self.scale = torch.zeros(3)

    def get_extra_state(self):
        return {"calls": self.calls, "scale": self.scale, "names": ("a", "b")}

    def set_extra_state(self, state):
        self.calls = state["calls"]
        self.scale = state["scale"]
        assert state["names"] == ("a", "b")


def test_extra_state_round_trips_through_set_extra_state(tmp_path):
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        m = WithExtraState()
        m.calls, m.scale = 7, torch.tensor([1.5, -2.0, 0.25])
        ct.save(store, 1, model=m)
        restored = WithExtraState()
        assert ct.load(store, model=restored) == 1
        assert restored.calls == 7
        assert torch.equal(restored.scale, m.scale)
        assert torch.equal(restored.lin.weight, m.lin.weight)
        # The tensor inside the extra state is a typed tensor of the step.
        assert "model/_extra_state/scale" in store.load(1).tensors


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_and_sparse_tensors_are_refused_by_name(tmp_path):
    with ckptstore.open(tmp_path / "run.ckpt") as store:
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
        with pytest.raises(TypeError, match=r"extra/q: quantized"):
            ct.save(store, 1, extra={"q": q})
        sparse = torch.eye(3).to_sparse()
        with pytest.raises(TypeError, match=r"extra/s: torch.sparse_coo"):
            ct.save(store, 1, extra={"s": sparse})
        with pytest.raises(TypeError):
            ct.save(store, 1.5, extra={"x": torch.zeros(1)})
        assert store.steps() == []


def test_load_reads_into_the_models_own_tensors(tmp_path):
    model, opt = make(0)
    for step in range(3):
        train_step(model, opt, step)
    path = tmp_path / "run.ckpt"
    with ckptstore.open(path) as store:
        ct.save(store, 2, model=model, optimizer=opt)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = {(i, k): v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()}

    # A resumed run with optimizer state (so both have tensors to fill).
    resumed, resumed_opt = make(7)
    train_step(resumed, resumed_opt, 0)
    before = {k: v.data_ptr() for k, v in resumed.state_dict().items()}
    moments = {id(v): v.data_ptr() for s in resumed_opt.state.values() for v in s.values()}
    with ckptstore.open(path, read_only=True, threads=2) as store:
        assert ct.load(store, model=resumed, optimizer=resumed_opt) == 2
    # The same memory, now holding the step.
    assert {k: v.data_ptr() for k, v in resumed.state_dict().items()} == before
    assert sorted(v.data_ptr() for s in resumed_opt.state.values() for v in s.values()) == sorted(
        moments.values())
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, want[k]), k
    for (i, k), v in want_opt.items():
        assert torch.equal(resumed_opt.state_dict()["state"][i][k], v), (i, k)
    # A model of another dtype is loaded by conversion, as before.
    half, _ = make(7)
    half = half.to(torch.float64)
    with ckptstore.open(path, read_only=True) as store:
        ct.load(store, model=half)
    for k, v in half.state_dict().items():
        assert torch.equal(v, want[k].to(torch.float64)), k


def test_a_damaged_chunk_never_reaches_the_model(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 2048)  # an 8 MiB weight: several chunks
    path = tmp_path / "run.ckpt"
    with ckptstore.open(path) as store:
        ct.save(store, 1, model=model)
    weight = model.weight.detach().clone()
    needle = raw(weight)[5 << 20:(5 << 20) + 64]
    # The weight's chunks are in a pack file (the save is above 4 MiB).
    packs = sorted((tmp_path / "run.ckpt.packs").glob("*.pack"))
    assert packs
    for file in [path, *packs]:
        data = bytearray(file.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at + 32] ^= 0x40
            file.write_bytes(bytes(data))
            break
    else:
        raise AssertionError("the weight's bytes are in no file of the store")

    target = torch.nn.Linear(1024, 2048)
    torch.nn.init.zeros_(target.weight)
    with ckptstore.open(path, read_only=True) as store:
        with pytest.raises(ckptstore.CorruptError, match="fails its hash check"):
            ct.load(store, model=target)
    flat = raw(target.weight)
    assert flat[(5 << 20) + 32] == 0, "a damaged byte reached the model"
