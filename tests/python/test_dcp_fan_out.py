"""Striped loads (issue 51): at several ranks each byte is read from the
bucket once and handed to the ranks that need it. Real processes over
gloo on 127.0.0.1 (tests/python/dcp/worker.py): replicated, sharded and
resharded states load bit-identical; the bytes each rank asks of the
bucket are counted; a reading rank that fails or dies fails every rank
within the groups' timeout; bytes a reader hands on that do not hash to
the bucket's chunk hashes are refused by their receivers."""

import json
import os
import random
import time

import pytest

from ckptstore.dcp.stripes import _plan as _fan_plan
from test_dcp import run

# Stripes of one chunk: the 1.3 MB tensor takes several phases.
SMALL_STRIPES = {"CKPT_STRIPE_CHUNKS": "1"}


def _read(out):
    """The bytes each rank asked of the bucket, by rank."""
    return [int(next(l for l in text.splitlines() if l.startswith("read ")).split()[1]) for _, text in out]


def _formats(tmp_path, step):
    """The formats of the shard manifests of `step` in tmp_path/bucket."""
    folder = tmp_path / "bucket" / "shards" / f"{step:020}"
    return {json.loads((folder / name).read_text())["format"] for name in os.listdir(folder)}


def _read_once_by_four(target, step, env):
    """Load `step` of `target` (replicated) at four ranks, striped and
    not: without it every rank reads the whole step; with it the ranks
    read it once between them, spread over all four. The step's bytes."""
    striped = run("load", target, step, 4, env=env)
    alone = run("load", target, step, 4, env={**env, "CKPT_FAN_OUT": "0"})
    for out in (striped, alone):
        assert all(text.strip().endswith(f"ok {step}") for _, text in out), out
    per_rank = _read(alone)
    assert min(per_rank) == max(per_rank) > 6_300_000, per_rank
    whole = per_rank[0]
    assert sum(_read(striped)) <= 1.1 * whole, (_read(striped), whole)
    assert all(n > 0.15 * whole for n in _read(striped)), _read(striped)
    return whole


def test_a_replicated_state_is_read_once_and_handed_to_every_rank(tmp_path):
    url = f"file://{tmp_path}/bucket"
    # model.big of 6.3 MB: six chunks, six stripes for four ranks.
    env = {"CKPT_REPLICATE": "1", "CKPT_BIG_ROWS": "5280", **SMALL_STRIPES}
    run("save", url, 1, 4, env=env)
    _read_once_by_four(url, 1, env)


@pytest.mark.parametrize("world,compress", [(2, "0"), (3, "0"), (4, "0"), (3, "1")])
def test_sharded_and_resharded_loads_read_each_stored_byte_at_most_once(tmp_path, world, compress):
    url = f"file://{tmp_path}/bucket"
    run("save", url, 2, 4, env={**SMALL_STRIPES, "CKPT_COMPRESS": compress})
    assert _formats(tmp_path, 2) == {4 if compress == "1" else 3}
    out = run("load", url, 2, world, env=SMALL_STRIPES)
    assert all(text.strip().endswith("ok 2") for _, text in out), out
    # What one rank alone reads of the whole step bounds the bytes of all.
    whole = _read(run("load", url, 2, 1))[0]
    assert sum(_read(out)) <= whole, (_read(out), whole)


def test_a_local_store_is_read_once_between_the_ranks_that_load_it(tmp_path):
    path = tmp_path / "run.ckpt"
    env = {"CKPT_BIG_ROWS": "5280", **SMALL_STRIPES}
    run("save", path, 4, 1, env=env)  # a local store's step: one process
    step = _read_once_by_four(path, 4, {**env, "CKPT_REPLICATE": "1"})
    # Resharded (the step saved whole, loaded sharded at three ranks).
    resharded = run("load", path, 4, 3, env=env)
    assert all(text.strip().endswith("ok 4") for _, text in resharded), resharded
    assert sum(_read(resharded)) <= _read(run("load", path, 4, 1, env=env))[0] <= step


