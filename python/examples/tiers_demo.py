"""A job's checkpoints on each node's own disk with copies on the other
node, over a bucket; a node's disk lost and the job restored from its
peer. Run with torchrun (gloo, CPU); `--ranks-per-node 2` makes the 4
processes of one machine 2 nodes, each with its own directory:

    torchrun --nproc-per-node 4 tiers_demo.py save /tmp/tier file:///tmp/tier-bucket
    rm -rf /tmp/tier/node1
    torchrun --nproc-per-node 4 tiers_demo.py load /tmp/tier file:///tmp/tier-bucket
"""

import datetime
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ckptstore.dcp import Tiers


def weight(step):
    return torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024) + step


def sharded_state(mesh, step):
    return {"model.weight": distribute_tensor(weight(step), mesh, [Shard(0)]), "step": step}


def main():
    mode, local, bucket = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tiers = Tiers(local + "/node{node}", bucket, peers=1, ranks_per_node=2)
    if mode == "save":
        for step in (10, 20, 30):
            started = time.perf_counter()
            tiers.save(sharded_state(mesh, step), step)
            if rank == 0:
                print(f"step {step}: complete on the local tier in {time.perf_counter() - started:.2f} s", flush=True)
    else:
        state = sharded_state(mesh, 0)
        started = time.perf_counter()
        step = tiers.load(state, None)
        full = state["model.weight"].full_tensor()
        if rank == 0:
            print(f"restored step {step} in {time.perf_counter() - started:.2f} s", flush=True)
            print("bit-identical:", torch.equal(full, weight(step)), "; step value:", state["step"])
    tiers.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
