"""One engine on a thread of its own, fed from other threads.

The thread runs `engine.generate` over an inbox that ends only at `close()`, so requests
join the running batch as they become ready and the engine is never drained between
them. It does nothing else: it hands ready requests to the engine and resolves each
request's future with its completion. Used by the local executor and by each vLLM actor
on Ray. If the engine dies and the loop was given a way to start another (`restart`), it
starts one, once, and hands it again what the dead one held; if that one dies too (or
there is no restart), every request in it and every later one fails with the reason, and
`on_down` is told.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from vlbatch.engine.base import Completion, GenerationEngine, Request

log = logging.getLogger("vlbatch")
IDLE_WAIT_S = 0.005  # nothing ready: how long the engine waits before it steps again
_CLOSE = object()


class EngineLoop:
    def __init__(self, engine: GenerationEngine, max_waiting: int = 0,
                 restart: Callable[[], GenerationEngine] | None = None,
                 on_down: Callable[[str], None] | None = None):
        """max_waiting: requests submitted but not yet taken by the engine, at most
        (`submit` blocks beyond it); 0: no bound. restart: starts a new engine after the
        first death; on_down: called with the reason once the loop has given up."""
        self.engine = engine
        self.restart, self.on_down = restart, on_down
        self.restarts = 0
        self.inbox: queue.Queue = queue.Queue(maxsize=max_waiting)
        self.waiting: dict[str, tuple[Future, Request]] = {}  # submitted, not answered
        self.in_engine: dict[str, None] = {}  # of those, the ones the engine took, in order
        self.lock = threading.Lock()
        self.failed: str | None = None
        self.thread = threading.Thread(target=self._run, name="vlbatch-engine", daemon=True)
        self.thread.start()

    def submit(self, request: Request) -> Future:
        """The request's future: its Completion, once the engine has answered."""
        future: Future = Future()
        with self.lock:
            failed = self.failed
            if failed is None:
                self.waiting[request.request_id] = (future, request)
        if failed is not None:
            future.set_result(Completion(request.request_id, None, failed))
            return future
        while True:  # bounded inbox: wait for room, unless the engine dies meanwhile
            try:
                self.inbox.put(request, timeout=0.1)
                return future
            except queue.Full:
                if self.failed is not None:
                    self._fail_waiting()
                    return future

    def close(self, timeout_s: float = 60.0) -> None:
        """Let the engine finish what it holds, then end the thread."""
        if self.thread.is_alive():
            self.inbox.put(_CLOSE)
            self.thread.join(timeout_s)

    def _feed(self, replay: list[Request]):
        for request in replay:  # what a dead engine held, to the new one first
            self.in_engine[request.request_id] = None
            yield request
        while True:
            try:
                item = self.inbox.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                yield None
                continue
            if item is _CLOSE:
                return
            self.in_engine[item.request_id] = None
            yield item

    def _run(self) -> None:
        replay: list[Request] = []
        while True:
            try:
                for done in self.engine.generate(self._feed(replay)):
                    with self.lock:
                        waiting = self.waiting.pop(done.request_id, None)
                    self.in_engine.pop(done.request_id, None)
                    if waiting is not None:
                        waiting[0].set_result(done)
                return
            except Exception as e:  # the engine died
                reason = f"engine failed: {e}"
                if self.restart is None or self.restarts:
                    break
                log.error("engine failed mid-run: %s; starting a new one", e)
                self.restarts += 1
                _close_quietly(self.engine)
                try:
                    self.engine = self.restart()
                except Exception as start_error:
                    reason = f"engine failed: {e}; a new one did not start: {start_error}"
                    break
                with self.lock:
                    replay = [self.waiting[r][1] for r in self.in_engine if r in self.waiting]
                self.in_engine = {}
        log.error("%s", reason)
        with self.lock:
            self.failed = reason
        if self.on_down is not None:  # first: the executor hears of it before the failures
            self.on_down(reason)
        self._fail_waiting()
        while True:  # requests still arriving fail at once (submit sees `failed`)
            try:
                if self.inbox.get(timeout=1.0) is _CLOSE:
                    return
            except queue.Empty:
                continue
            self._fail_waiting()

    def _fail_waiting(self) -> None:
        with self.lock:
            left, self.waiting = self.waiting, {}
        for request_id, (future, _) in left.items():
            future.set_result(Completion(request_id, None, self.failed))


def _close_quietly(engine: GenerationEngine) -> None:
    try:
        engine.close()
    except Exception as e:  # a dead engine may not close cleanly: it is gone either way
        log.debug("closing the dead engine: %s", e)
