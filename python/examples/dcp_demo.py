"""A sharded model saved at one world size and loaded at another, through
torch.distributed.checkpoint into a bucket. Run with torchrun (gloo, CPU):

    torchrun --nproc-per-node 4 dcp_demo.py save file:///tmp/run-bucket
    torchrun --nproc-per-node 2 dcp_demo.py load file:///tmp/run-bucket
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptstore
from ckptstore.dcp import StorageReader, StorageWriter


def sharded_state(mesh, fill):
    weight = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6) if fill else torch.zeros(10, 6)
    bias = torch.arange(10, dtype=torch.bfloat16) if fill else torch.zeros(10, dtype=torch.bfloat16)
    return {
        "model.weight": distribute_tensor(weight, mesh, [Shard(0)]),
        "model.bias": distribute_tensor(bias, mesh, [Shard(0)]),
        "step": 100 if fill else 0,
    }


def main():
    mode, url = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if mode == "save":
        state = sharded_state(mesh, fill=True)
        dcp.save(state, storage_writer=StorageWriter(url, step=100))
        if rank == 0:
            remote = ckptstore.Remote(url)
            print(f"saved by {world} ranks; steps in the bucket: {remote.steps()}")
    else:
        state = sharded_state(mesh, fill=False)
        reader = StorageReader(url)  # the latest complete step
        dcp.load(state, storage_reader=reader)
        local = state["model.weight"].to_local()
        print(f"rank {rank}/{world}: step {reader.step}, weight rows {local[:, 0].tolist()}", flush=True)
        full = state["model.weight"].full_tensor()
        if rank == 0:
            print("bit-identical:", torch.equal(full, torch.arange(60, dtype=torch.float32).reshape(10, 6)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
