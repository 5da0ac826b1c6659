"""GPU state staged at the device's speed (issue 54): `scripts/gpu-check.sh`.

For each size (GiB of CUDA tensors: a bf16 model and its AdamW state,
f32 moments, built here), saves of the same state in a row, medians over
the saves after the first (the first allocates what later saves reuse):

- floor: a copy of the same tensors into pinned host memory allocated
  beforehand (`copy_(non_blocking=True)`, then a synchronize);
- dcp: `dcp.async_save` with DCP's `DefaultStager` (pinned, async,
  non-blocking copies) and its `FileSystemWriter`;
- ckptstore: `dcp.async_save` with `ckptstore.dcp.StorageWriter` into a
  local store (`background_staging=True`).

Blocked: until the call returns; staged: until the state may change;
durable: until the save is done (fsynced). Correctness, each run: the
state changed on the device right after staging completes is not in the
saved step, and the step loads back onto the device bit-identical. Peak
host memory: the most in use above the start (/proc/meminfo, 5 ms).
Without a GPU it runs the same steps on the CPU at a few MiB (to keep the
script working; its figures then mean nothing) and says so."""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed.checkpoint as dcp


def state(gib: float, device: str):
    """A bf16 model and AdamW's f32 moments of `gib` GiB in all."""
    params = int(gib * (1 << 30)) // 10  # 2 bytes a parameter, 4 + 4 for the moments
    out, left, i = {}, params, 0
    while left > 0:
        n = min(left, 1 << 25)
        out[f"model.{i}"] = torch.randn(n, device=device).to(torch.bfloat16)
        out[f"optim.{i}.exp_avg"] = torch.randn(n, device=device)
        out[f"optim.{i}.exp_avg_sq"] = torch.rand(n, device=device)
        left, i = left - n, i + 1
    return out


class Peak:
    """The most host memory in use above the start, sampled every 5 ms."""

    def __init__(self) -> None:
        self.base, self.most, self._stop = self._used(), 0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def _used() -> int:
        info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.most = max(self.most, self._used() - self.base)

    def stop(self) -> int:
        self._stop.set()
        return self.most


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def floor(live, device: str, saves: int):
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=device == "cuda") for k, v in live.items()}
    times = []
    for _ in range(saves):
        sync(device)
        t0 = time.perf_counter()
        for k, v in live.items():
            pinned[k].copy_(v, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"staged": times, "blocked": times, "durable": [float("nan")] * saves}


def saves_of(name: str, live, device: str, saves: int, work: str):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    import ckptstore
    from ckptstore.dcp import StorageReader, StorageWriter

    blocked, staged, durable = [], [], []
    for i in range(saves):
        for v in live.values():
            v.add_(1)  # a new state each save: nothing deduplicated
        sync(device)
        t0 = time.perf_counter()
        if name == "dcp":
            options = StagingOptions(device == "cuda", False, True, device == "cuda")
            response = dcp.async_save(
                live, storage_writer=FileSystemWriter(f"{work}/dcp/{i}"), async_stager=DefaultStager(options),
                no_dist=True,
            )
        else:
            writer = StorageWriter(f"{work}/store", i + 1, background_staging=True)
            response = dcp.async_save(live, storage_writer=writer, no_dist=True)
        blocked.append(time.perf_counter() - t0)
        response.staging_completion.result()
        staged.append(time.perf_counter() - t0)
        if name == "ckptstore" and i == saves - 1:
            expected = {k: v.clone() for k, v in live.items()}
            for v in live.values():
                v.add_(7)  # after staging: not in the step
        response.upload_completion.result()
        durable.append(time.perf_counter() - t0)
        # Keep one save on disk (16 GiB saves on a 64 GiB disk).
        if name == "dcp":
            shutil.rmtree(f"{work}/dcp/{i}")
        elif i > 0:
            with ckptstore.open(f"{work}/store") as store:
                store.remove(i)
    if name == "ckptstore":
        back = {k: torch.zeros_like(v) for k, v in live.items()}
        dcp.load(back, storage_reader=StorageReader(f"{work}/store", saves), no_dist=True)
        if not all(torch.equal(back[k], expected[k]) for k in live):
            raise SystemExit("gpu-check: FAILED: the loaded step is not the state at the save")
        for k, v in live.items():
            v.copy_(expected[k])
    return {"staged": staged, "blocked": blocked, "durable": durable}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", default="1,4,16")
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    sizes = [float(g) for g in args.gib.split(",")] if gpu else [0.008]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if gpu else 'no GPU found: the steps at 8 MiB on the CPU, figures meaningless'}")
    print(f"{'GiB':>6} {'contender':<10} {'blocked s':>10} {'staged s':>10} {'durable s':>10} {'peak host GiB':>14}")
    summary = []
    for gib in sizes:
        live = state(gib, device)
        rows = {}
        for name in ("floor", "dcp", "ckptstore"):
            with tempfile.TemporaryDirectory(dir=os.environ.get("CKPT_GPU_CHECK_DIR")) as work:
                peak = Peak()
                got = floor(live, device, args.saves) if name == "floor" else saves_of(name, live, device, args.saves, work)
                most = peak.stop()
            med = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in got.items()}
            rows[name] = med
            print(f"{gib:>6g} {name:<10} {med['blocked']:>10.4f} {med['staged']:>10.4f} {med['durable']:>10.3f} {most / (1 << 30):>14.2f}")
        del live
        ours, theirs, low = rows["ckptstore"], rows["dcp"], rows["floor"]
        summary.append(
            f"{gib:g} GiB: staged {ours['staged'] / low['staged']:.2f}x the pinned floor (target <= 1.15), "
            f"blocked {ours['blocked'] / theirs['blocked']:.2f}x DefaultStager's (<= 1), "
            f"durable {theirs['durable'] / ours['durable']:.2f}x FileSystemWriter's speed (>= 1.0)"
        )
    print("gpu-check: bit-identical; " + "; ".join(summary) + ("" if gpu else " (no GPU: not a measurement)"))


if __name__ == "__main__":
    sys.exit(main())
