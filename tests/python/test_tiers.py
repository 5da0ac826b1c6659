"""ckptstore.dcp.Tiers with real processes: gloo on 127.0.0.1, 4 ranks as
2 nodes of 2 ranks with a local directory each (`node{node}`), a
directory bucket and the Garage server. Saves and loads bit-identical at
4 and 2 ranks; one node's processes killed in each phase of a save and the
job relaunched; a node's directory lost; a shard and its copy lost (the
bucket serves); an upload killed midway; a flipped byte; async_save."""

import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest

import ckptstore
import forked

WORKER = pathlib.Path(__file__).parent / "tiers" / "worker.py"


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(tmp, actions, world=4, bucket=None, env=None, expect_ok=True, per_node=2):
    """Run `world` ranks of the worker doing `actions`: (returncode, output)
    by rank."""
    port = _port() if world > 1 else 0
    local = f"{tmp}/node{{node}}"
    environ = {**os.environ, "CKPT_TIERS_PER_NODE": str(per_node), **(env or {})}
    procs = [forked.start(WORKER, [local, bucket or "-", r, world, port, *actions], environ) for r in range(world)]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, text))
    if expect_ok:
        for rank, (code, text) in enumerate(out):
            assert code == 0 and "done" in text.splitlines(), f"rank {rank} of {world} failed ({code}):\n{text[-3000:]}"
    return out


def said(out, line):
    return all(line in text.splitlines() for _, text in out)


@pytest.fixture(params=["dir", "garage"])
def bucket(request, tmp_path):
    if request.param == "dir":
        return f"file://{tmp_path}/bucket"
    name = os.environ.get("CKPT_TEST_BUCKET")
    if not name:
        pytest.skip("no Garage (CKPT_TEST_BUCKET unset)")
    return f"s3://{name}/tiers-{uuid.uuid4().hex}"


@pytest.fixture
def one_bucket(tmp_path):
    """Garage when it runs, else a directory bucket (for the longest test)."""
    name = os.environ.get("CKPT_TEST_BUCKET")
    return f"s3://{name}/tiers-{uuid.uuid4().hex}" if name else f"file://{tmp_path}/bucket"


def test_saved_at_4_loads_at_4_and_2_bit_identical(tmp_path):
    out = job(tmp_path, ["save:1", "save:2", "save:3", "load:3"])
    assert said(out, "ok 3")
    # Each node holds its ranks' stores and its peers' copies; the newest
    # keep_local=2 steps are kept.
    names = sorted(os.listdir(tmp_path / "node0"))
    assert [n for n in names if n.endswith(".ckpt")] == [
        "copies-of-00002.ckpt", "copies-of-00003.ckpt", "rank-00000.ckpt", "rank-00001.ckpt"
    ]
    with ckptstore.open(tmp_path / "node1" / "copies-of-00001.ckpt") as s:
        assert s.steps() == [2, 3]
    records = sorted(os.listdir(tmp_path / "node1" / "records"))
    assert records == [f"step-{s:020}.rank-{r:05}.json" for s in (2, 3) for r in (2, 3)]
    # At 2 ranks (a node of one rank each), resharded by DCP; and step 2.
    out = job(tmp_path, ["load:3", "load:2"], world=2, per_node=1)
    assert said(out, "ok 3") and said(out, "ok 2")


def test_one_process_keeps_no_copies_and_says_so(tmp_path):
    out = job(tmp_path, ["save:1", "load:1"], world=1, per_node=1)
    assert said(out, "ok 1")
    assert "a single node keeps no copies" in out[0][1]
    assert not [n for n in os.listdir(tmp_path / "node0") if n.startswith("copies-of")]


def newest(out):
    """The step every rank of a job said its first load restored ("ok S")."""
    got = {next(int(line.split()[1]) for line in text.splitlines() if line.startswith("ok ")) for _, text in out}
    assert len(got) == 1, got
    return got.pop()


def test_a_stateful_model_and_optimizer_save_and_load_in_one_process(tmp_path):
    # DCP's Stateful protocol: state_dict() at a save, load_state_dict()
    # after a load (no torch.distributed).
    import torch

    from ckptstore.dcp import Tiers

    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        return model, opt

    class Train:
        def __init__(self, model, opt):
            self.model, self.opt = model, opt

        def state_dict(self):
            return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

        def load_state_dict(self, state):
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])

    saved = Train(*make(1))
    with Tiers(tmp_path / "tier") as tiers:
        tiers.save({"train": saved}, 5)
    loaded = Train(*make(2))
    with Tiers(tmp_path / "tier") as tiers:
        assert tiers.load({"train": loaded}) == 5
    assert torch.equal(loaded.model.weight, saved.model.weight)
    assert torch.equal(loaded.opt.state_dict()["state"][0]["momentum_buffer"],
                       saved.opt.state_dict()["state"][0]["momentum_buffer"])


