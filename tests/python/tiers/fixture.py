"""The tier directory fixture (tests/fixtures/tier-0.4.0/): made by
ckptstore 0.4.0's `Tiers`, read by every later version.

    python fixture.py make OUT          # 2 ranks as 2 nodes of 1: OUT/node0, OUT/node1
    python fixture.py check DIR RANK WORLD PORT STEP...   # one rank of a load

`make` runs two ranks (gloo on 127.0.0.1) that save steps 1, 2 and 3 with
`keep_local=2` and `durable_every=3` into a directory bucket that is
removed afterwards, so the fixture holds steps 2 and 3, step 3 marked
in-bucket. `check` loads each STEP at WORLD ranks (as WORLD nodes of one
rank), compares it bit for bit with what was saved, and prints "ok STEP".
The state is small (every store stays in its redb file: no pack files).
"""

import datetime
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=30)


def full(step):
    return {
        "w": torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) * 0.5 + step,
        "b": (torch.arange(48, dtype=torch.float32) - step).to(torch.bfloat16),
        "n": torch.tensor(step, dtype=torch.int64),
    }


def state(mesh, step, empty):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    for name, t in full(step).items():
        t = torch.zeros_like(t) if empty else t
        if mesh is not None and name == "w":
            t = distribute_tensor(t, mesh, [Shard(0)])
        elif mesh is not None and name == "b":
            t = distribute_tensor(t, mesh, [Replicate()])
        out[name] = t
    out["extra"] = {"step": None if empty else step}
    return out


def same(loaded, step):
    for name, want in full(step).items():
        got = loaded[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        if got.dtype != want.dtype or not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            return False
    return loaded["extra"] == {"step": step}


def rank_main(local, bucket, rank, world, port, actions):
    from ckptstore.dcp import Tiers

    mesh = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=TIMEOUT)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    tiers = Tiers(local, bucket, peers=1, durable_every=3, keep_local=2, ranks_per_node=1, timeout=TIMEOUT)
    for what, step in actions:
        if what == "save":
            tiers.save(state(mesh, step, False), step)
        else:
            loaded = state(mesh, 0, True)
            got = tiers.load(loaded, step)
            print(f"ok {got}" if got == step and same(loaded, step) else f"MISMATCH {got}", flush=True)
    tiers.close()
    if world > 1:
        dist.destroy_process_group()


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make(out):
    bucket = tempfile.mkdtemp()
    p = port()
    procs = [
        subprocess.Popen([sys.executable, __file__, "rank", f"{out}/node{{node}}", f"file://{bucket}", str(r), "2", str(p)])
        for r in range(2)
    ]
    assert all(q.wait(timeout=240) == 0 for q in procs)
    shutil.rmtree(bucket)


def main():
    if sys.argv[1] == "make":
        make(sys.argv[2])
    elif sys.argv[1] == "rank":
        local, bucket, rank, world, p = sys.argv[2:7]
        rank_main(local, bucket, int(rank), int(world), int(p), [("save", s) for s in (1, 2, 3)])
    elif sys.argv[1] == "check":
        local, rank, world, p = sys.argv[2:6]
        rank_main(local, None, int(rank), int(world), int(p), [("load", int(s)) for s in sys.argv[6:]])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
