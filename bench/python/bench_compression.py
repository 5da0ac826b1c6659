"""Benchmark: `python bench/python/bench_compression.py` (torch; CPU).

Bucket format 4 (issue 67): the same states saved through ckptstore.dcp
into a directory bucket with `compress=True` and without, in one run.

Bytes stored (the bucket's packs) for bf16 weights (randn x 0.02), fp32
Adam first and second moments (after --adam-steps steps of AdamW on a
small MLP's gradients of random data, whose moments are taken whole),
and a small transformer's whole AdamW state (model and optimizer, bf16
weights) trained the same way: ratio = raw bytes / stored bytes.

Compression per core: the CPU seconds a compressed save spends beyond
an uncompressed one (`getrusage`, every thread of the process), over the
state's bytes; decompression the same over a load. Medians of --reps.

With --s3 (the variables of `scripts/garage.sh`'s env file set): DCP
save and load of --mib MiB of bf16 weights and fp32 moments into the S3
server at AWS_ENDPOINT_URL at 1 and 4 ranks, ckptstore compressed and
not, against s3torchconnector: medians of --reps, each round running
every contender once in a rotating order. Ratio = s3torchconnector's
time / ckptstore's. With --throttle MBPS as well: the same through the
bench's own throttle, a TCP proxy in front of the server that passes at
most MBPS MB/s per rank each way (all connections of a run together:
MBPS x ranks), the regime of a real bucket, where a connection carries
85-90 MB/s and fewer bytes must mean less time.
"""

import argparse
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _packs(bucket):
    folder = os.path.join(bucket, "packs")
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))


def _adam_moments(numel, steps):
    """fp32 AdamW moments of `numel` parameters after `steps` steps on an
    MLP's gradients of random data."""
    import torch

    torch.manual_seed(0)
    width = 1024
    layers = max(1, numel // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        x = torch.randn(64, width)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    m = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in model.parameters()])
    v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in model.parameters()])
    return m, v