@pytest.mark.parametrize("phase", ["commit", "copy", "record"])
def test_a_node_killed_in_any_phase_of_a_save_leaves_a_whole_step(tmp_path, phase):
    out = job(tmp_path, ["save:1", "save:2"], env={"CKPT_TIERS_DIE": f"{phase}:2:1"}, expect_ok=False)
    assert all(code == -9 for code, _ in out[2:]), [code for code, _ in out]
    assert said(out[:2], "saved 1")
    assert not any("saved 2" in text for _, text in out[:2]) or phase == "record"
    # The job relaunched: the newest complete step is step 1, or, killed
    # while the other node wrote its records (every shard and copy was
    # durable), step 2; either is whole and bit-identical. The next save
    # works.
    out = job(tmp_path, ["load:any", "save:2", "load:2"])
    assert newest(out) == 1 if phase != "record" else newest(out) in {1, 2}
    assert said(out, "saved 2") and said(out, "ok 2")


def test_a_node_killed_at_random_moments_never_leaves_a_mixed_step(tmp_path):
    # Each round a job loads what the last one left, saves that step again
    # and dies in a save of the next (CKPT_LONG=1: more rounds).
    rounds = 12 if os.environ.get("CKPT_LONG") == "1" else 3
    rng = random.Random(40)
    job(tmp_path, ["save:1"])
    actions = ["save:2"]
    for i in range(rounds):
        phase = rng.choice(["commit", "copy", "record"])
        out = job(tmp_path, actions, env={"CKPT_TIERS_DIE": f"{phase}:{i + 2}:{rng.randrange(2)}"}, expect_ok=False)
        if i:
            assert newest(out) in {i, i + 1}, (phase, out)
        actions = ["load:any", f"save:{i + 2}", f"save:{i + 3}"]
    out = job(tmp_path, ["load:any"])
    assert newest(out) in {rounds, rounds + 1}


def test_a_lost_node_directory_is_restored_from_peer_copies(tmp_path):
    job(tmp_path, ["save:1", "save:2"])
    shutil.rmtree(tmp_path / "node1")
    out = job(tmp_path, ["load:2", "save:3", "load:3"])
    assert said(out, "ok 2") and said(out, "ok 3")
    # The fresh node holds its shards again, and its peers' copies.
    with ckptstore.open(tmp_path / "node1" / "rank-00002.ckpt") as s:
        assert s.steps() == [3]


def test_a_load_holds_its_share_and_a_bounded_window_whatever_it_serves(tmp_path):
    # 300 MiB a rank, node 1's directory lost: ranks 0 and 1 read their
    # own shards and serve ranks 2 and 3 theirs from their copies, in
    # pieces. Each rank's peak RSS during the load stays within what it
    # held as the load began (its share of the state, allocated) plus
    # 256 MiB: a shard served is never held whole.
    env = {"CKPT_TIERS_BIG_MIB": "300"}
    job(tmp_path, ["save:1"], env=env)
    shutil.rmtree(tmp_path / "node1")
    out = job(tmp_path, ["load:1"], env=env)
    for rank, (_, text) in enumerate(out):
        line = next(line for line in text.splitlines() if line.startswith("memory "))
        before, peak = map(int, line.split()[2:4])
        assert peak - before <= 256 << 20, f"rank {rank}: {(peak - before) >> 20} MiB over its share\n{text[-2000:]}"


def test_a_replicated_tensor_is_read_from_the_tier_once_and_handed_to_every_rank(tmp_path):
    # A 4 MiB replicated tensor, stored once (in one rank's shard): a load
    # at 4 ranks reads it from the local tier once, by a rank holding it,
    # which sends it to the others (summed over the ranks' store reads).
    env = {"CKPT_TIERS_REPLICATED_MIB": "4"}
    job(tmp_path, ["save:1"], env=env)
    out = job(tmp_path, ["load:1"], env=env)
    assert said(out, "ok 1")
    read = [int(line.split()[2]) for _, text in out for line in text.splitlines() if line.startswith("read 1 ")]
    assert len(read) == 4 and (4 << 20) <= sum(read) <= (4 << 20) + (64 << 10), read


