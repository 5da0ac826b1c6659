"""Worker processes that start without importing torch each time.

A multi-process test starts every rank as a process of its own; importing
torch, torch.distributed and DCP costs each about 2 s of CPU, which on a
small machine is most of what such a test takes. Here one forkserver
process (multiprocessing's) imports them once, and every rank is a fork of
it that runs its script as `__main__` with its own argv, environment,
working directory and output: still a process of its own (killed with
SIGKILL, exiting by `os._exit`, crashing), its exit code as a fresh
process's would be. The forkserver imports torch only: nothing that
reads the test's environment variables as it is imported (the ckptstore
package is imported by each rank).

A rank differs from `python script.py` in what runs after its script
ends: no atexit handlers nor C++ static destructors (multiprocessing
leaves by `os._exit`), and nothing Python reads from the environment as
it starts (PYTHONPATH, PYTHONFAULTHANDLER) applies. As with any
multiprocessing start method but fork, each rank first imports the
starting program's main module (pytest's, under pytest): a script that
starts ranks keeps its work under `if __name__ == "__main__":`.
"""

import atexit
import multiprocessing
import multiprocessing.util
import os
import runpy
import subprocess
import sys
import tempfile

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(
    [
        "numpy",
        "torch",
        "torch.distributed",
        "torch.distributed.checkpoint",
        "torch.distributed.device_mesh",
        "torch.distributed.tensor",
    ]
)


def _kill_the_rest():
    """Ranks still running as the tests end (left by a timeout) are
    killed: multiprocessing's own exit handler would wait for them.
    Registered after that handler (multiprocessing.util, imported above),
    so it runs before it."""
    for process in multiprocessing.active_children():
        process.kill()


atexit.register(_kill_the_rest)


def _main(script, args, env, cwd, out):
    """In the fork: the output to `out`, then `script` as `__main__`."""
    fd = os.open(out, os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


class Rank:
    """One started rank, read as a `subprocess.Popen` with its stdout and
    stderr merged into one text is: `communicate`, `returncode`, `kill`,
    `pid`."""

    def __init__(self, script, args, env):
        fd, self._out = tempfile.mkstemp(prefix="ckpt-rank-", suffix=".out")
        os.close(fd)
        self._process = _CONTEXT.Process(
            target=_main, args=(str(script), [str(a) for a in args], dict(env), os.getcwd(), self._out)
        )
        self._process.start()
        self.pid = self._process.pid
        self.returncode = None

    def communicate(self, timeout=None):
        """Wait for the rank to end; its output. Raises
        `subprocess.TimeoutExpired` if it runs past `timeout` seconds (the
        rank is left running, as `Popen.communicate` leaves it)."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        self.returncode = self._process.exitcode
        with open(self._out, encoding="utf-8", errors="replace") as f:
            text = f.read()
        os.unlink(self._out)
        return text, None

    def kill(self):
        self._process.kill()


def start(script, args, env):
    """Start `script` with `args` (sys.argv[1:]) and exactly the
    environment `env`, as a fork of the forkserver."""
    return Rank(script, args, env)
