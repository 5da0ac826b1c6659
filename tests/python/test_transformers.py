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


def test_killed_trainer_resumes_bit_identical(tmp_path, uninterrupted):
    kill_at, seed = common.kill_point(5, 23)  # after the first save (step 4)
    store, out = tmp_path / "run.ckpt", tmp_path / "out"
    run(store, out, tmp_path / "params.pt", "--kill-at", kill_at, expect_kill=True)
    with ckptstore.open(store, read_only=True) as s:
        assert s.latest_step() == (kill_at - 1) // 4 * 4, (s.steps(), kill_at)
    p = run(store, out, tmp_path / "params.pt", "--resume")
    assert f"checkpoint-{(kill_at - 1) // 4 * 4}" in p.stdout

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
