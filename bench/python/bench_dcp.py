"""Benchmark: `python bench/python/bench_dcp.py` (torch; gloo on CPU).

`dcp.save` and `dcp.load` of the same sharded state (~--mib MiB of f32
DTensors, Shard(0), evenly divisible) through ckptstore.dcp into a
directory bucket, against DCP's own FileSystemWriter/FileSystemReader, on
the same disk, at 1 and 4 ranks, in one run; medians of --reps rounds,
each round running every contender once, in an order that rotates, each
save and load from a synced disk (`os.sync()` first). Each time is the slowest rank's,
between barriers. Then a load at half the world size of a step saved at 4
ranks: bytes each rank read (`rchar` of /proc/self/io), against its share
of the state. Ratio = FileSystem's time / ckptstore's (above 1: ckptstore
is faster).

With --s3 (the variables of `scripts/garage.sh`'s env file set): the same
saves and loads into the S3 server at AWS_ENDPOINT_URL, bucket
$CKPT_TEST_BUCKET, through ckptstore.dcp (s3://) against AWS's
s3torchconnector.dcp S3StorageWriter/S3StorageReader (path-style
addressing), at 1 and 4 ranks, each contender under a prefix of its own;
requests per GiB counted from the Garage log (--garage-log) by method.
Ratio = s3torchconnector's time / ckptstore's. Then a replicated state
(every tensor Replicate(), --replicated-mib) saved once and loaded at 4
ranks by ckptstore striped (each byte read once, handed on, each range
checked by its receiver against the bucket's chunk hashes with a proof),
the same with receivers checking each message's BLAKE3 only (the striped
load before those proofs; for the cost of the check), ckptstore with
fan_out=False (each rank reads it all) and s3torchconnector: seconds,
requests (Garage's log) and the bytes the ranks asked of the bucket
(ckptstore's, counted in the process; s3torchconnector's are not seen
from Python). --replicated-only runs that part alone.

With --rank-local (directory mode): DCP's rank-local mode
(`use_collectives=False`) through ckptstore and through DCP's
FileSystemWriter, against ckptstore's collective mode: save and
same-world load times, and the bytes each rank asked of the bucket.
"""

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rchar():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def worker(mode, kind, target, world, rank, port, mib, step):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ckptstore.dcp import StorageReader, StorageWriter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    rows, width, count = 1024, 1024, max(1, mib // 4)  # 4 MiB tensors
    state = {}
    for i in range(count):
        # Distinct values everywhere (nothing for dedup to find).
        n = rows * width
        full = (torch.arange(n, dtype=torch.float32) + i * n).reshape(rows, width) if mode == "save" else torch.zeros(rows, width)
        placement = Replicate() if os.environ.get("CKPT_BENCH_REPLICATE") else Shard(0)
        state[f"w{i}"] = distribute_tensor(full, mesh, [placement])
    asked = _count_asked()
    dist.barrier()
    before, start = _rchar(), time.perf_counter()
    if kind == "s3torch":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        config = S3ClientConfig(force_path_style=True)
        region = os.environ.get("AWS_REGION", "garage")
        if mode == "save":
            dcp.save(state, storage_writer=S3StorageWriter(region, target, s3client_config=config))
        else:
            dcp.load(state, storage_reader=S3StorageReader(region, target, s3client_config=config))
    elif mode == "save":
        writer = StorageWriter(target, step) if kind.startswith("ckptstore") else dcp.FileSystemWriter(target)
        dcp.save(state, storage_writer=writer, use_collectives=not kind.endswith("-local"))
    elif kind in ("fs", "fs-local"):
        dcp.load(state, storage_reader=dcp.FileSystemReader(target))
    else:
        if kind == "ckptstore-unproved":
            import ckptstore.dcp._targets

            ckptstore.dcp._targets.OpenedBucket.proves = False
        fan_out = kind in ("ckptstore", "ckptstore-unproved", "ckptstore-local")
        dcp.load(state, storage_reader=StorageReader(target, step, fan_out=fan_out))
    dist.barrier()
    took, read = time.perf_counter() - start, _rchar() - before
    print(f"RESULT {rank} {took:.6f} {read} {asked[0]}", flush=True)
    dist.destroy_process_group()


def _count_asked():
    """Count the bytes this process asks of a bucket through ckptstore
    (into a one-item list)."""
    import ckptstore

    asked = [0]
    for name in ("read_pieces", "read_pieces_into", "read_pieces_proving"):
        original = getattr(ckptstore.Remote, name)

        def counted(self, opened, pieces, *rest, _original=original):
            asked[0] += sum(p[3] for p in pieces)
            return _original(self, opened, pieces, *rest)

        setattr(ckptstore.Remote, name, counted)
    return asked


def run(mode, kind, target, world, mib, step, env=None):
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", mode, kind, target,
             str(world), str(r), str(port), str(mib), str(step)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        for r in range(world)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{mode} {kind} at {world} ranks failed:\n{err[-2000:]}")
        for line in out.splitlines():
            if line.startswith("RESULT"):
                _, rank, took, read, asked = line.split()
                results.append((int(rank), float(took), int(read), int(asked)))
    return max(r[1] for r in results), sorted(results)


def _requests(log, since, prefix):
    """Requests in the Garage log `log` after byte `since` that name
    `prefix` (in the path or as a listing's prefix), by method."""
    counts = {}
    with open(log, "rb") as f:
        f.seek(since)
        for raw in f:
            line = raw.decode("utf-8", "replace")
            if prefix not in line or ") " not in line:
                continue
            method = line.split(") ", 1)[1].split(" ", 1)[0]
            counts[method] = counts.get(method, 0) + 1
    return counts


def main_s3(args):
    import uuid

    bucket = os.environ["CKPT_TEST_BUCKET"]
    log = args.garage_log or os.path.join(os.path.dirname(os.environ["CKPT_GARAGE_CONFIG"]), "server.log")
    run_id = uuid.uuid4().hex[:8]
    if args.replicated_only:
        _replicated_s3(args, bucket, log, run_id)
        return
    gib = args.mib / 1024
    print(f"state: {args.mib} MiB of f32 DTensors (4 MiB each, Shard(0)) into Garage at "
          f"{os.environ['AWS_ENDPOINT_URL']}; medians of {args.reps}; requests per GiB from its log")
    print(f"{'ranks':>5} {'op':>5} {'ckptstore s':>12} {'s3torch s':>10} {'ratio':>6} "
          f"{'ckptstore req/GiB':>18} {'s3torch req/GiB':>16}")
    for world in args.ranks:
        times = {(m, k): [] for m in ("save", "load") for k in ("ckptstore", "s3torch")}
        requests = {}
        for rep in range(args.reps):
            for kind in ("ckptstore", "s3torch") if rep % 2 == 0 else ("s3torch", "ckptstore"):
                prefix = f"bench-{run_id}-{kind}-{world}-{rep}"
                target = f"s3://{bucket}/{prefix}" + ("/" if kind == "s3torch" else "")
                for mode in ("save", "load"):
                    os.sync()
                    since = os.path.getsize(log)
                    took, _ = run(mode, kind, target, world, args.mib, 1)
                    times[(mode, kind)].append(took)
                    if rep == 0:
                        time.sleep(0.5)  # the log is written behind the answers
                        requests[(mode, kind)] = _requests(log, since, prefix)
        for mode in ("save", "load"):
            ours = statistics.median(times[(mode, "ckptstore")])
            theirs = statistics.median(times[(mode, "s3torch")])
            per = [sum(requests[(mode, k)].values()) / gib for k in ("ckptstore", "s3torch")]
            print(f"{world:>5} {mode:>5} {ours:>12.3f} {theirs:>10.3f} {theirs / ours:>6.2f} "
                  f"{per[0]:>18.1f} {per[1]:>16.1f}")
            for k in ("ckptstore", "s3torch"):
                detail = ", ".join(f"{m} {n}" for m, n in sorted(requests[(mode, k)].items()))
                print(f"{'':>11}{k}: {detail}")
    _replicated_s3(args, bucket, log, run_id)


def _replicated_s3(args, bucket, log, run_id):
    """A replicated state loaded at 4 ranks: ckptstore striped, ckptstore
    per rank, s3torchconnector."""
    mib, env = args.replicated_mib, {"CKPT_BENCH_REPLICATE": "1"}
    print(f"replicated state: {mib} MiB of f32 tensors (4 MiB each, Replicate()) loaded at 4 ranks; "
          f"medians of {args.reps}")
    print(f"{'reader':>20} {'load s':>8} {'requests':>9} {'GET':>5} {'asked MiB':>10}")
    targets = {}
    for kind in ("ckptstore", "s3torch"):
        prefix = f"bench-{run_id}-replicated-{kind}"
        targets[kind] = (prefix, f"s3://{bucket}/{prefix}" + ("/" if kind == "s3torch" else ""))
        run("save", kind, targets[kind][1], 4, mib, 1, env)
    for kind in ("ckptstore", "ckptstore-unproved", "ckptstore-per-rank", "s3torch"):
        prefix, target = targets["s3torch" if kind == "s3torch" else "ckptstore"]
        times, counted, asked = [], {}, 0
        for rep in range(args.reps):
            since = os.path.getsize(log)
            took, ranks = run("load", kind, target, 4, mib, 1, env)
            times.append(took)
            if rep == 0:
                time.sleep(0.5)  # the log is written behind the answers
                counted, asked = _requests(log, since, prefix), sum(r[3] for r in ranks)
        shown = f"{asked / 2**20:>10.1f}" if kind != "s3torch" else f"{'-':>10}"
        print(f"{kind:>20} {statistics.median(times):>8.3f} {sum(counted.values()):>9} "
              f"{counted.get('GET', 0):>5} {shown}")


def _rank_local(args, base):
    """DCP's rank-local mode (`use_collectives=False`) against the
    collective mode, and against DCP's FileSystemWriter in rank-local
    mode: save and same-world load, the slowest rank's time (medians of
    --reps, the order rotating), and the bytes each rank asked of the
    bucket in the load (ckptstore's; the bucket's requests per rank are
    pinned in tests/python/test_dcp_rank_local.py)."""
    kinds = ("ckptstore", "ckptstore-local", "fs-local")
    print("rank-local mode: seconds (ratio: collective ckptstore's / this)")
    print(f"{'ranks':>5} {'op':>5} " + " ".join(f"{k:>16}" for k in kinds) + f" {'asked/rank MiB':>15}")
    for world in [w for w in args.ranks if w > 1]:
        times = {(m, k): [] for m in ("save", "load") for k in kinds}
        asked = []
        for rep in range(args.reps):
            order = kinds[rep % 3:] + kinds[:rep % 3]
            for kind in order:
                where = os.path.join(base, f"{kind}-{world}-{rep}")
                target = f"file://{where}" if kind.startswith("ckptstore") else where
                for mode in ("save", "load"):
                    os.sync()
                    took, ranks = run(mode, kind, target, world, args.mib, 1)
                    times[(mode, kind)].append(took)
                    if mode == "load" and kind == "ckptstore-local":
                        asked.append(max(a for *_, a in ranks))
                shutil.rmtree(where, ignore_errors=True)
        for mode in ("save", "load"):
            base_s = statistics.median(times[(mode, "ckptstore")])
            cells = []
            for kind in kinds:
                t = statistics.median(times[(mode, kind)])
                cells.append(f"{t:>9.3f} ({base_s / t:.2f})")
            extra = f"{statistics.median(asked) / 2**20:>15.1f}" if mode == "load" else ""
            print(f"{world:>5} {mode:>5} " + " ".join(f"{c:>16}" for c in cells) + f" {extra}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--s3", action="store_true", help="against s3torchconnector on the S3 server of AWS_ENDPOINT_URL")
    ap.add_argument("--garage-log", default=None, help="the Garage server's log (default: beside $CKPT_GARAGE_CONFIG)")
    ap.add_argument("--ranks", default="1,4", help="the world sizes to run, comma-separated (default 1,4)")
    ap.add_argument("--replicated-mib", type=int, default=256, help="the replicated state of --s3 (default 256)")
    ap.add_argument("--replicated-only", action="store_true", help="with --s3: the replicated state's loads alone")
    ap.add_argument("--rank-local", action="store_true", help="also DCP's rank-local mode (use_collectives=False)")
    ap.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.ranks = [int(r) for r in args.ranks.split(",")]
    if args.worker:
        mode, kind, target, world, rank, port, mib, step = args.worker
        worker(mode, kind, target, int(world), int(rank), int(port), int(mib), int(step))
        return
    if args.s3:
        main_s3(args)
        return
    base = tempfile.mkdtemp(prefix="ckpt-bench-dcp-", dir=args.dir)
    try:
        print(f"state: {args.mib} MiB of f32 DTensors (4 MiB each, Shard(0)); medians of {args.reps}")
        print(f"{'ranks':>5} {'op':>5} {'ckptstore s':>12} {'FileSystem s':>13} {'ratio':>6}")
        for world in args.ranks:
            times = {("save", "ckptstore"): [], ("save", "fs"): [], ("load", "ckptstore"): [], ("load", "fs"): []}
            for rep in range(args.reps):
                # The order rotates every round; each save starts from a
                # synced disk (nothing of the last round left to write back).
                for kind in ("ckptstore", "fs") if rep % 2 == 0 else ("fs", "ckptstore"):
                    where = os.path.join(base, f"{kind}-{world}-{rep}")
                    target = f"file://{where}" if kind == "ckptstore" else where
                    for mode in ("save", "load"):
                        os.sync()
                        took, _ = run(mode, kind, target, world, args.mib, 1)
                        times[(mode, kind)].append(took)
                    shutil.rmtree(where, ignore_errors=True)
            for mode in ("save", "load"):
                ours = statistics.median(times[(mode, "ckptstore")])
                theirs = statistics.median(times[(mode, "fs")])
                print(f"{world:>5} {mode:>5} {ours:>12.3f} {theirs:>13.3f} {theirs / ours:>6.2f}")
        if args.rank_local:
            _rank_local(args, base)
        # Bytes read per rank at half the world size.
        share = args.mib * (1 << 20) // 2
        print(f"load at 2 ranks of a step saved at 4: bytes read per rank (share {share / 2**20:.0f} MiB)")
        for kind in ("ckptstore", "fs"):
            where = os.path.join(base, f"{kind}-half")
            target = f"file://{where}" if kind == "ckptstore" else where
            run("save", kind, target, 4, args.mib, 2)
            _, ranks = run("load", kind, target, 2, args.mib, 2)
            per = ", ".join(f"rank {r}: {read / 2**20:.1f} MiB" for r, _, read, _ in ranks)
            print(f"  {kind:>9}: {per}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
