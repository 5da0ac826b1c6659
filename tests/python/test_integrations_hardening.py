"""The Lightning and Hugging Face adapters under real-world use (issue 38):
a save after `fit` does not lock the next Trainer out of the store; the
store's directory is made when the adapter is made, not found missing
after training ran; the Trainer callback rotates steps exactly as the
Trainer rotates its directories, best checkpoint included."""

import types

import torch

import ckptstore
import ckptstore.lightning as cl
import ckptstore.transformers as ctr


def _checkpoint(step):
    return {"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((4,), float(step))}}


def test_a_save_after_fit_leaves_the_store_to_the_next_trainer(tmp_path):
    path = tmp_path / "run.ckpt"
    first = cl.CheckpointIO(path)
    first.save_checkpoint(_checkpoint(1), tmp_path / "last.ckpt")
    first.teardown()  # the end of fit
    # trainer.save_checkpoint() after fit: the store opens again, and no
    # teardown follows.
    first.save_checkpoint(_checkpoint(2), tmp_path / "manual.ckpt")
    second = cl.CheckpointIO(path)  # the next Trainer in the process
    second.save_checkpoint(_checkpoint(3), tmp_path / "last.ckpt")
    assert second.load_checkpoint(tmp_path / "manual.ckpt")["global_step"] == 2
    second.teardown()
    first.teardown()
    with ckptstore.open(path) as store:  # closed once neither uses it
        assert store.steps() == [2, 3]


def test_the_store_directory_is_made_with_the_adapter(tmp_path):
    cl.CheckpointIO(tmp_path / "a" / "b" / "run.ckpt")
    assert (tmp_path / "a" / "b").is_dir()
    ctr.CheckpointCallback(tmp_path / "c" / "d" / "run.ckpt")
    assert (tmp_path / "c" / "d").is_dir()


def test_the_callback_rotates_as_the_trainer_does_with_a_best_checkpoint(tmp_path):
    from transformers.trainer_utils import rotate_checkpoints

    out = tmp_path / "out"
    out.mkdir()
    callback = ctr.CheckpointCallback(tmp_path / "run.ckpt")
    store = callback._open()
    args = types.SimpleNamespace(save_total_limit=2)
    for step in (2, 4, 6, 8, 10, 12):
        store.save(step, {"x": b"1"})
        (out / f"checkpoint-{step}").mkdir()
        best = str(out / "checkpoint-6") if step >= 6 else None
        state = types.SimpleNamespace(best_model_checkpoint=best)
        callback._retain(store, args, state)
        rotate_checkpoints(str(out), save_total_limit=2, best_model_checkpoint=best)
        trainer_keeps = sorted(int(p.name.split("-")[1]) for p in out.iterdir())
        assert store.steps() == trainer_keeps, (step, store.steps(), trainer_keeps)
    assert store.steps() == [6, 12]
    store.close()


def test_a_moved_or_copied_run_directory_is_self_contained(tmp_path):
    import shutil

    a = tmp_path / "run-a"
    io = cl.CheckpointIO(a / "run.ckpt")
    io.save_checkpoint(_checkpoint(20), a / "checkpoints" / "last.ckpt")
    io.teardown()
    # A copy of the whole run directory (store, pack files, markers)...
    shutil.copytree(a, tmp_path / "copy")
    # ...while the original goes on.
    io = cl.CheckpointIO(a / "run.ckpt")
    io.save_checkpoint(_checkpoint(30), a / "checkpoints" / "last.ckpt")
    io.teardown()
    copy = cl.CheckpointIO(tmp_path / "copy" / "run.ckpt")
    assert copy.load_checkpoint(tmp_path / "copy" / "checkpoints" / "last.ckpt")["global_step"] == 20
    assert copy.names() == {str(tmp_path / "copy" / "checkpoints" / "last.ckpt"): 20}
    copy.teardown()
    # The original moved: it resumes from its own markers.
    a.rename(tmp_path / "moved")
    moved = cl.CheckpointIO(tmp_path / "moved" / "run.ckpt")
    assert moved.load_checkpoint(tmp_path / "moved" / "checkpoints" / "last.ckpt")["global_step"] == 30
    moved.save_checkpoint(_checkpoint(40), tmp_path / "moved" / "checkpoints" / "last.ckpt")
    assert moved.names() == {str(tmp_path / "moved" / "checkpoints" / "last.ckpt"): 40}
    moved.teardown()
