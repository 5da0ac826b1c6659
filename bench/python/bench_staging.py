"""Benchmark: `python bench/python/bench_staging.py` (torch; gloo on CPU).

What an async save costs the training loop: for each contender, the
seconds until the call returns (blocked), until the state may change
again (staged) and until the step is durable, of `--saves` saves in a
row of the same state (~--mib MiB of f32 DTensors per job, 4 MiB each,
Shard(0)), the state changed between saves; medians over the saves after
the first (the first allocates what later saves reuse) and over --reps
jobs, the slowest rank's time each. At 1 rank and at 4.

Contenders: `dcp.async_save` with DCP's FileSystemWriter in thread mode
(its default stager) and in process mode with shared-memory staging
(`StagingOptions(False, True, False, False)`: the defaults need an
accelerator); with `ckptstore.dcp.StorageWriter` into a directory bucket,
`background_staging=True`, in thread mode and in process mode
(`shared_memory=True`); Meta's `torch_checkpointing` (`CheckpointManager`,
`use_direct_io=False` on this disk; it never fsyncs: durable is reported
without and with an fsync of its files after its write). Floors, in the
same jobs: a memcpy of the state into a preallocated buffer (one thread)
and BLAKE3 of the state on every core. Peak memory: the most host memory
in use during a job above what it used with the state built (sampled
from /proc/meminfo every 5 ms: every process, shared memory included),
in staging copies of the state (DCP's process in process mode is
started, by a save of one number, before that). Ratio = the contender's time / ckptstore
thread mode's (above 1: ckptstore is faster).
"""

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

