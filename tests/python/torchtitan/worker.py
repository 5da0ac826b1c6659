"""One rank of a small training run checkpointed by a torchtitan 0.3.0
checkpoint manager (ckptstore's, or torchtitan's own to compare), as
torchtitan's trainer drives it: a model of two linear layers (FSDP2 over
gloo at several ranks: DTensor-sharded parameters and optimizer state),
torchtitan's optimizer and LR-scheduler containers, a dataloader with
state and a train state (`states`), `save(step, last_step=...)` after
each step and `maybe_wait_for_staging()` before the optimizer steps.

Usage: worker.py FOLDER TARGET RANK WORLD PORT STEPS [OPTION=VALUE ...]
TARGET: a bucket URL or "-" (None: a bucket in FOLDER). Options:
manager=ckptstore|torchtitan, async=disabled|async|async_with_pinned_mem,
interval=N, keep=K, last_hf=1 (the last step model-only, in HF),
kill=SECONDS (SIGKILL this process after a random delay up to it),
exclude=dataloader, initial=PATH, stop_at=K (leave the loop after step
K's save, then close), slow_save=S (each save's writes start S seconds
late: a fault on top of the real writer), local=DIR (the node-local tier, `{node}`
in it the node's index; nodes of one rank) and upload_every=K.

Prints "resumed S <digest> <position>" (the state as loaded, S 0 when
fresh; the digest of every value but the dataloader's, whole tensors;
the dataloader's position), "step S <digest> <position>" after each
step's update, "committed <steps>" (ckptstore's manager: the bucket's
steps after close), "final <digest>", and "done"; rank 0 writes the model's
whole tensors to FOLDER/final-model.pt."""

import hashlib
import os
import random
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

folder, target, rank, world, port, steps = sys.argv[1:7]
rank, world, steps = int(rank), int(world), int(steps)
options = dict(a.split("=", 1) for a in sys.argv[7:])


class Data:
    """A dataloader with state: where it is in its stream of batches."""

    def __init__(self):
        self.position = 0

    def next(self):
        g = torch.Generator().manual_seed(1000 + self.position)
        self.position += 1
        return torch.randn(8, 16, generator=g)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])


class Adapter:
    """A state-dict adapter to Hugging Face names ("model." before each)."""

    fqn_to_index_mapping = None
    hf_assets_path = None

    def to_hf(self, sd):
        return {f"model.{k}": v for k, v in sd.items()}

    def from_hf(self, sd):
        return {k[len("model."):]: v for k, v in sd.items()}


def whole(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def digest(model, opt, lr, train):
    """BLAKE2 of every value of the run's state but the dataloader's (which
    a load at another world size leaves out), whole, by name."""
    h = hashlib.blake2b(digest_size=12)
    parts = {"model": model.state_dict(), "optimizer": opt.state_dict(), "lr": lr.state_dict(),
             "train": train.state_dict()}
    for part, sd in parts.items():
        for k in sorted(sd):
            v = whole(sd[k])
            h.update(f"{part}.{k}".encode())
            if isinstance(v, torch.Tensor):
                h.update(str(v.dtype).encode() + str(tuple(v.shape)).encode())
                h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


def main():
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
    opt = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(model_parts=[model])
    lr = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=steps)
    data, train = Data(), TrainState()

    common = dict(enable=True, folder="ckpt", interval=int(options.get("interval", "1")),
                  async_mode=options.get("async", "disabled"), keep_latest_k=int(options.get("keep", "0")),
                  last_save_model_only=options.get("last_hf") == "1", last_save_in_hf=options.get("last_hf") == "1",
                  exclude_from_loading=[options["exclude"]] if "exclude" in options else [],
                  initial_load_path=options.get("initial"), initial_load_model_only=False)
    if options.get("manager", "ckptstore") == "ckptstore":
        from ckptstore.torchtitan import CheckpointManager

        tier = {"local": options["local"], "upload_every": int(options.get("upload_every", "1"))} if "local" in options else {}
        # A short timeout: a rank that hangs fails the others within a minute.
        config = CheckpointManager.Config(target=None if target == "-" else target, **tier, **common,
                                          timeout_seconds=60.0)
    else:
        from torchtitan.components.checkpointer import CheckpointManager

        config = CheckpointManager.Config(**common)
    checkpointer = config.build(dataloader=data, model_parts=[model], optimizers=opt, lr_schedulers=lr,
                                states={"train_state": train}, sd_adapter=Adapter(), base_folder=folder)
    checkpointer.load()
    print("resumed", train.step, digest(model, opt, lr, train), data.position, flush=True)
    if "kill" in options:
        delay = random.uniform(0, float(options["kill"]))
        threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    if "slow_save" in options:
        # A fault on top of the real writer: each rank's write lags.
        import ckptstore.dcp._writer as write_module

        original = write_module.StorageWriter.write_data

        def slow(self, *args, **kwargs):
            time.sleep(float(options["slow_save"]))
            return original(self, *args, **kwargs)

        write_module.StorageWriter.write_data = slow
    stop_at = int(options.get("stop_at", steps))
    while train.step < stop_at:
        train.step += 1
        model(data.next()).pow(2).mean().backward()
        checkpointer.maybe_wait_for_staging()
        opt.step()
        lr.step()
        opt.zero_grad()
        print("step", train.step, digest(model, opt, lr, train), data.position, flush=True)
        checkpointer.save(train.step, last_step=train.step == steps)
    checkpointer.close()
    if hasattr(checkpointer, "target"):
        import ckptstore

        print("committed", *ckptstore.Remote(checkpointer.target).steps(), flush=True)
    print("final", digest(model, opt, lr, train), flush=True)
    weights = {k: whole(v) for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(weights, os.path.join(folder, "final-model.pt"))
    if world > 1:
        dist.destroy_process_group()
    print("done", flush=True)


main()
# Every check is done: leave without the interpreter's finalization, where
# gloo's worker threads can abort the process after the work (a torch
# teardown race, pytorch/pytorch#179291: "terminate called without an
# active exception", seen once at rank 1 after "done").
sys.stdout.flush()
os._exit(0)
