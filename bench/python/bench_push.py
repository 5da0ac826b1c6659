"""What a push of a step whose chunks the bucket already holds costs, against
reading and hash-checking every byte of that step in the same run: the work
a bucket cut of its own (chunks other than the store's) would add to each
such push, since the bucket's chunk hashes could then not be taken from
the store's manifest (docs/design.md, "Chunks").

    python bench/python/bench_push.py [--mib 1024] [--tensors 16] [--reps 5]

Each rep saves the same state as a new step (every chunk deduplicated
against the bucket), times `Remote.push` of it, then a load of it into
arrays allocated beforehand (every chunk read and BLAKE3-checked).
Prints the medians and their ratio."""

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import ckptstore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the store and bucket go (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        store = ckptstore.open(os.path.join(d, "store.ckpt"))
        remote = ckptstore.Remote(f"file://{d}/bucket")
        rng = np.random.default_rng(0)
        size = (args.mib << 20) // args.tensors
        # Odd lengths, so that every tensor ends in a tail of pieces.
        state = {f"w{i}": rng.integers(0, 255, size=size + 4099 * i, dtype=np.uint8) for i in range(args.tensors)}
        store.save(1, state)
        remote.push(store)
        into = {k: np.empty_like(v) for k, v in state.items()}
        push, read = [], []
        for rep in range(args.reps):
            step = rep + 2
            store.save(step, state)
            t = time.perf_counter()
            report = remote.push(store)
            push.append(time.perf_counter() - t)
            assert report.steps_pushed == [step] and report.bytes_uploaded < (1 << 20), report
            t = time.perf_counter()
            store.load(step, into=into)
            read.append(time.perf_counter() - t)
            assert all(np.array_equal(into[k], v) for k, v in state.items())
        p, r = statistics.median(push), statistics.median(read)
        print(f"step of {args.mib} MiB in {args.tensors} tensors, medians of {args.reps}:")
        print(f"  push of the step, every chunk in the bucket  {p:8.3f} s")
        print(f"  read and hash every byte of the step         {r:8.3f} s  ({r / p:.0f}x the push)")


if __name__ == "__main__":
    main()
