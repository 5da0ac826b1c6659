"""Work off the caller's thread, in order, for the async saves of
`ckptstore.lightning` and `ckptstore.transformers`: a save first waits
for the work in flight and raises its failure (once); lighter work (a
removal after a save) is queued behind it without waiting. `Running`
(work in flight whose failures a later call raises) serves `Tiers` too."""

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, List, Optional, TypeVar

T = TypeVar("T")


class Running:
    """Futures of work in flight, in the order it started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: List["Future[Any]"] = []

    def add(self, fut: "Future[Any]") -> None:
        with self._lock:
            self._futures.append(fut)

    def forget(self, fut: "Future[Any]") -> None:
        """Drop `fut`, whose failure its caller raises."""
        with self._lock:
            self._futures = [f for f in self._futures if f is not fut]

    def check(self) -> None:
        """Forget finished work; raise the first failure among it."""
        with self._lock:
            done = [f for f in self._futures if f.done()]
            self._futures = [f for f in self._futures if not f.done()]
        for f in done:
            e = f.exception()
            if e is not None:
                raise e

    def take(self) -> List["Future[Any]"]:
        """All of it, forgotten here."""
        with self._lock:
            taken, self._futures = self._futures, []
        return taken

    def wait(self) -> None:
        """Wait for all of it, work it starts included; raise the first
        failure."""
        while True:
            with self._lock:
                first = self._futures[0] if self._futures else None
            if first is None:
                return
            first.exception()
            self.check()


class Background:
    """A thread of its own (started on first use) running the work given
    to it in order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._executor: Optional[ThreadPoolExecutor] = None
        self._queued = Running()
        self._lock = threading.Lock()

    def wait(self) -> None:
        """Wait for all work given; raise the first failure among it (then
        forget it: a failure is raised once)."""
        failure: Optional[BaseException] = None
        for fut in self._queued.take():
            e = fut.exception()
            failure = failure or e
        if failure is not None:
            raise failure

    def submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        """Run `fn(*args)` on the thread once all work before it is done
        (a failure of that work is raised here, and `fn` is not run)."""
        self.wait()
        return self.then(fn, *args)

    def then(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        """Queue `fn(*args)` behind the work given, without waiting; a
        failure of work already finished is raised here."""
        self._queued.check()
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=self._name)
            fut = self._executor.submit(fn, *args)
            self._queued.add(fut)
        return fut

    def close(self) -> None:
        """`wait`, then stop the thread (later work starts another)."""
        try:
            self.wait()
        finally:
            with self._lock:
                executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)
