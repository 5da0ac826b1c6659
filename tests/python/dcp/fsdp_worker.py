"""One rank of a small model trained under FSDP2 (`fully_shard`, gloo on
CPU), checkpointed through ckptstore.dcp (run by test_dcp.py).

    python fsdp_worker.py full|save|resume TARGET WORLD RANK PORT

full: 6 steps uninterrupted; save: 3 steps, then a DCP save of the model
and AdamW state (`get_state_dict`) as step 3; resume: load the latest step
(at this world size) and run steps 4-6. Rank 0 prints the losses of the
steps it ran: "losses 0.123 ...".
"""

import datetime
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckptstore.dcp import StorageReader, StorageWriter

SAVE_AT, TOTAL = 3, 6

# A collective that waits longer than this fails the rank: a hang ends
# the test in a minute, not in the default 30.
TIMEOUT = datetime.timedelta(seconds=60)


def batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(32, 12, generator=g), torch.randn(32, 5, generator=g)


def build(mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, steps):
    losses = []
    for i in steps:
        x, y = batch(i)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main():
    mode, target, world, rank, port = sys.argv[1:6]
    world, rank = int(world), int(rank)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    model, opt = build(init_device_mesh("cpu", (world,)))
    if mode == "full":
        losses = train(model, opt, range(TOTAL))
    elif mode == "save":
        losses = train(model, opt, range(SAVE_AT))
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=StorageWriter(target, SAVE_AT))
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=StorageReader(target))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        losses = train(model, opt, range(SAVE_AT, TOTAL))
    if rank == 0:
        print("losses " + " ".join(f"{v:.9g}" for v in losses), flush=True)
    dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
