"""What the Lightning and Trainer tests share: running a training script
in a process of its own, comparing final parameters bit for bit, and
holding a background save back."""

import os
import random
import subprocess
import sys
import threading

import torch


def run(script, *args, done, expect_kill=False):
    """Run `script` with `args`; it must print `done` (or, with
    `expect_kill`, die of SIGKILL)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    p = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                       timeout=300, env=env)
    if expect_kill:
        assert p.returncode == -9, p.stdout[-2000:] + p.stderr[-3000:]
    else:
        assert p.returncode == 0 and done in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def kill_point(low, high):
    """A random step in [low, high] and the seed that chose it (printed in
    a failure, to run it again)."""
    seed = random.randrange(1 << 30)
    return random.Random(seed).randint(low, high), seed


def assert_same_params(want_path, got_path, context):
    want, got = torch.load(want_path, weights_only=True), torch.load(got_path, weights_only=True)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k} differs ({context})"


def held(monkeypatch, owner, name):
    """Make method `name` of class `owner` wait until the returned event is
    set (a background save held back, so the caller's next move lands
    first)."""
    gate = threading.Event()
    real = getattr(owner, name)

    def wait_then(self, *args, **kwargs):
        assert gate.wait(30), "never released"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, wait_then)
    return gate