def _refused_once(tmp_path, fault, env):
    """3 nodes of 1 rank, node 2's directory lost, rank 0 serving with
    `fault:FAULT:0`: every rank loads step 1; the one warning of a
    refused holder."""
    job(tmp_path, ["save:1"], world=3, per_node=1, env=env)
    shutil.rmtree(tmp_path / "node2")
    out = job(tmp_path, [f"fault:{fault}:0", "load:1"], world=3, per_node=1, env=env)
    assert said(out, "ok 1")
    warned = [line for line in out[0][1].splitlines() if "is refused" in line]
    assert len(warned) == 1, out[0][1][-3000:]
    return warned


def test_bytes_damaged_in_flight_are_refused_and_the_next_holder_serves(tmp_path):
    # 3 nodes of 1 rank, 2 copies of each shard; node 2's directory lost:
    # rank 0 streams rank 2's shard from its copy to the ranks reading it,
    # its first message damaged in flight (a byte flipped once its header
    # was made); the receiver's check against the shard's chunk hashes
    # refuses it and rank 1 serves the shard from its copy.
    warned = _refused_once(tmp_path, "wire", {"CKPT_TIERS_PEERS": "2"})
    assert "rank 2's shard of step 1 as held by rank 0 is refused (bytes " in warned[0], warned
    assert "do not hash to the target's chunk hashes); another holder serves it" in warned[0], warned


def test_bytes_a_holder_damaged_after_its_check_are_refused_and_the_next_holder_serves(tmp_path):
    # As above, but rank 0 flips a byte it is about to send once its
    # stores' check passed it (a fault in its memory): the message's own
    # BLAKE3 is taken after the flip, so only the receiver's check against
    # the shard's chunk map (sent by rank 0, taken for the record's content
    # digest) catches it. Rank 0 is refused for that shard; the load runs
    # again and every rank loads bit-identical. (A replicated 1 MiB tensor
    # in rank 0's shard: rank 0 reads it and hands it to ranks 1 and 2.)
    warned = _refused_once(tmp_path, "flip", {"CKPT_TIERS_PEERS": "2", "CKPT_TIERS_REPLICATED_MIB": "1"})
    assert "as held by rank 0 is refused" in warned[0], warned
    assert "do not hash to the target's chunk hashes" in warned[0], warned


def test_streams_are_cut_in_messages_of_a_bounded_size():
    from ckptstore.dcp.stripes._plan import LEAST, WINDOW, cut, message_size

    assert list(cut([5, 0, 3, 9], 4)) == [
        [(0, 0, 4)], [(0, 4, 1), (2, 0, 3)], [(3, 0, 4)], [(3, 4, 4)], [(3, 8, 1)]
    ]
    assert list(cut([], 4)) == [] and list(cut([0], 4)) == []
    assert message_size(1, 1) == WINDOW and message_size(4, 2) == WINDOW // 4
    assert message_size(100_000, 3) == LEAST


def test_a_shard_and_its_copies_lost_falls_back_to_the_bucket(tmp_path, bucket):
    # Every second save is uploaded: the bucket holds step 2, the local
    # tier steps 2 and 3.
    job(tmp_path, ["save:1", "save:2", "save:3"], bucket=bucket, env={"CKPT_TIERS_EVERY": "2"})
    assert ckptstore.Remote(bucket).steps() == [2]
    ckptstore.remove_store(tmp_path / "node0" / "rank-00001.ckpt")
    ckptstore.remove_store(tmp_path / "node1" / "copies-of-00001.ckpt")
    out = job(tmp_path, ["load:2"], bucket=bucket)
    assert said(out, "ok 2")
    assert "lacks every copy of the shards of ranks [1]" in out[0][1]
    assert f"loading step 2 from {bucket}" in out[0][1]
    # Without a bucket, the load says what is missing.
    out = job(tmp_path, ["load:any"], expect_ok=False)
    assert all(code != 0 for code, _ in out)
    assert "no step is whole on the local tier" in out[0][1]


