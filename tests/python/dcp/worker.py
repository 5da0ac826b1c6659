"""One rank of a DCP save or load through ckptstore.dcp (run by
test_dcp.py as WORLD processes over gloo on 127.0.0.1).

    python worker.py save|save_local|save_again|async_save[_process|_local]|load TARGET STEP RANK WORLD PORT [SALT]

save_local saves in DCP's rank-local mode (use_collectives=False); saves
in that mode and loads print "collectives [...]", the torch.distributed
calls the process made (DCP's and ckptstore's).

WORLD 1 with PORT 0 runs without a process group (DCP's no_dist). The
state is a function of SALT (default 0), so a loader knows every byte to
expect; a load prints "ok <step>" when every tensor and value is
bit-identical to it. CKPT_DIE_BEFORE_SAVE=R kills rank R before it
saves; CKPT_DIE_AFTER_SHARD=R right after its shard of a rank-local save
is in the bucket (the step's commit too, if it found every shard there);
CKPT_DIE_AFTER_WRITE=R kills rank R (os._exit) right
after its data is written, before the coordinator's finish.
CKPT_TRACE_SHARDS=1 prints "upload <kind>" at each shard write,
"commit announced" after the one whose announcement completed its save,
and "commit reported=<bool>" at each commit of names.

CKPT_BIG_ROWS=N gives model.big N rows (1100: 1.3 MB, two chunks).
CKPT_PER_RANK=1 adds a plain tensor `own.<rank>` that only that rank
holds (a load checks its own).
Loads: CKPT_REPLICATE=1 places every tensor Replicate (saves too);
CKPT_FAN_OUT=0 loads with fan_out=False; CKPT_LOAD_GROUP=1 with
process_group=dist.group.WORLD (a load prints "metadata [...]", the
ranks whose rank-local metadata it read); CKPT_RANK_LOCAL=0 with
rank_local=False; CKPT_STRIPE_CHUNKS=N cuts a striped load's stripes at N chunks; a load prints "read <bytes>", what
the rank asked of the bucket or the local store. CKPT_DIE_IN_READ=R kills rank R at its
first read of the bucket or of the store's state, CKPT_FAIL_IN_READ=R
makes it raise there; CKPT_FLIP_SENT=R makes rank R flip a byte of each
phase's stripes once it has read and checked them (a fault in its
memory), before it hands them on;
CKPT_PG_TIMEOUT=S is the groups' timeout in seconds (default 60).
CKPT_MANY=N adds N tensors of 64 KiB; CKPT_WINDOW=B sets the bytes a
striped load has in transit each way (stripes._plan.WINDOW); with
CKPT_TRACE=1 a load prints "peak <bytes>", the most memory Python and
numpy held during dcp.load (tracemalloc; tensors are torch's, not
counted).
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ckptstore.dcp import StorageReader, StorageWriter

# A collective that waits longer than this fails the rank: a hang ends
# the test in a minute, not in the default 30.
TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("CKPT_PG_TIMEOUT", "60")))

# A load traces Python's memory (CKPT_TRACE=1): tracemalloc is never
# stopped, since on CPython before 3.12.9 a gloo thread that takes the GIL
# to drop a tensor while tracemalloc.stop() runs can crash the process
# (cpython gh-128679); a traced worker leaves with os._exit so that
# finalization does not stop it either.
TRACE = os.environ.get("CKPT_TRACE") == "1"

# (global shape, dtype, placement): Shard(0), Shard(1) and sizes the world
# sizes do not divide, Replicate, bf16 and int64, one tensor of several
# chunks (1 MiB chunks).
SPECS = {
    "model.a": ((10, 6), torch.float32, "shard0"),
    "model.b": ((5, 9), torch.bfloat16, "shard1"),
    "model.c": ((7,), torch.int64, "replicate"),
    "model.big": ((int(os.environ.get("CKPT_BIG_ROWS", "1100")), 300), torch.float32, "shard0"),
    "optim.step": ((), torch.float32, "plain"),
}
SPECS.update({f"many.{i}": ((16384,), torch.float32, "shard0") for i in range(int(os.environ.get("CKPT_MANY", "0")))})


def full(name, salt):
    shape, dtype, _ = SPECS[name]
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, dtype=torch.float64) * 0.5 + salt + len(name)
    return base.reshape(shape).to(dtype)


def state(mesh, salt, empty):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    for name, (shape, dtype, how) in SPECS.items():
        t = torch.zeros(shape, dtype=dtype) if empty else full(name, salt)
        if os.environ.get("CKPT_REPLICATE") == "1" and how != "plain":
            how = "replicate"
        if mesh is None or how == "plain":
            out[name] = t
        else:
            placement = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[how]
            out[name] = distribute_tensor(t, mesh, [placement])
    out["extra"] = {"epoch": None if empty else 3 + salt, "name": None if empty else f"run-{salt}"}
    if os.environ.get("CKPT_PER_RANK") == "1":
        rank = dist.get_rank() if dist.is_initialized() else 0
        out[f"own.{rank}"] = torch.zeros(257) if empty else own(rank, salt)
    return out


def own(rank, salt):
    """A plain tensor only rank `rank` holds (CKPT_PER_RANK=1)."""
    return torch.arange(257, dtype=torch.float32) + rank * 1000 + salt


# Whose rank-local metadata this rank read (printed "metadata [...]").
METADATA_READS = []


def count_reads(rank):
    """Count the bytes this rank asks of the bucket or the local store
    (into a one-item list),
    and die or fail at its first read where the environment says."""
    import ckptstore
    import ckptstore.dcp.stripes._run
    import ckptstore.dcp.stripes._plan
    from ckptstore._ckptstore import CHUNK_BYTES, DCP_RANK_METADATA

    if os.environ.get("CKPT_STRIPE_CHUNKS"):
        ckptstore.dcp.stripes._plan.STRIPE = int(os.environ["CKPT_STRIPE_CHUNKS"]) * CHUNK_BYTES
    read = [0]
    die = os.environ.get("CKPT_DIE_IN_READ") == str(rank)
    fail = os.environ.get("CKPT_FAIL_IN_READ") == str(rank)
    if os.environ.get("CKPT_FLIP_SENT") == str(rank):
        read_stripes = ckptstore.dcp.stripes._run._Read.__init__

        def flipped(self, *args, _original=read_stripes):
            _original(self, *args)
            if len(self.data):
                self.data[len(self.data) // 2] ^= 1

        ckptstore.dcp.stripes._run._Read.__init__ = flipped
    for name in ("read_pieces", "read_pieces_into", "read_pieces_proving"):
        original = getattr(ckptstore.Remote, name)

        def counted(self, opened, pieces, *rest, _original=original):
            if die:
                os._exit(9)
            if fail:
                raise OSError("injected: the bucket failed this read")
            read[0] += sum(p[3] for p in pieces)
            METADATA_READS.extend(p[0] for p in pieces if p[1] == DCP_RANK_METADATA)
            return _original(self, opened, pieces, *rest)

        setattr(ckptstore.Remote, name, counted)
    # Whose shard manifests this rank reads (printed "shards [...]").
    entries = ckptstore.Remote.entries

    def counted_entries(self, opened, of, _original=entries):
        read.append(of)
        return _original(self, opened, of)

    ckptstore.Remote.entries = counted_entries
    from ckptstore.dcp._targets import METADATA

    for name in ("read_ranges", "read_ranges_proving"):
        original = getattr(ckptstore.Store, name)

        def counted_ranges(self, step, reads, *rest, _original=original, **kwargs):
            state = any(name != METADATA for name, _, _ in reads)  # not the opening's
            if die and state:
                os._exit(9)
            if fail and state:
                raise OSError("injected: the store failed this read")
            read[0] += sum(a.nbytes for name, _, a in reads if name != METADATA)  # the state's bytes
            return _original(self, step, reads, *rest, **kwargs)

        setattr(ckptstore.Store, name, counted_ranges)
    return read


def count_collectives():
    """The collectives this process makes from now on, by name (into a
    list), DCP's and ckptstore's: every torch.distributed call that
    sends."""
    calls = []
    for name in (
        "all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list", "all_reduce",
        "all_gather", "broadcast", "gather", "scatter", "all_to_all", "send", "recv", "barrier", "new_group",
        "monitored_barrier", "reduce_scatter", "all_gather_into_tensor", "reduce_scatter_tensor",
    ):
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return calls


def main():
    mode, target, step, rank, world, port = sys.argv[1:7]
    salt = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    step, rank, world, port = int(step), int(rank), int(world), int(port)
    mesh = None
    if port:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=TIMEOUT
        )
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    die = os.environ.get("CKPT_DIE_AFTER_WRITE")
    if die is not None and int(die) == rank:
        original = StorageWriter.write_data

        def write_then_die(self, plan, planner):
            fut = original(self, plan, planner)
            fut.wait()
            os._exit(9)

        StorageWriter.write_data = write_then_die
    die = os.environ.get("CKPT_DIE_BEFORE_SAVE")
    if die is not None and int(die) == rank:
        os._exit(9)
    if os.environ.get("CKPT_TRACE_SHARDS") == "1":
        # Print each shard write's kind and each commit of names, as made.
        import ckptstore

        traced_write, traced_commit = ckptstore.Remote.write_shard, ckptstore.Remote.commit_global

        def write_traced(self, shard, upload, source, announce=None):
            print(f"upload {type(upload).__name__}", flush=True)
            info = traced_write(self, shard, upload, source, announce)
            if announce is not None and info.complete:
                print("commit announced", flush=True)
            return info

        def commit_traced(self, step, shards, *, reported=False):
            print(f"commit reported={reported}", flush=True)
            return traced_commit(self, step, shards, reported=reported)

        ckptstore.Remote.write_shard = write_traced
        ckptstore.Remote.commit_global = commit_traced
    die = os.environ.get("CKPT_DIE_AFTER_SHARD")
    if die is not None and int(die) == rank:
        import ckptstore

        original_write = ckptstore.Remote.write_shard

        def commit_then_die(self, shard, upload, source, announce=None):
            if announce is not None:
                # Dies once its shard landed, before telling the others.
                def die_instead(name):
                    os._exit(9)

                return original_write(self, shard, upload, source, die_instead)
            original_write(self, shard, upload, source)
            if isinstance(upload, (ckptstore.ShardUpload.RankLocal, ckptstore.ShardUpload.RankLocalShard)):
                os._exit(9)

        ckptstore.Remote.write_shard = commit_then_die
    if mode == "save":
        # CKPT_COMPRESS=1: a bucket's chunks stored compressed (format 4).
        compress = True if os.environ.get("CKPT_COMPRESS") == "1" else None
        dcp.save(state(mesh, salt, empty=False), storage_writer=StorageWriter(target, step, compress=compress))
        print("saved", flush=True)
    elif mode == "save_local":
        # DCP's rank-local mode (a local store refuses it at several ranks).
        saved = state(mesh, salt, empty=False)
        calls = count_collectives()
        try:
            writer = StorageWriter(target, step)
            dcp.save(saved, storage_writer=writer, use_collectives=False)
        except Exception as e:  # noqa: BLE001 - the test reads it
            print(f"failed {type(e).__name__}: {e}", flush=True)
        print(f"collectives {sorted(calls)}", flush=True)
        if os.environ.get("CKPT_TRACE_SHARDS") == "1" and getattr(writer, "_save", None):
            # The save's keys in the job's store, once every rank is done:
            # the rank that committed deleted them.
            dist.barrier()
            store = dist.distributed_c10d._get_default_store()
            keys = [f"ckptstore/rank-local/landed/{writer._save}/{k}" for k in [*range(world), "count"]]
            print(f"keys left {any(store.check([k]) for k in keys)}", flush=True)
        print("saved", flush=True)
    elif mode == "save_again":
        # Steps STEP and STEP + 1 of the same state in one process; rank 0
        # prints the size of the S3 server's log (CKPT_SERVER_LOG) around
        # the second save, for the test to count its requests.
        log = os.environ["CKPT_SERVER_LOG"]
        dcp.save(state(mesh, salt, empty=False), storage_writer=StorageWriter(target, step))
        if mesh is not None:
            dist.barrier()
        before = os.path.getsize(log)
        dcp.save(state(mesh, salt, empty=False), storage_writer=StorageWriter(target, step + 1))
        if mesh is not None:
            dist.barrier()
        time.sleep(0.5)  # the server logs a request after it answers
        if rank == 0:
            print(f"log {before} {os.path.getsize(log)}", flush=True)
        print("saved", flush=True)
    elif mode in ("async_save", "async_save_process", "async_save_local", "async_save_local_process"):
        kwargs = {"use_collectives": False} if mode.startswith("async_save_local") else {}
        if mode.endswith("_process"):
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        fut = dcp.async_save(
            state(mesh, salt, empty=False), storage_writer=StorageWriter(target, step), **kwargs
        )
        fut.result()
        if rank == 0:
            import ckptstore

            # Listed once the future resolves.
            listed = ckptstore.Remote(target).steps()
            print(f"listed {listed}", flush=True)
        print("saved", flush=True)
    else:
        # Small batches, so that a load takes many (the default is 64 MiB).
        import ckptstore.dcp._targets

        ckptstore.dcp._targets.BATCH_BYTES = 256 << 10
        if os.environ.get("CKPT_WINDOW"):
            import ckptstore.dcp.stripes._plan

            ckptstore.dcp.stripes._plan.WINDOW = int(os.environ["CKPT_WINDOW"])
        read = count_reads(rank)
        loaded = state(mesh, salt, empty=True)
        fan_out = os.environ.get("CKPT_FAN_OUT") != "0"
        rank_local = os.environ.get("CKPT_RANK_LOCAL") != "0"
        group = dist.group.WORLD if os.environ.get("CKPT_LOAD_GROUP") == "1" and port else None
        reader = StorageReader(
            target, None if step < 0 else step, fan_out=fan_out, timeout=TIMEOUT, rank_local=rank_local,
            process_group=group,
        )
        if TRACE:
            import tracemalloc

            tracemalloc.start()
        calls = count_collectives()
        try:
            dcp.load(loaded, storage_reader=reader)
        except Exception as e:  # noqa: BLE001 - the test reads it
            print(f"failed {type(e).__name__}: {e}", flush=True)
            raise
        print(f"collectives {sorted(calls)}", flush=True)
        if TRACE:
            print(f"peak {tracemalloc.get_traced_memory()[1]}", flush=True)
        print(f"read {read[0]}", flush=True)
        print(f"shards {sorted(set(read[1:]))}", flush=True)
        print(f"metadata {sorted(METADATA_READS)}", flush=True)
        for name in SPECS:
            t = loaded[name]
            got = t.full_tensor() if hasattr(t, "full_tensor") else t
            want = full(name, salt)
            if got.dtype != want.dtype or not torch.equal(got.view(-1).view(torch.uint8) if got.numel() else got, want.view(-1).view(torch.uint8) if want.numel() else want):
                print(f"MISMATCH {name}", flush=True)
                sys.exit(3)
        if os.environ.get("CKPT_PER_RANK") == "1" and not torch.equal(loaded[f"own.{rank}"], own(rank, salt)):
            print(f"MISMATCH own.{rank}", flush=True)
            sys.exit(3)
        if loaded["extra"] != {"epoch": 3 + salt, "name": f"run-{salt}"}:
            print(f"MISMATCH extra {loaded['extra']}", flush=True)
            sys.exit(3)
        print(f"ok {reader.step}", flush=True)
    if port:
        dist.destroy_process_group()
    if TRACE:
        os._exit(0)


if __name__ == "__main__":
    main()
