"""Benchmark: `python -m ckptstore.bench` (needs torch and safetensors).

For the state of a model built here (f32 weights + AdamW moments, ~1 GiB;
then the same in bf16), in one run, medians of --reps rounds (each round runs every contender once):
- save: ckptstore.torch.save against torch.save + fsync and against
  safetensors.torch.save_file + fsync (each into a new file or store);
- load into the model and optimizer: ckptstore.torch.load against
  torch.load and safetensors.torch.load_file, each followed by
  load_state_dict (or a copy into the optimizer state, for safetensors'
  flat dict), so that every byte is read (files just written: page cache
  warm for all);
- the next save with 90% of the tensors unchanged: bytes written.
Ratios above 1.0 mean ckptstore is faster.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import ckptstore
import ckptstore.torch as ct


def build(total_mib, dtype):
    """A stack of square linear layers with AdamW moments: ~total_mib MiB."""
    width = 2048
    layer_bytes = (width * width + width) * torch.empty((), dtype=dtype).element_size() * 3
    layers = max(10, round(total_mib * (1 << 20) / layer_bytes))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def flat(model, opt):
    """One flat name -> tensor dict (what safetensors can store)."""
    out = {f"model/{k}": v for k, v in model.state_dict().items()}
    for pid, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            out[f"opt/{pid}/{k}"] = v
    return out


def restore_flat(model, opt, tensors):
    """Put a `flat` dict back into the model and the optimizer's state."""
    model.load_state_dict({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")})
    params = [p for g in opt.param_groups for p in g["params"]]
    with torch.no_grad():
        for name, v in tensors.items():
            if name.startswith("opt/"):
                _, pid, key = name.split("/")
                opt.state[params[int(pid)]][key].copy_(v)


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def medians(reps, fns):
    """The median time of each of `fns`, run in turn, `reps` rounds: the
    machine's noise falls on all of them alike."""
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def run(dtype, total_mib, reps, workdir):
    from safetensors.torch import load_file, save_file

    model, opt = build(total_mib, dtype)
    state = flat(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    torch_path = os.path.join(workdir, "state.pt")
    st_path = os.path.join(workdir, "state.safetensors")
    stores = []

    def torch_save():
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, torch_path)
        fsync_file(torch_path)

    def st_save():
        save_file(state, st_path)
        fsync_file(st_path)

    def ct_save():
        path = os.path.join(workdir, f"{dtype}-{len(stores)}.ckpt")
        store = ckptstore.open(path)
        stores.append((store, path))
        ct.save(store, 1, model=model, optimizer=opt)

    save = medians(reps, {"torch.save": torch_save, "safetensors": st_save, "ckptstore": ct_save})
    for store, path in stores[:-1]:
        store.close()
        os.remove(path)
    store = stores[-1][0]

    def torch_load():
        sd = torch.load(torch_path, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])

    def st_load():
        restore_flat(model, opt, load_file(st_path))

    def ct_load():
        ct.load(store, model=model, optimizer=opt)

    load = medians(reps, {"torch.load": torch_load, "safetensors": st_load, "ckptstore": ct_load})

    # 90% unchanged: change the weights and moments of a tenth of the layers.
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for m in layers[: max(1, len(layers) // 10)]:
            for p in m.parameters():
                p.add_(1)
                for v in opt.state[p].values():
                    if v.dim() > 0:
                        v.add_(1)
    info = ct.save(store, 2, model=model, optimizer=opt)
    store.close()
    return nbytes, save, load, info


def table(dtype, nbytes, save, load, info):
    mib = nbytes / (1 << 20)
    rows = [f"### {dtype}: {mib:.0f} MiB of state", "",
            "| operation | seconds (median) | MiB/s | ckptstore speed-up |", "|---|---|---|---|"]
    for kind, results in (("save", save), ("load", load)):
        ours = results["ckptstore"]
        for name, secs in results.items():
            ratio = "" if name == "ckptstore" else f"{secs / ours:.2f}x"
            rows.append(f"| {kind}: {name} | {secs:.3f} | {mib / secs:.0f} | {ratio} |")
    written = info.bytes_written / info.logical_bytes
    rows.append("")
    rows.append(f"Save with 90% of the tensors unchanged: {info.bytes_written / (1 << 20):.1f} MiB "
                f"written of {info.logical_bytes / (1 << 20):.0f} MiB ({100 * written:.1f}%), "
                f"{info.seconds:.3f} s.")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024, help="state size of the f32 model (MiB)")
    p.add_argument("--reps", type=int, default=5, help="runs per measurement (median)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="ckptstore-bench-", dir=args.dir)
    try:
        for dtype, mib in ((torch.float32, args.mib), (torch.bfloat16, args.mib // 2)):
            print(table(dtype, *run(dtype, mib, args.reps, workdir)), flush=True)
            print()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