def test_a_compressing_uploader_stores_format_4_that_loads_when_the_tier_is_lost(tmp_path):
    bucket = f"file://{tmp_path}/bucket"
    job(tmp_path, ["save:1"], bucket=bucket, env={"CKPT_TIERS_COMPRESS": "1"})
    folder = tmp_path / "bucket" / "shards" / f"{1:020}"
    formats = {json.loads((folder / name).read_text())["format"] for name in os.listdir(folder)}
    assert formats == {4}, formats
    for node in ("node0", "node1"):
        shutil.rmtree(tmp_path / node)
    out = job(tmp_path, ["load:1"], bucket=bucket)
    assert said(out, "ok 1")


def test_an_upload_killed_midway_is_finished_by_a_later_save(tmp_path, one_bucket):
    bucket = one_bucket
    job(tmp_path, ["save:1", "close"], bucket=bucket)
    out = job(tmp_path, ["save:2", "close"], bucket=bucket, env={"CKPT_TIERS_DIE": "upload:2:1"}, expect_ok=False)
    assert all(code == -9 for code, _ in out[2:])
    remote = ckptstore.Remote(bucket)
    assert remote.steps() == [1]
    out = job(tmp_path, ["load:2", "save:3", "close"], bucket=bucket)
    assert said(out, "ok 2")
    assert remote.steps() == [1, 2, 3]
    # Restored from the bucket alone, bit-identical.
    shutil.rmtree(tmp_path / "node0")
    shutil.rmtree(tmp_path / "node1")
    out = job(tmp_path, ["load:2", "load:3"], bucket=bucket)
    assert said(out, "ok 2") and said(out, "ok 3")


