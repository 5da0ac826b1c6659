"""A torchtitan training of its smallest model (llama3 "debugmodel") with
checkpoints through ckptstore's checkpoint manager or torchtitan's own,
for `scripts/torchtitan-check.sh` (issue 52): one process, a 1-rank
process group, the model, torchtitan's optimizer and LR-scheduler
containers and the manager built as torchtitan's trainer builds them.

    python torchtitan_run.py DIR --manager ckptstore --steps 40 --interval 10 [--kill-at 25]

On a CUDA device the steps are real (forward, backward, AdamW). Without
one (FlexAttention has no backward on the CPU) each step's gradients are
drawn from a generator seeded by the step: the checkpoints hold the same
state (the model's parameters and AdamW's moments) and the script runs
anywhere. `--kill-at N` SIGKILLs the process right after step N's save
returned (an async save then in flight). Prints "resumed S", each save's
blocked seconds, "final <digest>" (a BLAKE2 of the model's and the
optimizer's state) and "saves: N, blocked median X s".
"""

import argparse
import hashlib
import os
import signal
import statistics
import time

import torch
import torch.distributed as dist


def digest(model, opt):
    h = hashlib.blake2b(digest_size=12)
    for part, sd in (("model", model.state_dict()), ("optimizer", opt.state_dict())):
        for k in sorted(sd):
            v = sd[k]
            h.update(f"{part}.{k}".encode())
            if isinstance(v, torch.Tensor):
                h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--manager", choices=["ckptstore", "torchtitan"], default="ckptstore")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--async-mode", default="async", choices=["disabled", "async", "async_with_pinned_mem"])
    ap.add_argument("--kill-at", type=int, default=0)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group(backend, rank=0, world_size=1)

    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
    from torchtitan.models.llama3 import model_registry

    torch.manual_seed(0)
    spec = model_registry("debugmodel", attn_backend="flex")
    with torch.device(device):
        model = spec.model.build()
    model.init_weights()
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 8e-4})
    opt = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(model_parts=[model])
    lr = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=args.steps)
    train = TrainState()
    common = dict(enable=True, folder="checkpoint", interval=args.interval, async_mode=args.async_mode,
                  keep_latest_k=2, last_save_model_only=False)
    if args.manager == "ckptstore":
        from ckptstore.torchtitan import CheckpointManager
    else:
        from torchtitan.components.checkpointer import CheckpointManager
    config = CheckpointManager.Config(**common)
    checkpointer = config.build(dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=lr,
                                states={"train_state": train}, sd_adapter=None, base_folder=args.dir)
    begin = time.perf_counter()
    checkpointer.load()
    print(f"resumed {train.step} in {time.perf_counter() - begin:.3f} s", flush=True)
    blocked = []
    while train.step < args.steps:
        train.step += 1
        g = torch.Generator(device=device).manual_seed(train.step)
        if cuda:
            tokens = torch.randint(0, 2048, (4, 256), generator=g, device=device)
            positions = torch.arange(256, device=device).repeat(4, 1)
            masks = model.get_attention_masks(positions=positions)
            logits = model(tokens, positions=positions, attention_masks=masks)
            torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        else:
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g, device=device, dtype=p.dtype) * 1e-2
        checkpointer.maybe_wait_for_staging()
        opt.step()
        lr.step()
        opt.zero_grad()
        began = time.perf_counter()
        saved = checkpointer.save(train.step, last_step=train.step == args.steps)
        if saved:
            if cuda:
                torch.cuda.synchronize()
            blocked.append(time.perf_counter() - began)
            print(f"step {train.step}: save blocked {blocked[-1]:.3f} s", flush=True)
        if train.step == args.kill_at:
            print(f"killed after step {train.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    checkpointer.close()
    print("final", digest(model, opt), flush=True)
    if blocked:
        print(f"saves: {len(blocked)}, blocked median {statistics.median(blocked):.3f} s", flush=True)
    dist.destroy_process_group()


main()
