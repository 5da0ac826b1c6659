"""A striped load's proofs (`stripes._proofs`): ranges of a bucket's step, their
proofs made by the reading rank's read (`read_proving`, Rust), checked by
`Checks` as a receiver gets them, in messages cut anywhere, against the
slices of the manifest it opened itself; a flipped byte anywhere in a
range's proof or bytes fails that range and no other."""

import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore.dcp.stripes import _plan as _fan_plan
from ckptstore.dcp.stripes import _proofs
from ckptstore.dcp import _bucket
from ckptstore.dcp import StorageWriter


def _stream(tmp_path):
    """A saved step's ranges (within a chunk, across two, a small entry in
    the packed chunk, a whole entry), their slices, and the stream a reader
    sends of them: each range's proof, then its bytes."""
    url = f"file://{tmp_path}/bucket"
    state = {"big": torch.arange(400_000, dtype=torch.float32), "small": torch.arange(10, dtype=torch.float32)}
    dcp.save(state, storage_writer=StorageWriter(url, 1))
    opened = _bucket.Bucket(url).open(1, None)
    entries = sorted(((opened.length(0, e), e) for e in opened._entries(0)), reverse=True)
    (n_big, big), small = entries[0], next(e for n, e in entries if n == 40)
    stripes = [(0, big, 0, n_big), (0, small, 0, 40)]
    ranges = [(0, big, 100, 5_000), (0, big, 1_048_300, 300), (0, small, 4, 20), (0, big, 0, n_big)]
    dest = {i: np.empty(s[3], dtype=np.uint8) for i, s in enumerate(stripes)}
    proofs = opened.read_proving(stripes, dest, ranges)
    slices = opened.slices(ranges)
    assert len(slices[1]) == 2 and len(slices[0]) == 1, slices  # across a chunk's end: two
    data = [dest[0 if r[1] == big else 1][r[2] : r[2] + r[3]] for r in ranges]
    parts = []
    for proof, bytes_ in zip(proofs, data):
        parts += [np.frombuffer(bytes(proof), dtype=np.uint8), bytes_.copy()]
    return ranges, slices, parts


def _check(ranges, slices, parts, size):
    """Feed the stream to `Checks` in messages of `size` bytes; the ranges
    that failed."""
    checks = _proofs.Checks(ranges, slices)
    lengths = _proofs.interleave(_proofs.proof_lens(slices), [r[3] for r in ranges])
    assert lengths == [len(p) for p in parts]
    for message in _fan_plan.cut(lengths, size):
        for i, at, n in message:
            part = parts[i][at : at + n]
            (checks.proof if i % 2 == 0 else checks.data)(i // 2, part)
    return checks.failed


@pytest.mark.parametrize("seed", range(4))
def test_ranges_check_out_in_messages_cut_anywhere_and_a_flipped_byte_fails_its_range(tmp_path, seed):
    ranges, slices, parts = _stream(tmp_path)
    rng = random.Random(seed)
    for size in (1, 77, 4096, rng.randrange(1, 1 << 20), 1 << 24):
        if size == 1 and seed:
            continue  # byte by byte once is enough
        assert _check(ranges, slices, parts, size) == set(), size
    # A flipped byte in a proof or in a range's bytes: that range fails.
    for _ in range(6):
        i = rng.choice([k for k, p in enumerate(parts) if len(p)])
        bad = [p.copy() for p in parts]
        bad[i][rng.randrange(len(bad[i]))] ^= 1
        assert _check(ranges, slices, bad, rng.randrange(1, 1 << 16)) == {i // 2}, i


def test_chunk_maps_sent_together_come_apart_as_sent_and_damage_is_said():
    from ckptstore.dcp.stripes._proofs import _framed, _unframed

    maps = [b"\x01" * 70, "no store here holds it", b""]
    sent = _framed(maps)
    assert _unframed(sent, 3) == maps
    # Cut short or with a bad kind byte: the maps from there on are refused.
    assert _unframed(sent[:-1] + b"", 3)[:2] == maps[:2]
    assert _unframed(sent[:50], 3)[0] == "the chunk maps sent arrived damaged"
    assert _unframed(b"\x07" + sent[1:], 3)[0] == "the chunk maps sent arrived damaged"