def _transformer_state(steps):
    """A small transformer's model and AdamW state (bf16 weights, fp32
    moments) after `steps` steps on random tokens."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(1)
    vocab, dim = 8192, 512
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(vocab, dim),
        "blocks": torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(dim, 8, 4 * dim, batch_first=True), num_layers=4
        ),
        "head": torch.nn.Linear(dim, vocab, bias=False),
    })
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (8, 128))
        logits = model["head"](model["blocks"](model["emb"](tokens)))
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    model = model.to(torch.bfloat16)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _nbytes(state):
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(v) for v in state)
    return 0


def _empty_like(state):
    import torch

    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: _empty_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_empty_like(v) for v in state]
    return state


def _save_load(state, base, compress):
    """Bytes stored, and the CPU seconds of a save and of a load of `state`
    into a fresh directory bucket."""
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import StorageReader, StorageWriter

    bucket = tempfile.mkdtemp(dir=base)
    try:
        before = _cpu()
        dcp.save(state, storage_writer=StorageWriter(f"file://{bucket}", 1, compress=compress), no_dist=True)
        saved = _cpu() - before
        stored = _packs(bucket)
        into = _empty_like(state)
        before = _cpu()
        dcp.load(into, storage_reader=StorageReader(f"file://{bucket}", 1), no_dist=True)
        loaded = _cpu() - before
        return stored, saved, loaded
    finally:
        shutil.rmtree(bucket)


def main_local(args):
    import torch

    base = tempfile.mkdtemp(prefix="ckpt-bench-compression-", dir=args.dir)
    try:
        n = args.mib << 20
        m, v = _adam_moments(n // 4, args.adam_steps)
        states = {
            "bf16 weights (randn x 0.02)": {"w": (torch.randn(n // 2) * 0.02).to(torch.bfloat16)},
            "fp32 Adam first moments": {"m": m},
            "fp32 Adam second moments": {"v": v},
            "transformer + AdamW (bf16, fp32)": _transformer_state(args.adam_steps),
        }
        print(f"directory bucket; medians of {args.reps}; {os.cpu_count()} cores")
        print(f"{'state':>34} {'MiB':>6} {'stored raw':>11} {'compressed':>11} {'ratio':>6} "
              f"{'compress GB/s/core':>19} {'decompress GB/s/core':>21}")
        for name, state in states.items():
            size = _nbytes(state)
            runs = {c: [_save_load(state, base, c) for _ in range(args.reps)] for c in (False, True)}
            raw = statistics.median(r[0] for r in runs[False])
            small = statistics.median(r[0] for r in runs[True])
            extra_save = statistics.median(r[1] for r in runs[True]) - statistics.median(r[1] for r in runs[False])
            extra_load = statistics.median(r[2] for r in runs[True]) - statistics.median(r[2] for r in runs[False])
            rate = lambda extra: f"{size / extra / 1e9:.2f}" if extra > 0 else "-"  # noqa: E731
            print(f"{name:>34} {size / 2**20:>6.0f} {raw / 2**20:>11.1f} {small / 2**20:>11.1f} "
                  f"{raw / small:>6.3f} {rate(extra_save):>19} {rate(extra_load):>21}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(mode, kind, target, world, rank, port, mib):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    share = (mib << 20) // world
    g = torch.Generator().manual_seed(rank)
    # A rank's own tensors: bf16 weights, then fp32 moments (half each).
    state = {
        f"w.{rank}": (torch.randn(share // 4, generator=g) * 0.02).to(torch.bfloat16),
        f"m.{rank}": torch.randn(share // 8, generator=g) * 1e-4,
    }
    if mode == "load":
        state = {k: torch.empty_like(v) for k, v in state.items()}
    if kind == "s3torch":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        config = S3ClientConfig(force_path_style=True)
        region = os.environ.get("AWS_REGION", "garage")
        io = (S3StorageWriter(region, target, s3client_config=config, overwrite=True) if mode == "save"
              else S3StorageReader(region, target, s3client_config=config))
    else:
        from ckptstore.dcp import StorageReader, StorageWriter

        io = StorageWriter(target, 1, compress=kind == "compressed") if mode == "save" else StorageReader(target, 1)
    dist.barrier()
    start = time.perf_counter()
    if mode == "save":
        dcp.save(state, storage_writer=io)
    else:
        dcp.load(state, storage_reader=io)
    dist.barrier()
    print(f"took {time.perf_counter() - start:.6f}", flush=True)
    dist.destroy_process_group()


def run(mode, kind, target, world, mib, env=None):
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", mode, kind, target, str(world), str(r), str(port), str(mib)],
            stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
        )
        for r in range(world)
    ]
    took = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"{kind} {mode} at {world} ranks failed:\n{out}")
        took.append(float(out.split("took ")[1].split()[0]))
    return max(took)


class Throttle:
    """A TCP proxy on 127.0.0.1 in front of `upstream` (host, port) that
    passes at most `rate` bytes a second each way, over all connections
    (a token bucket per direction, refilled every 10 ms)."""

    def __init__(self, upstream, rate):
        import asyncio
        import threading

        self.upstream, self.rate = upstream, rate
        self.loop = asyncio.new_event_loop()
        self.port = _port()
        self.budget = {"up": 0.0, "down": 0.0}
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait()

    def _run(self, ready):
        import asyncio

        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self.loop.create_task(self._refill())
        ready.set()
        self.loop.run_until_complete(server.serve_forever())

    async def _refill(self):
        import asyncio

        while True:
            await asyncio.sleep(0.01)
            for way in self.budget:
                self.budget[way] = min(self.budget[way] + self.rate * 0.01, self.rate * 0.05)

    async def _pipe(self, reader, writer, way):
        import asyncio

        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                while self.budget[way] <= 0:
                    await asyncio.sleep(0.005)
                self.budget[way] -= len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _serve(self, client_reader, client_writer):
        import asyncio

        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            self._pipe(client_reader, server_writer, "up"), self._pipe(server_reader, client_writer, "down")
        )


def main_s3(args):
    import uuid
    from urllib.parse import urlparse

    bucket, run_id = os.environ["CKPT_TEST_BUCKET"], uuid.uuid4().hex[:8]
    throttles = {}
    if args.throttle:
        endpoint = urlparse(os.environ["AWS_ENDPOINT_URL"])
        for world in args.ranks:
            throttles[world] = Throttle((endpoint.hostname, endpoint.port), args.throttle * 1e6 * world)
    print(f"state: {args.mib} MiB of bf16 weights and fp32 moments into {os.environ['AWS_ENDPOINT_URL']}"
          + (f" through a throttle of {args.throttle} MB/s a rank each way" if args.throttle else "")
          + f"; medians of {args.reps}")
    kinds = ("raw", "compressed", "s3torch")
    print(f"{'ranks':>5} {'op':>5} {'raw s':>8} {'compressed s':>13} {'s3torch s':>10} "
          f"{'s3torch/raw':>12} {'s3torch/compressed':>19}")
    for world in args.ranks:
        times = {(m, k): [] for m in ("save", "load") for k in kinds}
        env = {}
        if world in throttles:
            env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{throttles[world].port}"}
        for rep in range(args.reps):
            order = kinds[rep % 3:] + kinds[:rep % 3]
            for kind in order:
                prefix = f"bench-compression-{run_id}-{kind}-{world}-{rep}"
                target = f"s3://{bucket}/{prefix}" + ("/" if kind == "s3torch" else "")
                for mode in ("save", "load"):
                    times[(mode, kind)].append(run(mode, kind, target, world, args.mib, env))
        for mode in ("save", "load"):
            raw, small, theirs = (statistics.median(times[(mode, k)]) for k in kinds)
            print(f"{world:>5} {mode:>5} {raw:>8.3f} {small:>13.3f} {theirs:>10.3f} "
                  f"{theirs / raw:>12.2f} {theirs / small:>19.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--adam-steps", type=int, default=20)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--s3", action="store_true", help="DCP to the S3 server of AWS_ENDPOINT_URL")
    ap.add_argument("--ranks", default="1,4", help="the world sizes of --s3, comma-separated (default 1,4)")
    ap.add_argument("--throttle", type=float, default=None, help="with --s3: MB/s a rank, each way, through a proxy")
    ap.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.ranks = [int(r) for r in args.ranks.split(",")]
    if args.worker:
        mode, kind, target, world, rank, port, mib = args.worker
        worker(mode, kind, target, int(world), int(rank), int(port), int(mib))
    elif args.s3:
        main_s3(args)
    else:
        main_local(args)


if __name__ == "__main__":
    main()
