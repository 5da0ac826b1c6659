"""One process of an Accelerate job on CPU (gloo over 127.0.0.1 when
WORLD_SIZE > 1) saving and loading through ckptstore.accelerate:
`python accelerate_worker.py TARGET`. Trains a small model a few steps,
saves step 3, trains on, loads the newest step and checks the model,
the optimizer, the scheduler and the RNG are as they were at the save.
Prints OK. With CKPT_DIE_AT_SAVE=1 the main process is killed inside
the commit of a second save (step 6), after Accelerate wrote its files;
with CKPT_FAIL_COMMIT=1 that commit raises on the main process, which
every process must raise, then load as before."""

import os

import sys
from datetime import timedelta

import torch

from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from ckptstore.accelerate import load_state, save_state


def main(target):
    # A short process-group timeout: a hang fails the test fast.
    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=60))])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Flatten(), torch.nn.Linear(16 * 4, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    def train(n):
        for _ in range(n):
            x = torch.randint(0, 64, (8, 4))
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

    train(3)
    save_state(accelerator, target, 3)
    saved = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    lr, draw = scheduler.get_last_lr(), torch.rand(4)
    train(2)
    if os.environ.get("CKPT_DIE_AT_SAVE") == "1":
        import ckptstore

        def die(*args, **kwargs):
            os._exit(9)

        ckptstore.Store.save_dir = die
        ckptstore.Remote.save_dir = die
        save_state(accelerator, target, 6)
    if os.environ.get("CKPT_FAIL_COMMIT") == "1":
        import ckptstore

        def fail(*args, **kwargs):
            raise ValueError("injected: the commit failed")

        ckptstore.Store.save_dir = fail
        ckptstore.Remote.save_dir = fail
        try:
            save_state(accelerator, target, 6)
        except Exception as e:  # noqa: BLE001 - every process must get here
            print(f"raised {type(e).__name__}: {e}", flush=True)
    assert load_state(accelerator, target) == 3
    back = accelerator.unwrap_model(model).state_dict()
    assert all(torch.equal(saved[k], back[k]) for k in saved), "model"
    state = optimizer.state_dict()["state"][0]
    assert all(torch.equal(moments[k], state[k]) for k in moments), "optimizer"
    assert scheduler.get_last_lr() == lr, "scheduler"
    assert torch.equal(torch.rand(4), draw), "RNG"
    accelerator.wait_for_everyone()
    print("OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
