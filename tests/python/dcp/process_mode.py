"""One rank of `dcp.async_save` in DCP's process mode through
ckptstore.dcp.StorageWriter with background staging into shared memory:
`python process_mode.py URL`. The state is changed as soon as staging is
done; each saved step must be the state as it was at its call. Prints
`REUSED` when the second save staged into the memory of the first."""

import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ckptstore.dcp import _writer as _dcp_write
from ckptstore.dcp import StorageReader, StorageWriter


def state(mesh, salt):
    return {
        "w": torch.arange(600_000, dtype=torch.float32) + salt,
        "d": distribute_tensor(torch.full((256, 512), float(salt)), mesh, [Shard(0)]),
        "extra": {"epoch": salt},
    }


def main(url):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (1,))
    live = state(mesh, 1)
    first = None
    for step in (1, 2):
        writer = StorageWriter(url, step, background_staging=True, shared_memory=True)
        response = dcp.async_save(live, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        response.staging_completion.result()
        live["w"].add_(1)
        live["d"].to_local().add_(1)
        live["extra"]["epoch"] += 1
        response.upload_completion.result()
        (copy,) = [v for k, (v, _) in _dcp_write._POOL._free.items() if k[1] == url]
        assert copy["w"].is_shared(), "staged in shared memory"
        first = first or copy["w"].data_ptr()
        if step == 2 and copy["w"].data_ptr() == first:
            print("REUSED", flush=True)
    for step in (1, 2):
        back = state(mesh, 0)
        dcp.load(back, storage_reader=StorageReader(url, step))
        want = state(mesh, step)
        assert torch.equal(back["w"], want["w"]), step
        assert torch.equal(back["d"].to_local(), want["d"].to_local()), step
        assert back["extra"] == want["extra"], (step, back["extra"])
    print("OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
