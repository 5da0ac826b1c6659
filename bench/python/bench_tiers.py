"""Benchmark: `python bench/python/bench_tiers.py` (torch; gloo on CPU).

Saves and restores of the same sharded state (~--mib MiB of f32
DTensors, 4 MiB each, Shard(0)) through `ckptstore.dcp.Tiers` against
DCP's FileSystemWriter/FileSystemReader (its default `sync_files=True`)
and `ckptstore.dcp` straight into a directory bucket, all on the same
disk, at 1 rank and at 4 ranks as 2 nodes of 2 (one directory per node),
in one job per world size; medians of --reps rounds. The state changes
between rounds (nothing for dedup to find); each save starts from a
synced disk. Each time is the slowest rank's, between barriers.

Saves: the time the caller is blocked and the time until the step is
complete on the local tier (for DCP and the bucket, the same); `peers=0`
and `peers=1` (on one machine a copy is a second write to the same disk),
`async_save` with `peers=1`. Restores, with the page cache dropped first
for the files read (cold, `posix_fadvise(DONTNEED)` after a sync) and
again at once (warm): from the ranks' own stores, from peers (node 1's
directory moved away: its ranks read node 0's copies; and the same with
the receivers' check of handed bytes switched off), from the bucket
(an empty local tier), against FileSystemReader. Ratio = DCP's time /
ckptstore's (above 1: ckptstore is faster). Beside each: the bytes a
rank received through the tier's own collectives (the most of any rank;
not DCP's planning, its metadata, nor the shards' bytes) and its peak
memory beyond what it held as the call began (VmHWM over VmRSS, the
most of any rank). `--ranks 2,4,8` runs 2, 4 and 8 ranks (nodes of 2).
"""

import argparse
import ctypes
import gc
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, List

SAVES = ("fs", "bucket", "tiers-p0", "tiers-p1", "tiers-async")
LOADS = ("fs", "tiers-own", "tiers-peers-unproved", "tiers-peers", "tiers-bucket")


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _evict(root):
    """Drop the page cache of every file under `root` (after a sync)."""
    os.sync()
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def count_collectives(received: List[int]) -> None:
    """Wrap torch.distributed's collectives to count what this rank
    receives through those called by ckptstore's tier (`_wire`),
    leaving out DCP's own and the bytes of shards (`Group._pieces`):
    added to `received[0]`, DCP's metadata (which every rank's planner
    needs once) to `received[1]`."""
    import pickle

    import torch.distributed as dist

    def ours() -> Any:
        """The tier's function that called torch.distributed, or None."""
        frame = sys._getframe(2)
        while frame.f_code.co_name.startswith("<"):  # a comprehension: its function
            frame = frame.f_back
        if frame.f_globals.get("__name__") != "ckptstore.dcp._wire" or frame.f_code.co_name == "_pieces":
            return None
        return frame

    def size(t):
        return t.numel() * t.element_size()

    originals = {name: getattr(dist, name) for name in
                 ("all_gather_object", "broadcast_object_list", "all_gather", "all_reduce", "irecv",
                  "all_to_all_single")}

    def all_gather_object(*a, **k):
        counted = ours()
        r = originals["all_gather_object"](*a, **k)
        if counted:  # every message is padded to the largest
            out = a[0] if a else k["object_list"]
            received[0] += len(out) * max(len(pickle.dumps(o)) for o in out)
        return r

    def broadcast_object_list(*a, **k):
        counted = ours()
        r = originals["broadcast_object_list"](*a, **k)
        box, src = (a[0] if a else k["object_list"]), (a[1] if len(a) > 1 else k.get("src"))
        if counted and dist.get_rank() != src:
            n = sum(len(pickle.dumps(o)) for o in box)
            # DCP's metadata, which every rank's planner needs once.
            metadata = counted.f_back.f_code.co_name == "_layout"
            received[1 if metadata else 0] += n
        return r

    def all_gather(out, t, *a, **k):
        if ours():
            received[0] += sum(size(o) for o in out)
        return originals["all_gather"](out, t, *a, **k)

    def all_reduce(t, *a, **k):
        if ours():
            received[0] += size(t)
        return originals["all_reduce"](t, *a, **k)

    def irecv(t, *a, **k):
        if ours():
            received[0] += size(t)
        return originals["irecv"](t, *a, **k)

    def all_to_all_single(out, t, *a, **k):
        if ours():
            received[0] += size(out)
        return originals["all_to_all_single"](out, t, *a, **k)

    for name, f in (("all_gather_object", all_gather_object), ("broadcast_object_list", broadcast_object_list),
                    ("all_gather", all_gather), ("all_reduce", all_reduce), ("irecv", irecv),
                    ("all_to_all_single", all_to_all_single)):
        setattr(dist, name, f)


