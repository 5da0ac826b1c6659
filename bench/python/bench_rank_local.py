"""Rank-local saves on a real Garage, ranks landing at once (issue 75):
each rank a process with its own `Remote` (as separate hosts are), all
released by a barrier, then every rank's shard of one save of one step,
as `ckptstore.dcp`'s rank-local mode writes it:

- `listing`: `ShardUpload.RankLocal(save)` (each rank lists the step's
  shards once its own landed; `CKPT_RANK_LOCAL_RENDEZVOUS=0`);
- `announced`: `ShardUpload.RankLocalShard(save)` announced under the
  shard's lock through a real `torch.distributed.TCPStore` (the default).

Requests are counted from Garage's log (the lines naming this run's
prefix), with one order of landing per row: `at once` (a barrier) or
`one after another` (each rank waits for the one before).

    source target/garage/env
    python bench/python/bench_rank_local.py --ranks 4 16 48
"""

import argparse
import multiprocessing as mp
import os
import socket
import time
import uuid
from datetime import timedelta

import numpy as np


def _requests(log, since):
    """The requests in Garage's log `log` after byte `since` (nothing else
    uses the server meanwhile), by kind: a listing, an object GET, or the
    method."""
    counts = {}
    with open(log, "rb") as f:
        f.seek(since)
        for raw in f:
            line = raw.decode("utf-8", "replace")
            if "generic_server" not in line or ") " not in line:
                continue
            method, path = (line.split(") ", 1)[1].split(" ") + [""])[:2]
            kind = method
            if method == "GET":
                kind = "list" if "list-type=" in path else "GET"
            elif method == "POST" and "?delete" in path:
                kind = "DELETE (bulk)"
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _rank(url, rank, world, how, order, port, barrier, turns, out):
    import torch.distributed as dist

    import ckptstore
    from ckptstore import ShardId, ShardUpload
    from ckptstore._remote import values_of
    from ckptstore.dcp import _rank_local

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    remote = ckptstore.Remote(url)
    values = values_of({"w": np.full(4096, rank, dtype=np.uint8)}, None, None)
    shard, save = ShardId(5, rank, world), "bench-save"
    barrier.wait()
    if order == "one after another" and rank > 0:
        turns[rank - 1].wait()
    if how == "announced":
        def announce(name):
            return _rank_local.announce(store, save, rank, world, name)

        info = remote.write_shard(shard, ShardUpload.RankLocalShard(save=save), values, announce)
    else:
        info = remote.write_shard(shard, ShardUpload.RankLocal(save=save), values)
    turns[rank].set()
    out.put((rank, bool(info.complete)))
    barrier.wait()


def _row(base, log, world, how, order):
    prefix = f"bench-rank-local-{uuid.uuid4().hex[:8]}"
    url = f"{base}/{prefix}"
    since = os.path.getsize(log)
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(world), ctx.Queue()
    turns = [ctx.Event() for _ in range(world)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(url, r, world, how, order, port, barrier, turns, out)) for r in range(world)]
    for p in procs:
        p.start()
    done = [out.get(timeout=600) for _ in range(world)]
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited {p.exitcode}")
    time.sleep(0.5)  # the log's last lines
    counts = _requests(log, since)
    total = sum(counts.values())
    completed = sum(1 for _, c in done if c)
    print(f"| {world} | {how} | {order} | {total / world:.1f} | {counts.get('GET', 0)} | {completed} | {dict(sorted(counts.items()))} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 48])
    ap.add_argument("--garage-log", default=None)
    args = ap.parse_args()
    log = args.garage_log or os.path.join(os.path.dirname(os.environ["CKPT_GARAGE_CONFIG"]), "server.log")
    base = f"s3://{os.environ['CKPT_TEST_BUCKET']}"
    print("| ranks | completion | landing | requests per rank | object GETs in all | ranks that committed | requests by kind |")
    print("|---|---|---|---|---|---|---|")
    for world in args.ranks:
        for how in ("listing", "announced"):
            for order in ("one after another", "at once"):
                _row(base, log, world, how, order)


if __name__ == "__main__":
    main()
