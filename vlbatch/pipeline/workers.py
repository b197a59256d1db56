"""A bounded pool of worker processes for CPU work (probing and rendering pages).

Built on pebble's ProcessPool: a call that runs past its time limit has its worker killed
and replaced, and a worker that dies (a segfault in a native library) is replaced too; in
both cases that call's result is an exception, and every other call goes on. Results come
back in submission order with at most `lookahead` calls in flight, so memory stays flat
however many pages a job has.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

T = TypeVar("T")
# workers render ahead of need: when cores are short, the engine (its start, and the thread
# that feeds it) comes first
WORKER_NICENESS = 10


class CallTimedOut(Exception):
    pass


class WorkerDied(Exception):
    pass


def default_workers(configured: int) -> int:
    """The job's setting, or one worker per core this process may use."""
    if configured:
        return configured
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return max(1, len(cores))


def _start_worker(initializer: Callable[..., None] | None, initargs: tuple) -> None:
    try:
        os.nice(WORKER_NICENESS)
    except OSError:  # not allowed here: run at the parent's priority
        pass
    if initializer is not None:
        initializer(*initargs)


class WorkerPool:
    """`imap(fn, items, args_of)` yields (item, result-or-exception) in order."""

    def __init__(self, workers: int, timeout_s: float, lookahead: int | None = None,
                 initializer: Callable[..., None] | None = None, initargs: tuple = ()):
        """`initializer(*initargs)` runs once in each worker process as it starts (and in
        each replacement of one that was killed or died)."""
        from pebble import ProcessPool

        self.workers = workers
        self.timeout_s = timeout_s
        self.lookahead = lookahead or 4 * workers
        # spawn: the parent may hold threads (vLLM, torch); forking those is unsafe
        self._pool = ProcessPool(max_workers=workers, initializer=_start_worker,
                                 initargs=(initializer, initargs),
                                 context=multiprocessing.get_context("spawn"))

    def imap(self, fn: Callable[..., Any], items: Iterable[T],
             args_of: Callable[[T], tuple]) -> Iterator[tuple[T, Any]]:
        pending: deque = deque()
        source = iter(items)
        exhausted = False
        while True:
            while not exhausted and len(pending) < self.lookahead:
                try:
                    item = next(source)
                except StopIteration:
                    exhausted = True
                    break
                pending.append((item, self._pool.schedule(fn, args=args_of(item),
                                                          timeout=self.timeout_s)))
            if not pending:
                return
            item, future = pending.popleft()
            yield item, self._outcome(future)

    def _outcome(self, future) -> Any:
        """A call's result, or the exception that says why there is none."""
        from pebble import ProcessExpired

        try:
            return future.result()
        except FutureTimeout:
            return CallTimedOut(f"timeout: stopped after {self.timeout_s:g} s")
        except ProcessExpired as e:
            return WorkerDied(f"worker process died (exit code {e.exitcode})")
        except Exception as e:  # the function raised: its message is the reason
            return e

    def call(self, fn: Callable[..., Any], args: tuple) -> Any:
        """One call, beside whatever `imap` has in flight (another thread may call this):
        its result, or the exception (raised) that says why there is none."""
        result = self._outcome(self._pool.schedule(fn, args=args, timeout=self.timeout_s))
        if isinstance(result, Exception):
            raise result
        return result

    def close(self) -> None:
        self._pool.stop()
        self._pool.join(timeout=10)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
