"""One rank of the DCP hardening scenarios (test_dcp_hardening.py), over
gloo on 127.0.0.1 with a short process-group timeout, so that a hang
fails fast instead of waiting 30 minutes.

    python hard_worker.py MODE TARGET RANK WORLD PORT FLAGS_DIR

Modes:
  load-racing   load step 1 (salt 0) at 2 ranks; rank 1 opens the step
                only once FLAGS_DIR/resaved exists, after rank 0 wrote
                FLAGS_DIR/opened (the test saves step 1 again in between)
  load-unlisted load the latest step; rank 0 cannot list the bucket
  load-flaky    load step 1; rank 1's first metadata read fails
  load-apart    load step 1; rank 1 from TARGET-other, which holds
                another save of it (it cannot open the coordinator's)
  save-error    save step 2; rank 1's write fails with a ckptstore.Error
  subgroup      ranks 1 and 2 save and load in a group of their own;
                rank 0 saves and loads alone with no_dist=True
Each prints "ok" when its load is bit-identical, "failed: ..." with the
error when the load failed.
"""

import datetime
import functools
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import worker  # beside this file
from ckptstore.dcp import StorageReader, StorageWriter

import ckptstore

TIMEOUT = datetime.timedelta(seconds=20)


def plain(salt, empty=False):
    """The worker's state without DTensors (for groups without a mesh)."""
    return worker.state(None, salt, empty)


def mismatched(loaded, salt):
    """The tensors of `loaded` that are not those of `salt`."""
    return [n for n in worker.SPECS if not (
        loaded[n].dtype == worker.full(n, salt).dtype and torch.equal(loaded[n], worker.full(n, salt))
    )]


def report(loaded, salt):
    bad = mismatched(loaded, salt)
    print(f"MISMATCH {bad}" if bad else "ok", flush=True)


def wait_for(path, seconds=60):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)


def load_dtensors(mesh, target, step, reader=None):
    loaded = worker.state(mesh, 0, empty=True)
    dcp.load(loaded, storage_reader=reader or StorageReader(target, step))
    full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in loaded.items()}
    return full


def main():
    mode, target, rank, world, port, flags = sys.argv[1:7]
    rank, world, port = int(rank), int(world), int(port)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    try:
        run(mode, target, rank, world, flags)
    except BaseException as e:  # the test reads what each rank saw (DCP's CheckpointException too)
        print(f"failed: {type(e).__name__}: {e}", flush=True)
    print("done", flush=True)
    os._exit(0)


def run(mode, target, rank, world, flags):
    from torch.distributed.device_mesh import init_device_mesh

    if mode == "subgroup":
        group = dist.new_group([1, 2])
        if rank == 0:
            dcp.save(plain(5), storage_writer=StorageWriter(target + "-alone", 1), no_dist=True)
            loaded = plain(0, empty=True)
            dcp.load(loaded, storage_reader=StorageReader(target + "-alone"), no_dist=True)
            report(loaded, 5)
        else:
            dcp.save(plain(6), storage_writer=StorageWriter(target, 1), process_group=group)
            loaded = plain(0, empty=True)
            dcp.load(loaded, storage_reader=StorageReader(target), process_group=group)
            report(loaded, 6)
        dist.barrier()
        return
    mesh = init_device_mesh("cpu", (world,))
    if mode == "load-racing":
        original = StorageReader.read_metadata

        @functools.wraps(original)
        def read_metadata(self, *args, **kwargs):
            if rank == 1:
                wait_for(os.path.join(flags, "resaved"))
            md = original(self, *args, **kwargs)
            if rank == 0:
                open(os.path.join(flags, "opened"), "w").close()
            return md

        StorageReader.read_metadata = read_metadata
        full = load_dtensors(mesh, target, 1)
    elif mode == "load-unlisted":
        if rank == 0:
            listed = ckptstore.Remote.open_global

            def unlisted(self, step=None, commit=None):
                if step is None:  # the newest step: a listing
                    raise OSError("injected: the bucket cannot be listed")
                return listed(self, step, commit)

            ckptstore.Remote.open_global = unlisted
        full = load_dtensors(mesh, target, None)
    elif mode == "save-error":
        if rank == 1:
            def write_data(self, plan, planner):
                raise ckptstore.Error("injected: rank 1 cannot write")

            StorageWriter.write_data = write_data
        try:
            dcp.save(worker.state(mesh, 3, empty=False), storage_writer=StorageWriter(target, 2))
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            print(f"failed: {type(e).__name__}: {e}", flush=True)
        return
    elif mode == "load-apart":
        full = load_dtensors(mesh, target + ("-other" if rank == 1 else ""), 1)
    elif mode == "load-flaky":
        original = StorageReader.read_metadata
        failed = []

        @functools.wraps(original)
        def read_metadata(self, *args, **kwargs):
            if rank == 1 and not failed:
                failed.append(1)
                raise OSError("injected: one metadata read failed")
            return original(self, *args, **kwargs)

        StorageReader.read_metadata = read_metadata
        full = load_dtensors(mesh, target, 1)
    else:
        raise SystemExit(f"unknown mode {mode}")
    report(full, 0)


if __name__ == "__main__":
    main()
