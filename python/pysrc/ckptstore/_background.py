"""Work off the caller's thread, in order, for the async saves of
`ckptstore.lightning` and `ckptstore.transformers`: a save first waits
for the work in flight and raises its failure (once); lighter work (a
removal after a save) is queued behind it without waiting. `Running`
(work in flight whose failures a later call raises) serves `Tiers` too,
with `Told`: a future handed to the caller, whose failure, once the
caller took it, is not raised again."""

import concurrent.futures
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, List, Optional, TypeVar

T = TypeVar("T")


class Told(Future[Any]):
    """The outcome of `inner`, for the caller: once the caller has taken
    its failure (`result` raised it, or `exception` returned it), `told`
    is set and `Running.check` does not raise it again. A training loop
    that logs a failed save and goes on loses that step only."""

    def __init__(self, inner: "Future[Any]") -> None:
        super().__init__()
        self.told = False
        inner.add_done_callback(self._settle)

    def _settle(self, inner: "Future[Any]") -> None:
        if self.done():  # the caller cancelled this view
            return
        if inner.cancelled():
            self.cancel()
            return
        failure = inner.exception()
        if failure is None:
            self.set_result(inner.result())
        else:
            self.set_exception(failure)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        failure = super().exception(timeout)
        if failure is not None:
            self.told = True
        return failure

    def result(self, timeout: Optional[float] = None) -> Any:
        self.exception(timeout)  # waits as `result` would, and marks a failure told
        return super().result(timeout)


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
        """Forget finished work; raise the first failure among it that
        its caller has not taken already (`Told`)."""
        with self._lock:
            done = [f for f in self._futures if f.done()]
            self._futures = [f for f in self._futures if not f.done()]
        for f in done:
            if f.cancelled():
                continue
            e = Future.exception(f)  # not `f.exception()`: that would tell a `Told`
            if e is not None and not getattr(f, "told", False):
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
            concurrent.futures.wait([first])
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