def _saved(tmp_path, kind, step, env):
    """A step saved into a bucket (4 ranks; "compressed": its chunks
    stored compressed, bucket format 4) or a local store (one process):
    its target."""
    if kind in ("bucket", "compressed"):
        target = f"file://{tmp_path}/bucket"
        run("save", target, step, 4, env={**env, "CKPT_COMPRESS": "1" if kind == "compressed" else "0"})
        # A shard with no chunk compressed (one that holds no replicated
        # tensor) stays format 3.
        assert (4 in _formats(tmp_path, step)) == (kind == "compressed")
    else:
        target = tmp_path / "run.ckpt"
        run("save", target, step, 1, env=env)
    return target


@pytest.mark.parametrize("how", ["CKPT_FAIL_IN_READ", "CKPT_DIE_IN_READ"])
@pytest.mark.parametrize("kind", ["bucket", "store"])
def test_a_reading_rank_that_fails_or_dies_fails_every_rank(tmp_path, how, kind):
    env = {"CKPT_REPLICATE": "1", **SMALL_STRIPES}
    target = _saved(tmp_path, kind, 3, env)
    started = time.monotonic()
    out = run("load", target, 3, 4, env={**env, how: "1", "CKPT_PG_TIMEOUT": "15"}, expect_ok=False)
    assert time.monotonic() - started < 120
    assert all(code != 0 for code, _ in out), [code for code, _ in out]
    assert not any("ok 3" in text for _, text in out)
    if how == "CKPT_FAIL_IN_READ":
        # Every rank raises, and the cause reaches them.
        assert all(f"injected: the {kind} failed this read" in text for _, text in out), out
    else:
        assert out[1][0] == 9


@pytest.mark.parametrize("kind", ["bucket", "compressed", "store"])
def test_bytes_a_reader_damaged_after_its_check_are_refused_by_every_rank(tmp_path, kind):
    # Rank 1 flips a byte of what it read once the target's hashes passed
    # it (a fault in its memory): the message's own BLAKE3 is taken after
    # the flip, so only the receivers' check against the target's chunk
    # hashes (the manifest each read itself) catches it. Every rank raises.
    # Compressed chunks are checked as their raw bytes, as read.
    env = {"CKPT_REPLICATE": "1", **SMALL_STRIPES}
    target = _saved(tmp_path, kind, 5, env)
    out = run("load", target, 5, 4, env={**env, "CKPT_FLIP_SENT": "1", "CKPT_PG_TIMEOUT": "15"}, expect_ok=False)
    assert all(code != 0 for code, _ in out), [code for code, _ in out]
    assert not any("ok 5" in text for _, text in out)
    assert all("do not hash to the target's chunk hashes" in text for _, text in out), out
    assert all("as read by rank 1" in text for _, text in out), out


def _covered(pieces):
    """Every (source, entry, byte) of `pieces`."""
    return {(src, entry, b) for src, entry, a, n in pieces for b in range(a, a + n)}


