"""Striped loads (issue 51): at several ranks each byte is read from the
bucket once and handed to the ranks that need it. Real processes over
gloo on 127.0.0.1 (tests/python/dcp/worker.py): replicated, sharded and
resharded states load bit-identical; the bytes each rank asks of the
bucket are counted; a reading rank that fails or dies fails every rank
within the groups' timeout."""

import random
import time

import pytest

from ckptstore import _fan_out
from test_dcp import run

# Stripes of one chunk: the 1.3 MB tensor takes several phases.
SMALL_STRIPES = {"CKPT_STRIPE_CHUNKS": "1"}


def _read(out):
    """The bytes each rank asked of the bucket, by rank."""
    return [int(next(l for l in text.splitlines() if l.startswith("read ")).split()[1]) for _, text in out]


def test_a_replicated_state_is_read_once_and_handed_to_every_rank(tmp_path):
    url = f"file://{tmp_path}/bucket"
    # model.big of 6.3 MB: six chunks, six stripes for four ranks.
    env = {"CKPT_REPLICATE": "1", "CKPT_BIG_ROWS": "5280", **SMALL_STRIPES}
    run("save", url, 1, 4, env=env)
    striped = run("load", url, 1, 4, env=env)
    alone = run("load", url, 1, 4, env={**env, "CKPT_FAN_OUT": "0"})
    for out in (striped, alone):
        assert all(text.strip().endswith("ok 1") for _, text in out), out
    per_rank = _read(alone)
    # Without it, every rank reads the whole step; with it, the ranks
    # read it once between them, spread over all four.
    assert min(per_rank) == max(per_rank) > 6_300_000, per_rank
    step = per_rank[0]
    assert sum(_read(striped)) <= 1.1 * step, (_read(striped), step)
    assert all(n > 0.15 * step for n in _read(striped)), _read(striped)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_and_resharded_loads_read_each_stored_byte_at_most_once(tmp_path, world):
    url = f"file://{tmp_path}/bucket"
    run("save", url, 2, 4, env=SMALL_STRIPES)
    out = run("load", url, 2, world, env=SMALL_STRIPES)
    assert all(text.strip().endswith("ok 2") for _, text in out), out
    # What one rank alone reads of the whole step bounds the bytes of all.
    whole = _read(run("load", url, 2, 1))[0]
    assert sum(_read(out)) <= whole, (_read(out), whole)


@pytest.mark.parametrize("how", ["CKPT_FAIL_IN_READ", "CKPT_DIE_IN_READ"])
def test_a_reading_rank_that_fails_or_dies_fails_every_rank(tmp_path, how):
    url = f"file://{tmp_path}/bucket"
    env = {"CKPT_REPLICATE": "1", **SMALL_STRIPES}
    run("save", url, 3, 4, env=env)
    started = time.monotonic()
    out = run("load", url, 3, 4, env={**env, how: "1", "CKPT_PG_TIMEOUT": "15"}, expect_ok=False)
    assert time.monotonic() - started < 120
    assert all(code != 0 for code, _ in out), [code for code, _ in out]
    assert not any("ok 3" in text for _, text in out)
    if how == "CKPT_FAIL_IN_READ":
        # Every rank raises, and the cause reaches them.
        assert all("injected: the bucket failed this read" in text for _, text in out), out
    else:
        assert out[1][0] == 9


def _covered(pieces):
    """Every (source, entry, byte) of `pieces`."""
    return {(src, entry, b) for src, entry, a, n in pieces for b in range(a, a + n)}


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_reads_each_byte_once_and_gives_each_rank_what_it_needs(seed, monkeypatch):
    monkeypatch.setattr(_fan_out, "STRIPE", 64)
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
    plans = _fan_out.plan(needs)
    assert len({len(p.phases) for p in plans}) == 1  # every rank, as many phases
    reads = [s for p in plans for ph in p.phases for s in ph.reads]
    read = [b for r in reads for b in sorted(_covered([r]))]
    assert len(read) == len(set(read)) == len(_covered([p for n in needs for p in n]))
    for stripe in reads:
        assert stripe[3] <= 64 and stripe[2] // 64 == (stripe[2] + stripe[3] - 1) // 64
    for rank, p in enumerate(plans):
        got = []
        for j, ph in enumerate(p.phases):
            got += ph.keep + [r for _, rs in ph.takes for r in rs]
            for peer, rs in ph.takes:  # what a peer sends in that phase
                assert (rank, rs) in plans[peer].phases[j].sends and _covered(rs) <= _covered(plans[peer].phases[j].reads)
        assert sorted(b for r in got for b in _covered([r])) == sorted(_covered(needs[rank]))
    # The bytes are spread: no rank reads more than its share and a stripe.
    loads = [sum(s[3] for ph in p.phases for s in ph.reads) for p in plans]
    assert all(sum(s[3] for s in ph.reads) <= 64 for p in plans for ph in p.phases)
    assert max(loads) <= len(read) // world + 2 * 64, loads


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