def test_a_flipped_byte_in_a_local_shard_is_refused_and_the_copy_serves(tmp_path):
    job(tmp_path, ["save:1"])
    packs = tmp_path / "node0" / "rank-00000.ckpt.packs"
    pack = max(packs.iterdir(), key=lambda p: p.stat().st_size)
    with open(pack, "r+b") as f:
        f.seek(pack.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    out = job(tmp_path, ["load:1"])
    assert said(out, "ok 1")
    assert "rank 0's shard of step 1 as held by rank 0 is refused" in out[0][1]


def test_async_save_saves_the_state_at_the_call(tmp_path):
    # Each later save reuses the staged copy of the one before it (done),
    # and a save still in flight keeps its own.
    out = job(tmp_path, ["async:1", "async:2", "load:2", "load:1", "asyncpair:3", "load:3", "load:4"],
              env={"CKPT_TIERS_KEEP": "4"})
    assert said(out, "ok 2") and said(out, "ok 1") and said(out, "ok 3") and said(out, "ok 4")


def costs(text):
    """The costs a rank printed: (step, blocked, staging, durable, new, deduplicated)."""
    return [
        (int(f[1]), float(f[2]), float(f[3]), float(f[4]), int(f[5]), int(f[6]))
        for f in (line.split() for line in text.splitlines() if line.startswith("cost "))
    ]


def test_every_save_reports_its_cost(tmp_path):
    out = job(tmp_path, ["save:1", "save:1", "async:2"])
    for rank, (_, text) in enumerate(out):
        (s1, b1, g1, d1, new1, dup1), (_, _, _, _, new2, dup2), (s3, b3, g3, d3, new3, _) = costs(text)
        assert s1 == 1 and s3 == 2
        # A save blocks until it is complete; an async save only to stage.
        assert g1 == 0 and b1 == d1 > 0
        assert 0 < b3 == g3 <= d3
        # Step 1 again: its tensors are found (small values are stored with
        # each step); step 2 changed them all.
        assert new1 > 4 << 20 and dup1 == 0, (rank, new1, dup1)
        assert new2 < 64 << 10 and dup2 >= new1 - (64 << 10), (rank, new2, dup2)
        assert new3 > 4 << 20


def test_ckpt_ls_lists_a_tier_directory(tmp_path, bucket):
    # Uploaded from each rank's store in Rust (Remote.write_shard of values
    # from Python, not of a StoreStep, refuses).
    job(tmp_path, ["save:1", "save:2", "close"], bucket=bucket, env={"CKPT_TIERS_RUST_UPLOAD": "1"})
    assert ckptstore.Remote(bucket).steps() == [1, 2]
    ckpt = os.environ.get("CKPT_BIN")
    if not ckpt:
        pytest.skip("CKPT_BIN unset")
    shown = subprocess.run([ckpt, "ls", str(tmp_path / "node0"), "--json"], check=True, capture_output=True, text=True)
    steps = json.loads(shown.stdout)
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[1]["ranks"] == [0, 1] and steps[1]["copies_of"] == [2, 3] and steps[1]["in_bucket"]
    # The cost of each save, over node 0's two ranks.
    cost = steps[1]["cost"]
    assert 0 < cost["blocked_seconds"] == cost["durable_seconds"] and cost["bytes_new"] > 8 << 20
    text = subprocess.run([ckpt, "ls", str(tmp_path / "node0")], check=True, capture_output=True, text=True).stdout
    assert "in bucket" in text and "durable s" in text


def test_background_staging_returns_before_the_copy_and_saves_the_state_at_staging(tmp_path, monkeypatch):
    import threading
    import warnings

    import torch

    from ckptstore import _staging
    from ckptstore.dcp import Tiers

    gate = threading.Event()
    real = _staging.copy_hashed
    monkeypatch.setattr(_staging, "copy_hashed", lambda src, dst: gate.wait(30) and real(src, dst))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiers = Tiers(f"{tmp_path}/node{{node}}", background_staging=True)
        live = {"w": torch.arange(100_000, dtype=torch.float32)}
        response = tiers.async_save(live, 1)
        assert not response.staging_completion.done()  # the copy waits on the gate
        gate.set()
        response.staging_completion.result(timeout=30)
        live["w"].add_(1000)
        cost = response.upload_completion.result(timeout=60)
        assert 0 <= cost.blocked_seconds < cost.staging_seconds <= cost.durable_seconds
        into = {"w": torch.zeros(100_000)}
        assert tiers.load(into, step=1) == 1 and torch.equal(into["w"], torch.arange(100_000, dtype=torch.float32))
        # A save right after an async one comes after it.
        second = tiers.async_save(live, 2)
        second.staging_completion.result(timeout=30)
        live["w"].zero_()
        assert tiers.save(live, 3).step == 3 and second.upload_completion.done()
        assert tiers.load(into, step=2) == 2 and torch.equal(into["w"], torch.arange(100_000, dtype=torch.float32) + 1000)
        tiers.close()


FIXTURE = pathlib.Path(__file__).parent.parent / "fixtures" / "tier-0.4.0"
MAKER = pathlib.Path(__file__).parent / "tiers" / "fixture.py"


def test_a_tier_directory_written_by_0_4_0_is_read(tmp_path):
    # Made by 0.4.0's Tiers (tiers/fixture.py make): 2 ranks as 2 nodes of
    # one, steps 2 and 3, step 3 marked in-bucket. Loaded at 2 ranks and at
    # one, bit-identical.
    shutil.copytree(FIXTURE, tmp_path / "tier")
    local = f"{tmp_path}/tier/node{{node}}"
    port = _port()
    procs = [forked.start(MAKER, ["check", local, r, 2, port, 3, 2], os.environ) for r in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, text in zip(procs, outs):
        assert p.returncode == 0 and text.splitlines()[:2] == ["ok 3", "ok 2"], text[-3000:]
    one = subprocess.run([sys.executable, str(MAKER), "check", local, "0", "1", "0", "3"], capture_output=True, text=True)
    assert one.returncode == 0 and one.stdout.splitlines() == ["ok 3"], one.stdout + one.stderr
    ckpt = os.environ.get("CKPT_BIN")
    if not ckpt:
        pytest.skip("CKPT_BIN unset")
    shown = subprocess.run([ckpt, "ls", str(FIXTURE / "node1"), "--json"], check=True, capture_output=True, text=True)
    steps = json.loads(shown.stdout)
    assert [(s["step"], s["ranks"], s["copies_of"], s["in_bucket"]) for s in steps] == [(2, [1], [0], False), (3, [1], [0], True)]


def oks(text):
    return [line for line in text.splitlines() if line.startswith("ok ")]


def test_a_save_that_returned_is_never_deleted_by_its_own_retention(tmp_path):
    # An old run saved steps 100-300; a new run in the same directory that
    # does not resume saves step 10: the saves made last are kept
    # (keep_local=2), whatever their step numbers, and load() takes the
    # save made last.
    job(tmp_path, ["save:100", "save:200", "save:300"])
    out = job(tmp_path, ["save:10", "load:10", "load:any", "save:20", "load:any", "load:10"])
    for _, text in out:
        assert oks(text) == ["ok 10", "ok 10", "ok 20", "ok 10"], text[-3000:]
    with ckptstore.open(tmp_path / "node1" / "rank-00003.ckpt") as s:
        assert s.steps() == [10, 20]
    with ckptstore.open(tmp_path / "node0" / "copies-of-00003.ckpt") as s:
        assert s.steps() == [10, 20]


def test_the_bucket_holds_a_newer_step_than_the_local_tier_can_restore(tmp_path, one_bucket):
    # An elastic job: steps 1-2 at 2 nodes, step 3 at 4 nodes (uploaded);
    # nodes 2 and 3 are lost, and with them every copy of rank 2's shard of
    # step 3. At 2 nodes the bucket's step 3 is restored, not step 2.
    job(tmp_path, ["save:1", "save:2", "close"], world=2, per_node=1, bucket=one_bucket)
    job(tmp_path, ["save:3", "close"], world=4, per_node=1, bucket=one_bucket)
    shutil.rmtree(tmp_path / "node2")
    shutil.rmtree(tmp_path / "node3")
    out = job(tmp_path, ["load:any", "load:2"], world=2, per_node=1, bucket=one_bucket)
    assert newest(out) == 3 and said(out, "ok 2")
    assert "step 3 on the local tier lacks every copy of the shards of ranks [2]" in out[0][1]
    assert f"loading step 3 from {one_bucket}" in out[0][1]


def test_any_exception_on_one_rank_fails_the_call_on_every_rank_and_the_tier_keeps_working(tmp_path):
    # A MemoryError on rank 1 while it reads the shard it serves, then while
    # it prepares the copies it sends, then as it writes its record (after
    # the collective that found the save durable): every rank's call raises
    # at once (not a gloo timeout nor a garbled collective; no rank returns
    # while another raises), and the same Tiers object loads and saves
    # again.
    out = job(tmp_path, ["save:1", "fault:load:1", "loadfails:1", "load:1",
                         "fault:save:1", "savefails:2", "save:2", "load:2",
                         "fault:record:1", "savefails:3", "save:4", "load:4"])
    for rank, (_, text) in enumerate(out):
        failed = [line for line in text.splitlines() if line.startswith("failed ")]
        assert [f.split()[1] for f in failed] == ["1", "2", "3"], text[-3000:]
        assert text.count("injected on rank 1") >= 3, text[-3000:]
        assert oks(text) == ["ok 1", "ok 2", "ok 4"], text[-3000:]


def test_any_exception_reading_a_chunk_map_fails_the_load_on_every_rank(tmp_path):
    # Node 2 lost: rank 0 serves rank 2's shard and sends its chunk map
    # first. A MemoryError as rank 0 reads that map fails the load on every
    # rank at once (before any map is sent: no rank waits for one), naming
    # it; the same Tiers object then loads.
    env = {"CKPT_TIERS_PEERS": "2"}
    job(tmp_path, ["save:1"], world=3, per_node=1, env=env)
    shutil.rmtree(tmp_path / "node2")
    started = time.monotonic()
    out = job(tmp_path, ["fault:map:0", "loadfails:1", "load:1"], world=3, per_node=1, env=env)
    assert time.monotonic() - started < 60
    for _, text in out:
        assert [l.split()[1] for l in text.splitlines() if l.startswith("failed ")] == ["1"], text[-3000:]
        assert "injected on rank 0" in text, text[-3000:]
        assert oks(text) == ["ok 1"], text[-3000:]


@pytest.mark.parametrize("replicated", [False, True], ids=["dtensors", "replicated"])
def test_a_rank_whose_staging_fails_fails_the_async_save_on_every_rank(tmp_path, replicated):
    # Issue 65: rank 1's staging copy of step 3 raises (a MemoryError, as
    # StagingBudgetError is). Every rank's save of step 3 raises at once,
    # naming it, and the ranks stay in step: the same Tiers saves step 4
    # and loads it, and a relaunch restores step 4 bit-identical, never a
    # step 3 of one rank's state paired with another's step. Before, rank 1
    # raised alone: rank 0 paired its save of step 3 with rank 1's of 4.
    env = {"CKPT_TIERS_REPLICATED_MIB": "1"} if replicated else {}
    started = time.monotonic()
    actions = ["save:1", "async:2", "fault:stage:1", "asyncfails:3", "async:4", "load:4"]
    out = job(tmp_path, actions, world=2, per_node=1, env=env)
    assert time.monotonic() - started < 90
    for _, text in out:
        assert [l.split()[1] for l in text.splitlines() if l.startswith("failed ")] == ["3"], text[-3000:]
        assert "injected on rank 1: staging" in text, text[-3000:]
        assert oks(text) == ["ok 4"], text[-3000:]
    out = job(tmp_path, ["load:any", "loadfails:3", "load:2"], world=2, per_node=1, env=env)
    for _, text in out:
        assert oks(text) == ["ok 4", "ok 2"], text[-3000:]


def test_ranks_at_different_steps_fail_together_rather_than_pair(tmp_path):
    # Issue 65: every collective of a save names its step. Ranks told
    # different steps raise on every rank at the first collective, and
    # the same Tiers then saves and loads in step.
    out = job(tmp_path, ["save:1", "skew:2", "save:3", "load:3"], world=2, per_node=1)
    for _, text in out:
        assert [l.split()[1] for l in text.splitlines() if l.startswith("failed ")] == ["2"], text[-3000:]
        assert "not at the same operation" in text, text[-3000:]
        assert oks(text) == ["ok 3"], text[-3000:]


def collective_bytes(tmp, world, tensors):
    """Bytes received through the tier's collectives: by rank 0 in the
    second save of the job (the one shard it copies is a plain rank's: the
    coordinator's holds DCP's metadata), and by rank 1 in its load (less
    DCP's metadata)."""
    out = job(tmp / f"w{world}-t{tensors}", ["save:1", "save:2", "load:2"], world=world, per_node=1,
              env={"CKPT_TIERS_TENSORS": str(tensors), "CKPT_TIERS_COUNT": "1"})
    counted = {}
    for rank in (0, 1):
        for line in out[rank][1].splitlines():
            if line.startswith("collective "):
                what, step, n = line.split()[1:4]
                counted[(rank, what, int(step))] = int(n)
    return counted[(0, "save", 2)], counted[(1, "load", 2)]


def test_collectives_carry_a_constant_per_rank_whatever_the_tensors(tmp_path):
    # Counted by wrapping torch.distributed in each rank (the tier's own
    # collectives, not DCP's planning nor the shards' bytes), at 2, 4 and
    # 8 ranks (nodes of one) with 48 and 480 sharded tensors of a constant
    # share per rank (and 16 ranks under CKPT_LONG=1). What a rank
    # receives per added rank is the same with
    # 10x the tensors: in a save a fixed 49-byte entry, in a load (beyond
    # DCP's metadata, which every rank's planner needs) a few bytes per
    # peer and what it holds.
    #
    # The one thing in a save that grows with the tensors is the header of
    # the shard rank 0 copies (its ring predecessor's, rank world - 1): its
    # entries' names carry each chunk's row offset, 128 * (world - 1), in
    # decimal, one byte more per tensor at each added digit (at 16 ranks).
    # That is taken off before comparing; nothing else may grow.
    sizes = [2, 4, 8, 16] if os.environ.get("CKPT_LONG") == "1" else [2, 4, 8]
    counted = {t: [collective_bytes(tmp_path, w, t) for w in sizes] for t in (48, 480)}
    digits = [len(str(128 * (w - 1))) - len(str(128)) for w in sizes]
    for i, what in enumerate(("save", "load")):
        got = {t: [c[i] for c in cs] for t, cs in counted.items()}
        if what == "save":
            got = {t: [b - t * d for b, d in zip(bs, digits)] for t, bs in got.items()}
        per_rank = {t: (b[-1] - b[0]) / (sizes[-1] - sizes[0]) for t, b in got.items()}
        print(what, "bytes by world size", got, "per added rank", per_rank)
        assert per_rank[48] == per_rank[480] and 0 < per_rank[48] <= 1024, (what, got, per_rank)
        # What grows with the tensors (that header) does not grow with the
        # world.
        assert len({got[480][j] - got[48][j] for j in range(len(sizes))}) == 1, (what, got)


@pytest.mark.skipif(os.environ.get("CKPT_LONG") != "1", reason="16 processes: CKPT_LONG=1")
def test_16_ranks_as_8_nodes_of_2_save_lose_a_node_and_load(tmp_path):
    out = job(tmp_path, ["save:1", "save:2", "load:2"], world=16, per_node=2)
    assert said(out, "ok 2")
    shutil.rmtree(tmp_path / "node5")
    out = job(tmp_path, ["load:2", "save:3", "load:3"], world=16, per_node=2)
    assert said(out, "ok 2") and said(out, "ok 3")