@pytest.mark.parametrize("restricted", [False, True], ids=["any-reader", "holders-only"])
@pytest.mark.parametrize("seed", range(20))
def test_the_plan_reads_each_byte_once_and_gives_each_rank_what_it_needs(seed, restricted, monkeypatch):
    # `restricted`: each shard may be read only by some ranks (the local
    # tier's holders of it), as `readers` says.
    monkeypatch.setattr(_fan_plan, "STRIPE", 64)
    monkeypatch.setattr(_fan_plan, "WINDOW", 48)
    monkeypatch.setattr(_fan_plan, "LEAST", 4)
    rnd = random.Random(seed)
    world = rnd.randint(2, 6)
    entries = [(rnd.randrange(world), f"e{i}", rnd.randint(1, 400)) for i in range(rnd.randint(1, 5))]
    needs = []
    for _ in range(world):
        mine = []
        for src, entry, length in rnd.sample(entries, rnd.randint(0, len(entries))):
            for _ in range(rnd.randint(1, 3)):
                a = rnd.randrange(length)
                mine.append((src, entry, a, rnd.randint(0, length - a)))
        needs.append(mine)
    readers = nodes = None
    if restricted:
        readers = {src: rnd.sample(range(world), rnd.randint(1, world)) for src in range(world)}
        nodes = [rank // rnd.randint(1, 2) for rank in range(world)]
    plans = _fan_plan.plan(needs, readers, nodes)
    assert len({len(p.phases) for p in plans}) == 1  # every rank, as many phases
    if readers is not None:
        for rank, p in enumerate(plans):
            assert all(rank in readers[s[0]] for ph in p.phases for s in ph.reads), (rank, readers)
    reads = [s for p in plans for ph in p.phases for s in ph.reads]
    read = [b for r in reads for b in sorted(_covered([r]))]
    assert len(read) == len(set(read)) == len(_covered([p for n in needs for p in n]))
    for stripe in reads:
        assert stripe[3] <= 64 and stripe[2] // 64 == (stripe[2] + stripe[3] - 1) // 64
    for rank, p in enumerate(plans):
        got = []
        for j, ph in enumerate(p.phases):
            got += ph.keep + [r for part in ph.takes for r in part.ranges]
            for part in ph.takes:  # what a peer sends in that phase, cut alike
                sent = plans[part.peer].phases[j].sends
                assert _fan_plan.Part(rank, part.ranges, part.size) in sent
                assert _covered(part.ranges) <= _covered(plans[part.peer].phases[j].reads)
        assert sorted(b for r in got for b in _covered([r])) == sorted(_covered(needs[rank]))
    # The bytes are spread: no rank reads more than its share and a stripe.
    loads = [sum(s[3] for ph in p.phases for s in ph.reads) for p in plans]
    assert all(sum(s[3] for s in ph.reads) <= 64 for p in plans for ph in p.phases)
    if readers is None:
        assert max(loads) <= len(read) // world + 2 * 64, loads
    # Bytes in transit: a rank's messages of a phase, each way, are at
    # most WINDOW between them (each stream's message at most its part's
    # size), unless LEAST bounds them.
    for p in plans:
        for ph in p.phases:
            for parts in (ph.sends, ph.takes):
                assert sum(min(part.size, sum(r[3] for r in part.ranges)) for part in parts) <= max(48, 4 * len(parts))


def test_a_stripe_no_rank_needing_it_holds_is_read_on_the_node_that_needs_it():
    # Two nodes of two ranks; rank 0's shard is held by rank 0 (node 0)
    # and by a copy at rank 2 (node 1); only rank 3 (node 1) needs it:
    # rank 2 reads it and hands it on within node 1. Without nodes known,
    # the least loaded holder reads it (rank 0, across the network).
    needs = [[], [], [], [(0, "e", 0, 100)]]
    readers = {0: [0, 2], 1: [1, 3], 2: [2, 0], 3: [3, 1]}
    for nodes, reader in (([0, 0, 1, 1], 2), (None, 0)):
        plans = _fan_plan.plan(needs, readers, nodes)
        assert [r for r, p in enumerate(plans) if any(ph.reads for ph in p.phases)] == [reader]
        assert [part.peer for ph in plans[3].phases for part in ph.takes] == [reader]
    # Needed on both nodes (ranks 3 and 4 on node 0, rank 0 on node 1),
    # held on both by ranks that do not need it: read on node 0.
    piece = (2, "e", 0, 100)
    needs = [[piece], [], [], [piece], [piece], []]
    plans = _fan_plan.plan(needs, {2: [1, 5]}, [1, 1, 1, 0, 0, 0])
    assert [r for r, p in enumerate(plans) if any(ph.reads for ph in p.phases)] == [5]


def test_a_plan_with_a_shard_no_rank_may_read_is_refused():
    with pytest.raises(ValueError, match="no rank may read rank 1's shard"):
        _fan_plan.plan([[(1, "e", 0, 10)], []], {0: [0], 1: []})


def test_a_striped_load_asks_garage_for_fewer_ranges():
    """Counted from Garage's log: the GETs of pack objects (the data) of a
    replicated load at four ranks, striped and not; and the bytes asked."""
    import os
    import uuid

    bucket, config = os.environ.get("CKPT_TEST_BUCKET"), os.environ.get("CKPT_GARAGE_CONFIG")
    if not bucket or not config:
        pytest.skip("no Garage (CKPT_TEST_BUCKET unset)")
    log = os.path.join(os.path.dirname(config), "server.log")
    prefix = f"fan-{uuid.uuid4().hex}"
    url = f"s3://{bucket}/{prefix}"
    env = {"CKPT_REPLICATE": "1", "CKPT_BIG_ROWS": "5280"}
    run("save", url, 1, 4, env=env)

    def pack_gets(fan_out):
        before = os.path.getsize(log)
        out = run("load", url, 1, 4, env={**env, "CKPT_FAN_OUT": fan_out})
        time.sleep(0.5)  # the server logs a request after it answers
        with open(log, "rb") as f:
            f.seek(before)
            lines = [l.decode("utf-8", "replace") for l in f.read().splitlines()]
        return out, [l for l in lines if prefix in l and ") GET " in l and "/packs/" in l]

    striped, ours = pack_gets("1")
    alone, theirs = pack_gets("0")
    assert sum(_read(striped)) <= 1.1 * _read(alone)[0]
    # Each rank alone asks for every range, in as few GETs as it can; a
    # striped load asks for each byte once, in GETs cut at its stripes
    # (14 against 24 for this 6.3 MB state of 6 chunks).
    assert ours and len(ours) < len(theirs), (len(ours), len(theirs))


def test_a_striped_load_holds_a_bounded_window_in_transit(tmp_path):
    """64 tensors of 64 KiB and one of 1.3 MB, replicated, at four ranks:
    each rank reads about a quarter and sends it to three. Bytes in
    transit are cut into messages that share WINDOW (256 KiB here), so a
    rank holds its reads and about two windows, not a message of its
    whole share per peer each way."""
    url = f"file://{tmp_path}/bucket"
    env = {"CKPT_REPLICATE": "1", "CKPT_MANY": "64", "CKPT_WINDOW": str(256 << 10)}
    run("save", url, 4, 4, env=env)
    out = run("load", url, 4, 4, env={**env, "CKPT_TRACE": "1"})
    assert all(text.strip().endswith("ok 4") for _, text in out), out
    peaks = [int(next(l for l in text.splitlines() if l.startswith("peak ")).split()[1]) for _, text in out]
    share = max(_read(out))
    assert all(peak <= share + 2 * (256 << 10) + (1 << 20) for peak in peaks), (peaks, share)


def test_a_local_stores_load_reads_the_save_it_opened_or_fails(tmp_path):
    """A load pins the save it opened by its content digest: a rank that
    opened another save, or a step saved again while it is read, fails
    with the reason, never mixing two saves."""
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptstore
    from ckptstore.dcp._local import LocalStore
    from ckptstore.dcp import StorageWriter

    path = tmp_path / "run.ckpt"
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=StorageWriter(path, 5), no_dist=True)
    with ckptstore.open(path, read_only=True) as store:
        (entry,) = store.info(5).tensors  # w's box
    target = LocalStore(path)
    opened = target.open(5, None)
    assert opened.length(0, entry) == 4000
    assert target.open(5, opened.commit).commit == opened.commit
    dcp.save({"w": torch.arange(1000.0) + 1}, storage_writer=StorageWriter(path, 5), no_dist=True)
    with pytest.raises(FileNotFoundError, match="saved again while this load opened it"):
        target.open(5, opened.commit)
    with pytest.raises(FileNotFoundError, match="removed or saved again while this load read it"):
        opened.read([(0, entry, 0, 16)], {}, lambda i, d: None, None)
