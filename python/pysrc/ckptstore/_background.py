"""Work off the caller's thread, in order, for the async saves of
`ckptstore.lightning` and `ckptstore.transformers`: a save first waits
for the work in flight and raises its failure (once); lighter work (a
removal after a save) is queued behind it without waiting."""

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, List, Optional, TypeVar

T = TypeVar("T")


class Background:
    """A thread of its own (started on first use) running the work given
    to it in order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._executor: Optional[ThreadPoolExecutor] = None
        self._queued: List["Future[Any]"] = []
        self._lock = threading.Lock()

    def wait(self) -> None:
        """Wait for all work given; raise the first failure among it (then
        forget it: a failure is raised once)."""
        with self._lock:
            queued, self._queued = self._queued, []
        failure: Optional[BaseException] = None
        for fut in queued:
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
        with self._lock:
            done = [f for f in self._queued if f.done()]
            self._queued = [f for f in self._queued if not f.done()]
        for f in done:
            e = f.exception()
            if e is not None:
                raise e
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=self._name)
            fut = self._executor.submit(fn, *args)
            self._queued.append(fut)
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
