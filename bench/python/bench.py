"""Benchmark: `python bench/python/bench.py` (needs torch and safetensors).

For the state of a model built here (a stack of 2048x2048 linear layers
with AdamW moments, ~--mib MiB of --dtype), in one run, each contender
once per round in an order that rotates every round, --reps rounds,
medians with their spread (min-max):

- save: `ckptstore.torch.save` (chunks in pack files, the default, and
  with `pack_files=False`: in the redb file) against torch.save, safetensors'
  save_file and DCP's FileSystemWriter (no_dist), each followed by fsync,
  and a raw write+fsync of the same bytes; each into a new file, store or
  directory, each from a synced disk (`os.sync()` first);
- load into the model and optimizer (every byte read and placed):
  `ckptstore.torch.load` against torch.load + load_state_dict,
  safetensors' load_file + copies into place, DCP's FileSystemReader
  (in place) and a raw read straight into the tensors' memory; with the
  page cache warm (files just read) and dropped (`echo 3 >
  /proc/sys/vm/drop_caches`, when run as root; said when skipped);
- the next save with 90% of the tensors unchanged: bytes written.

Ratio = contender's time / ckptstore's (above 1: ckptstore is faster).
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch

import ckptstore
import ckptstore.torch as ct


def build(total_mib, dtype):
    """A stack of square linear layers with AdamW moments: ~total_mib MiB."""
    width = 2048
    layer_bytes = (width * width + width) * torch.empty((), dtype=dtype).element_size() * 3
    layers = max(2, round(total_mib * (1 << 20) / layer_bytes))
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


def fsync_path(path):
    """fsync a file, or every file of a directory, then its directory."""
    files = [os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path]
    for f in files + [os.path.dirname(path)]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def can_drop_caches():
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def rounds(reps, fns, before=None):
    """Each of `fns` once per round, the order rotating each round;
    `before()` runs (untimed) before each call. name -> list of seconds."""
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(reps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if before is not None:
                before()
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


class Contenders:
    """The files each contender writes in `workdir`, and how each saves and loads."""

    def __init__(self, model, opt, workdir, dtype):
        self.model, self.opt, self.dir, self.dtype = model, opt, workdir, dtype
        self.state = flat(model, opt)
        self.stores = []
        self.n = 0

    def _fresh(self, name):
        self.n += 1
        return os.path.join(self.dir, f"{name}-{self.n}")

    def tidy(self):
        """Untimed, before each save: close the store saved into, keep only
        the newest file of each contender, sync the disk."""
        for store in self.stores:
            store.close()
        self.stores = []
        for prefix in ("pt-", "st-", "dcp-", "raw-", "ckpt-", "ckptr-"):
            self.newest(prefix)
        os.sync()

    def newest(self, prefix):
        """The newest file of a contender, the others removed (a store's
        pack directory with it)."""
        old = sorted((p for p in os.listdir(self.dir) if p.startswith(prefix) and p[len(prefix):].isdigit()),
                     key=lambda p: int(p[len(prefix):]))
        for p in old[:-1]:
            for full in (os.path.join(self.dir, p), os.path.join(self.dir, p + ".packs")):
                if os.path.isdir(full):
                    shutil.rmtree(full)
                elif os.path.exists(full):
                    os.remove(full)
        return os.path.join(self.dir, old[-1]) if old else None

    def saves(self):
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file

        def torch_save():
            path = self._fresh("pt")
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, path)
            fsync_path(path)

        def st_save():
            path = self._fresh("st")
            save_file(self.state, path)
            fsync_path(path)

        def dcp_save():
            path = self._fresh("dcp")
            dcp.save({"model": self.model.state_dict(), "optim": self.opt.state_dict()},
                     storage_writer=dcp.FileSystemWriter(path), no_dist=True)
            fsync_path(path)

        def raw_save():
            path = self._fresh("raw")
            with open(path, "wb") as f:
                for t in self.state.values():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(path)

        def ct_save(name="ckpt", pack_files=True):
            store = ckptstore.open(self._fresh(name), pack_files=pack_files)
            self.stores.append(store)
            ct.save(store, 1, model=self.model, optimizer=self.opt)

        return {"ckptstore": ct_save, "ckptstore, chunks in redb": lambda: ct_save("ckptr", False),
                "torch.save": torch_save, "safetensors": st_save,
                "DCP FileSystem": dcp_save, "raw write+fsync": raw_save}

    def loads(self):
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import load_file

        self.tidy()
        paths = {k: self.newest(k + "-") for k in ("pt", "st", "dcp", "raw", "ckpt", "ckptr")}
        store = ckptstore.open(paths["ckpt"], read_only=True)
        in_redb = ckptstore.open(paths["ckptr"], read_only=True)
        model, opt = self.model, self.opt

        def torch_load():
            sd = torch.load(paths["pt"], weights_only=True)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])

        def st_load():
            restore_flat(model, opt, load_file(paths["st"]))

        def dcp_load():
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            dcp.load(state, storage_reader=dcp.FileSystemReader(paths["dcp"]), no_dist=True)

        def raw_load():
            with open(paths["raw"], "rb", buffering=0) as f:
                for t in self.state.values():
                    f.readinto(t.reshape(-1).view(torch.uint8).numpy().data)

        def ct_load(store=store):
            ct.load(store, model=model, optimizer=opt)

        fns = {"ckptstore": ct_load, "ckptstore, chunks in redb": lambda: ct_load(in_redb),
               "torch.load": torch_load, "safetensors": st_load,
               "DCP FileSystem": dcp_load, "raw read": raw_load}
        return fns, [store, in_redb]


def row(kind, name, secs, ours, mib):
    med = statistics.median(secs)
    ratio = "" if name == "ckptstore" else f"{med / statistics.median(ours):.2f}x"
    return f"| {kind}: {name} | {med:.3f} ({min(secs):.3f}-{max(secs):.3f}) | {mib / med:.0f} | {ratio} |"


def run(dtype, total_mib, reps, workdir):
    model, opt = build(total_mib, dtype)
    c = Contenders(model, opt, workdir, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in c.state.values())
    mib = nbytes / (1 << 20)
    out = [f"### {dtype}: {mib:.0f} MiB of state, {reps} rounds", "",
           "| operation | seconds: median (min-max) | MiB/s | ratio: theirs / ckptstore |", "|---|---|---|---|"]
    results = [("save", rounds(reps, c.saves(), before=c.tidy))]
    fns, stores = c.loads()
    for f in fns.values():
        f()  # warm the page cache with every file
    results.append(("load, warm", rounds(reps, fns)))
    if can_drop_caches():
        results.append(("load, cold", rounds(reps, fns, before=drop_caches)))
    for kind, times in results:
        out += [row(kind, name, secs, times["ckptstore"], mib) for name, secs in times.items()]
    if not can_drop_caches():
        out += ["", "Cold-cache loads skipped: dropping the page cache needs root."]
    for store in stores:
        store.close()

    # 90% unchanged: change the weights and moments of a tenth of the layers.
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for m in layers[: max(1, len(layers) // 10)]:
            for p in m.parameters():
                p.add_(1)
                for v in opt.state[p].values():
                    if v.dim() > 0:
                        v.add_(1)
    store = ckptstore.open(c.newest("ckpt-"))
    info = ct.save(store, 2, model=model, optimizer=opt)
    store.close()
    written = info.bytes_written / info.logical_bytes
    out += ["", f"Save with 90% of the tensors unchanged: {info.bytes_written / (1 << 20):.1f} MiB "
            f"written of {info.logical_bytes / (1 << 20):.0f} MiB ({100 * written:.1f}%), {info.seconds:.3f} s."]
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024, help="state size (MiB)")
    p.add_argument("--reps", type=int, default=5, help="rounds (medians)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    workdir = tempfile.mkdtemp(prefix="ckptstore-bench-", dir=args.dir)
    try:
        print(f"{os.cpu_count()} cores; writing in {workdir}", flush=True)
        print(run(getattr(torch, args.dtype), args.mib, args.reps, workdir), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