KINDS = ("fs-thread", "fs-process", "ckpt-thread", "ckpt-process", "tcp")


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsync_tree(root):
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _state(mesh, mib, world):
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    rows, width = 1024, 1024  # 4 MiB of f32 per tensor, over all ranks
    out = {}
    for i in range(max(1, mib // 4)):
        n = rows * width
        full = (torch.arange(n, dtype=torch.float32) + i * n).reshape(rows, width)
        out[f"w{i}"] = distribute_tensor(full, mesh, [Shard(0)])
    return out


def _floors(state):
    """(memcpy s, BLAKE3 on every core s) of this rank's share."""
    import numpy as np
    import torch

    from ckptstore._ckptstore import hash_arrays

    arrays = [v.to_local().reshape(-1).view(torch.uint8).numpy() for v in state.values()]
    dst = [a.copy() for a in arrays]  # preallocated, its pages touched
    start = time.perf_counter()
    for a, d in zip(arrays, dst):
        np.copyto(d, a)
    copy = time.perf_counter() - start
    pieces = [a[i:i + (1 << 20)] for a in arrays for i in range(0, a.size, 1 << 20)]
    start = time.perf_counter()
    hash_arrays(pieces)
    return copy, time.perf_counter() - start


def _save(kind, state, base, step, world):
    """Start one save: (seconds blocked, wait_staged, wait_durable)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from ckptstore.dcp import StorageWriter

    process = AsyncCheckpointerType.PROCESS
    start = time.perf_counter()
    if kind == "fs-thread":
        out = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(f"{base}/fs/{step}"))
    elif kind == "fs-process":
        stager = DefaultStager(StagingOptions(False, True, False, False))
        out = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(f"{base}/fs/{step}"),
                             async_checkpointer_type=process, async_stager=stager)
    else:
        shared = kind == "ckpt-process"
        writer = StorageWriter(f"file://{base}/bucket", step, background_staging=True, shared_memory=shared)
        out = dcp.async_save(state, storage_writer=writer,
                             async_checkpointer_type=process if shared else AsyncCheckpointerType.THREAD)
    blocked = time.perf_counter() - start
    if hasattr(out, "staging_completion"):
        return blocked, out.staging_completion.result, out.upload_completion.result
    return blocked, (lambda: None), out.result


def worker(kind, base, world, rank, port, mib, saves):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = _state(mesh, mib, world)
    copy, blake = _floors(state)
    print(f"FLOOR {rank} {copy:.6f} {blake:.6f}", flush=True)
    manager = _tcp_manager() if kind == "tcp" else None
    if kind.endswith("-process"):
        # DCP's process starts at the first save: a tiny one, so that the
        # saves measured (and the memory) are of a running process.
        _, _, wait = _save(kind, {"warm": torch.zeros(1)}, f"{base}/warm", 0, world)
        wait()
    dist.barrier()
    print("READY", flush=True)
    dist.barrier()
    for step in range(1, saves + 1):
        dist.barrier()
        start = time.perf_counter()
        if manager is not None:
            fut = manager.save(f"{base}/tcp/{step}", {"model": state})
            blocked = time.perf_counter() - start
            with manager.lock():
                staged = time.perf_counter() - start
            fut.result()
            durable = time.perf_counter() - start
            _fsync_tree(f"{base}/tcp/{step}")
            fsynced = time.perf_counter() - start
        else:
            blocked, wait_staged, wait_durable = _save(kind, state, base, step, world)
            wait_staged()
            staged = time.perf_counter() - start
            wait_durable()
            durable = fsynced = time.perf_counter() - start
        for v in state.values():  # the next step's state
            v.to_local().add_(1)
        print(f"SAVE {rank} {step} {blocked:.6f} {staged:.6f} {durable:.6f} {fsynced:.6f}", flush=True)
        dist.barrier()
    if manager is not None:
        manager.close()
    dist.barrier()
    dist.destroy_process_group()


def _tcp_manager():
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    config = CheckpointManager.Config(storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
    return CheckpointManager(config)


def _available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    return 0


def run(kind, base, world, mib, saves):
    """One job: per save, the slowest rank's (blocked, staged, durable,
    durable with fsync); the slowest rank's floors; peak bytes in use
    above the state."""
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", kind, base,
             str(world), str(r), str(port), str(mib), str(saves)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for r in range(world)
    ]
    lines, ready = [[] for _ in procs], threading.Event()
    baseline = [None]

    def read(i, p):
        for line in p.stdout:
            lines[i].append(line)
            if line.startswith("READY") and sum(any(x.startswith("READY") for x in ls) for ls in lines) == world:
                baseline[0] = _available()
                ready.set()

    readers = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in readers:
        t.start()
    low = None
    while any(p.poll() is None for p in procs):
        if ready.is_set():
            now = _available()
            low = now if low is None else min(low, now)
        time.sleep(0.005)
    for t in readers:
        t.join()
    for p in procs:
        if p.returncode != 0:
            raise RuntimeError(f"{kind} at {world} ranks failed:\n{p.stderr.read()[-3000:]}")
    per_save, floors = {}, []
    for line in (x for ls in lines for x in ls):
        parts = line.split()
        if parts[0] == "SAVE":
            per_save.setdefault(int(parts[2]), []).append([float(x) for x in parts[3:]])
        elif parts[0] == "FLOOR":
            floors.append((float(parts[2]), float(parts[3])))
    saves_out = [[max(r[i] for r in ranks) for i in range(4)] for _, ranks in sorted(per_save.items())]
    floor = (max(f[0] for f in floors), max(f[1] for f in floors))
    peak = (baseline[0] - low) if baseline[0] is not None and low is not None else 0
    return saves_out, floor, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--ranks", default="1,4")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, base, world, rank, port, mib, saves = args.worker
        worker(kind, base, int(world), int(rank), int(port), int(mib), int(saves))
        return
    kinds = [k for k in args.kinds.split(",") if k]
    if "tcp" in kinds:
        try:
            import torch_checkpointing  # noqa: F401
        except ImportError:
            print("torch_checkpointing is not installed (pip install torch-checkpointing): left out")
            kinds.remove("tcp")
    print(f"state: {args.mib} MiB of f32 DTensors per job (4 MiB each, Shard(0)); {args.saves} saves per job, "
          f"medians of saves 2..{args.saves} over {args.reps} jobs; slowest rank; one disk")
    for world in [int(r) for r in args.ranks.split(",")]:
        results = {k: [] for k in kinds}
        floors, peaks = [], {k: [] for k in kinds}
        for rep in range(args.reps):
            for kind in kinds if rep % 2 == 0 else list(reversed(kinds)):
                base = tempfile.mkdtemp(prefix="ckpt-bench-staging-", dir=args.dir)
                try:
                    os.sync()
                    saves, floor, peak = run(kind, base, world, args.mib, args.saves)
                finally:
                    shutil.rmtree(base, ignore_errors=True)
                results[kind].extend(saves[1:])
                floors.append(floor)
                peaks[kind].append(peak)
        _report(world, args.mib, kinds, results, floors, peaks)


def _report(world, mib, kinds, results, floors, peaks):
    med = statistics.median
    copy, blake = med(f[0] for f in floors), med(f[1] for f in floors)
    floor = max(copy, blake)
    print(f"\n{world} rank(s): floors (per rank, all ranks at once): memcpy {copy:.3f} s, "
          f"BLAKE3 on every core {blake:.3f} s")
    ours = {i: med(s[i] for s in results["ckpt-thread"]) for i in range(4)} if "ckpt-thread" in results else None
    print(f"{'contender':>14} {'blocked s':>10} {'staged s':>9} {'/floor':>7} {'durable s':>10} "
          f"{'fsynced s':>10} {'staged x':>9} {'durable x':>10} {'peak copies':>12}")
    for kind in kinds:
        m = [med(s[i] for s in results[kind]) for i in range(4)]
        rel = (f"{m[1] / ours[1]:>9.2f} {m[3] / ours[3]:>10.2f}") if ours else ""
        copies = med(peaks[kind]) / (mib << 20)
        print(f"{kind:>14} {m[0]:>10.3f} {m[1]:>9.3f} {m[1] / floor:>7.2f} {m[2]:>10.3f} {m[3]:>10.3f} {rel} "
              f"{copies:>12.2f}")


if __name__ == "__main__":
    main()