def _trim() -> None:
    """Give the C heap's free memory back to the system, so that what an
    earlier call freed does not hide what the next one takes."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _memory(key: str) -> int:
    """This process's VmRSS or VmHWM, in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def _unproved(load):
    """`load` with the receivers' check switched off (no chunk maps sent,
    no proofs): the baseline of what the check costs."""
    import ckptstore.dcp.stripes._run as fan_out
    from ckptstore.dcp.tiers._load import TierSource

    maps_travel = fan_out.MapsTravel
    fan_out.MapsTravel = type("Never", (), {})
    TierSource.proves = False
    try:
        return load()
    finally:
        fan_out.MapsTravel, TierSource.proves = maps_travel, True


def worker(base, world, rank, port, mib, reps):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptstore.dcp import StorageReader, StorageWriter, Tiers

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    n = 1024 * 1024
    state = {
        f"w{i}": distribute_tensor((torch.arange(n, dtype=torch.float32) + i * n).reshape(1024, 1024), mesh, [Shard(0)])
        for i in range(max(1, mib // 4))
    }
    bucket = f"file://{base}/bucket"
    tiers = {
        "tiers-p0": Tiers(f"{base}/p0/node{{node}}", peers=0, ranks_per_node=2),
        "tiers-p1": Tiers(f"{base}/p1/node{{node}}", bucket=None, peers=1, ranks_per_node=2),
    }

    received = [0, 0]
    count_collectives(received)

    def timed(fn):
        """The slowest rank's blocked and complete times, and the most any
        rank received through the tier's collectives (DCP's metadata left
        out) and held at its peak beyond what it held at the start."""
        dist.barrier()
        counted = received[0]
        gc.collect()
        _trim()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM from here
        rss = _memory("VmRSS")
        start = time.perf_counter()
        out = fn()
        blocked = time.perf_counter() - start
        if callable(out):
            out()
        took = time.perf_counter() - start
        peak = _memory("VmHWM") - rss
        dist.barrier()
        both = torch.tensor([blocked, took, received[0] - counted, peak], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        return tuple(float(x) for x in both)

    def results(what, kind, blocked, took, tier_bytes, peak):
        if rank == 0:
            print(f"RESULT {what} {kind} {blocked:.6f} {took:.6f} {tier_bytes:.0f} {peak:.0f}", flush=True)

    def step_of(rep):
        return 10 * (rep + 1)

    for rep in range(reps):
        step = step_of(rep)
        for t in state.values():
            t.to_local().add_(1)
        for kind in SAVES:
            if rank == 0:
                os.sync()
            if kind == "fs":
                fn = lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{base}/fs/{step}"))  # noqa: E731
            elif kind == "bucket":
                fn = lambda: dcp.save(state, storage_writer=StorageWriter(bucket, step))  # noqa: E731
            elif kind == "tiers-async":
                fn = lambda: tiers["tiers-p1"].async_save(state, step + 1).upload_completion.result  # noqa: E731
            else:
                fn = lambda: tiers[kind].save(state, step)  # noqa: E731, B023
            results("save", kind, *timed(fn))
        # Restores of this round's step.
        for kind in LOADS:
            if kind.startswith("tiers-peers") and world == 1:
                continue
            for cache in ("cold", "warm"):
                if cache == "cold" and rank == 0:
                    _evict(base)
                moved = f"{base}/p1/node1"
                if kind.startswith("tiers-peers") and world > 1 and rank == 2:
                    os.rename(moved, moved + ".away")
                if kind == "fs":
                    fn = lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(f"{base}/fs/{step}"))  # noqa: E731
                elif kind == "tiers-bucket":
                    empty = Tiers(f"{base}/empty-{rep}-{cache}/node{{node}}", bucket, ranks_per_node=2)
                    fn = lambda: empty.load(state, step)  # noqa: E731
                elif kind == "tiers-peers-unproved":
                    fn = lambda: _unproved(lambda: tiers["tiers-p1"].load(state, step))  # noqa: E731
                else:
                    fn = lambda: tiers["tiers-p1"].load(state, step)  # noqa: E731
                if kind == "tiers-bucket":
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        results("load-" + cache, kind, *timed(fn))
                    empty.close()
                else:
                    results("load-" + cache, kind, *timed(fn))
                dist.barrier()
                if kind.startswith("tiers-peers") and world > 1 and rank == 2:
                    shutil.rmtree(moved, ignore_errors=True)
                    os.rename(moved + ".away", moved)
                dist.barrier()
        if rank == 0:
            shutil.rmtree(f"{base}/fs/{step}", ignore_errors=True)
    for t in tiers.values():
        t.close()
    dist.destroy_process_group()


def run(base, world, mib, reps):
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", base, str(world), str(r), str(port),
             str(mib), str(reps)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for r in range(world)
    ]
    found = {}
    done = [p.communicate(timeout=3600) for p in procs]
    failed = [f"rank {r}:\n{err[-1500:]}" for r, (p, (_, err)) in enumerate(zip(procs, done)) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"the job of {world} ranks failed:\n" + "\n".join(failed))
    for out, _ in done:
        for line in out.splitlines():
            if line.startswith("RESULT"):
                _, what, kind, *values = line.split()
                found.setdefault((what, kind), []).append(tuple(float(v) for v in values))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--ranks", default="1,4", help="the world sizes to run, comma-separated (default 1,4)")
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        base, world, rank, port, mib, reps = args.worker
        worker(base, int(world), int(rank), int(port), int(mib), int(reps))
        return
    print(f"state: {args.mib} MiB of f32 DTensors (4 MiB each, Shard(0)); medians of {args.reps}; "
          "4 ranks are 2 nodes of 2 on one disk")
    for world in [int(r) for r in args.ranks.split(",")]:
        base = tempfile.mkdtemp(prefix="ckpt-bench-tiers-", dir=args.dir)
        try:
            found = run(base, world, args.mib, args.reps)
        finally:
            shutil.rmtree(base, ignore_errors=True)

        def median(what, kind, i):
            return statistics.median(v[i] for v in found[(what, kind)])

        def extra(what, kind):
            """The tier's collective bytes a rank received, and its peak
            memory over its start (MiB), as columns."""
            tier = f"{median(what, kind, 2):>10.0f}" if kind.startswith("tiers") else f"{'-':>10}"
            return f"{tier} {median(what, kind, 3) / (1 << 20):>9.1f}"

        fs = median("save", "fs", 1)
        print(f"\n{world} rank(s): saves       blocked s   local commit s   FileSystemWriter / this"
              "   tier B/rank  peak MiB")
        for kind in SAVES:
            took = median("save", kind, 1)
            print(f"  {kind:<14} {median('save', kind, 0):>10.3f} {took:>16.3f} {fs / took:>10.2f}"
                  f"{'':>15}{extra('save', kind)}")
        for cache in ("cold", "warm"):
            what = "load-" + cache
            fs = median(what, "fs", 1)
            own = median(what, "tiers-own", 1)
            print(f"{world} rank(s): restores ({cache})     s   FileSystemReader / this   own / this"
                  "   tier B/rank  peak MiB")
            for kind in LOADS:
                if (what, kind) not in found:
                    continue
                took = median(what, kind, 1)
                print(f"  {kind:<14} {took:>10.3f} {fs / took:>14.2f} {own / took:>12.2f}{'':>9}{extra(what, kind)}")


if __name__ == "__main__":
    main()
