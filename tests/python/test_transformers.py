"""ckptstore.transformers under a real Hugging Face Trainer (a 2-layer GPT-2
built from a config): a run SIGKILLed at a random step resumes from the
store bit-identical to an uninterrupted run; the store keeps
save_total_limit steps; no checkpoint directory is left behind."""

import os
import pathlib

import pytest
import torch

import ckptstore
import ckptstore.transformers as ckt
from integrations import common

RUN = pathlib.Path(__file__).parent / "integrations" / "hf_run.py"


def run(*args, expect_kill=False):
    return common.run(RUN, *args, done="done 24", expect_kill=expect_kill)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("whole")
    run(d / "run.ckpt", d / "out", d / "params.pt")
    return d


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killed_trainer_resumes_bit_identical(tmp_path, uninterrupted, mode):
    kill_at, seed = common.kill_point(5, 23)  # after the first save (step 4)
    store, out = tmp_path / "run.ckpt", tmp_path / "out"
    extra = ["--async"] if mode == "async" else []
    run(store, out, tmp_path / "params.pt", "--kill-at", kill_at, *extra, expect_kill=True)
    saved = (kill_at - 1) // 4 * 4
    with ckptstore.open(store, read_only=True) as s:
        latest = s.latest_step()
    # Async: the kill may land before the last save is stored.
    assert latest == saved or (mode == "async" and latest in (None, saved - 4)), (latest, kill_at)
    p = run(store, out, tmp_path / "params.pt", "--resume", *extra)
    assert latest is None or f"checkpoint-{latest}" in p.stdout

    common.assert_same_params(uninterrupted / "params.pt", tmp_path / "params.pt",
                              f"kill at step {kill_at}, seed {seed}")
    with ckptstore.open(store, read_only=True) as s:
        assert s.steps() == [20, 24]  # save_total_limit=2
        assert "hf/trainer_state.json" in s.info(24).tensors
    assert not [d for d in out.iterdir() if d.name.startswith("checkpoint-")], list(out.iterdir())


def test_restore_rebuilds_the_files_byte_for_byte(tmp_path, uninterrupted):
    with ckptstore.open(uninterrupted / "run.ckpt", read_only=True) as s:
        loaded = s.load(24)
    path = ckt.restore(uninterrupted / "run.ckpt")
    try:
        assert os.path.basename(path) == "checkpoint-24"
        files = {str(p.relative_to(path)) for p in pathlib.Path(path).rglob("*") if p.is_file()}
        assert files == {n.removeprefix("hf/") for n in loaded.tensors}
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= files
        for name, array in loaded.tensors.items():
            assert pathlib.Path(path, name.removeprefix("hf/")).read_bytes() == array.tobytes()
        assert ckt.restore(uninterrupted / "run.ckpt", step=20, dir=tmp_path).endswith("checkpoint-20")
    finally:
        import shutil

        shutil.rmtree(os.path.dirname(path))
    assert ckt.restore(tmp_path / "none.ckpt") is None
    with pytest.raises(KeyError):
        ckt.restore(uninterrupted / "run.ckpt", step=3)


def test_load_best_model_at_end_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=1, n_embd=8, vocab_size=16, n_positions=8, bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(tmp_path / "out", load_best_model_at_end=True, eval_strategy="steps",
                             save_strategy="steps", report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="load_best_model_at_end"):
        Trainer(model=model, args=args, eval_dataset=[{"input_ids": torch.zeros(4, dtype=torch.long)}],
                callbacks=[ckt.CheckpointCallback(tmp_path / "run.ckpt")])


class _Args:
    def __init__(self, out):
        self.output_dir, self.save_total_limit, self.load_best_model_at_end = str(out), None, False


class _State:
    def __init__(self, step):
        self.is_world_process_zero, self.global_step = True, step
        self.log_history, self.best_model_checkpoint = [{"loss": 1.5, "step": step}], None


def _written(out, step, payload):
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(payload)
    (folder / "trainer_state.json").write_text('{"global_step": %d}' % step)
    return folder


def test_async_on_save_returns_before_storing_and_keeps_the_files_as_written(tmp_path, monkeypatch):
    out, store = tmp_path / "out", tmp_path / "run.ckpt"
    cb = ckt.CheckpointCallback(store, asynchronous=True)
    gate = common.held(monkeypatch, ckt.CheckpointCallback, "_commit")
    payload = os.urandom(3 << 20)
    folder = _written(out, 4, payload)
    state = _State(4)
    cb.on_save(_Args(out), state, None)
    assert not store.exists()  # nothing stored yet: the training thread goes on
    import shutil

    shutil.rmtree(folder)  # the Trainer's rotation deletes it meanwhile
    gate.set()
    cb.on_train_end(_Args(out), state, None)  # waits for the save
    with ckptstore.open(store, read_only=True) as s:
        assert s.load(4).tensors["hf/model.safetensors"].tobytes() == payload
        record = s.info(4).save_record
        assert record.blocked_seconds > 0 and not any(n.startswith("ckptstore.") for n in s.info(4).metrics)
    cost = cb.last_cost
    assert cost.step == 4 and cost.durable_seconds > cost.blocked_seconds > 0
    assert cost.bytes_new >= len(payload)
    (entry,) = [e for e in state.log_history if "checkpoint/durable_s" in e]
    assert entry["step"] == 4 and entry["checkpoint/new_mib"] >= 3


def test_a_failed_async_store_is_raised_by_the_next_save_and_at_the_end(tmp_path, monkeypatch):
    out, store = tmp_path / "out", tmp_path / "run.ckpt"
    cb = ckt.CheckpointCallback(store, asynchronous=True)
    real = ckptstore.Store.save

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckptstore.Store, "save", full)
    _written(out, 4, b"x" * 1000)
    cb.on_save(_Args(out), _State(4), None)
    _written(out, 8, b"y" * 1000)
    with pytest.raises(OSError, match="No space"):
        cb.on_save(_Args(out), _State(8), None)
    monkeypatch.setattr(ckptstore.Store, "save", real)
    cb.on_save(_Args(out), _State(8), None)  # raised once; this one stores
    cb._background.wait()
    monkeypatch.setattr(ckptstore.Store, "save", full)
    _written(out, 12, b"z" * 1000)
    cb.on_save(_Args(out), _State(12), None)
    with pytest.raises(OSError, match="No space"):
        cb.on_train_end(_Args(out), _State(12), None)
    with ckptstore.open(store, read_only=True) as s:
        assert s.steps() == [8]


def test_async_trainer_logs_each_saves_cost(tmp_path):
    p = run(tmp_path / "run.ckpt", tmp_path / "out", tmp_path / "params.pt", "--async")
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("costs ")]
    assert line.split()[1].split(",")[:5] == ["4", "8", "12", "16", "20"], line
    with ckptstore.open(tmp_path / "run.ckpt", read_only=True) as s:
        assert s.steps() == [20, 24]
        # The cost of the save before is in the Trainer's log each step keeps.
        assert s.info(24).metrics["checkpoint/durable_s"] > 0
