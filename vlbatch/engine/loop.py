"""One engine on a thread of its own, fed from other threads.

The thread runs `engine.generate` over an inbox that ends only at `close()`, so requests
join the running batch as they become ready and the engine is never drained between
them. It does nothing else: it hands ready requests to the engine and resolves each
request's future with its completion. Used by the local executor and by each vLLM actor
on Ray. If the engine dies, every request in it and every later one fails with the reason.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from vlbatch.engine.base import Completion, GenerationEngine, Request

log = logging.getLogger("vlbatch")
IDLE_WAIT_S = 0.005  # nothing ready: how long the engine waits before it steps again
_CLOSE = object()


class EngineLoop:
    def __init__(self, engine: GenerationEngine, max_waiting: int = 0):
        """max_waiting: requests submitted but not yet taken by the engine, at most
        (`submit` blocks beyond it); 0: no bound."""
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue(maxsize=max_waiting)
        self.waiting: dict[str, Future] = {}
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
                self.waiting[request.request_id] = future
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

    def _feed(self):
        while True:
            try:
                item = self.inbox.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                yield None
                continue
            if item is _CLOSE:
                return
            yield item

    def _run(self) -> None:
        try:
            for done in self.engine.generate(self._feed()):
                with self.lock:
                    future = self.waiting.pop(done.request_id, None)
                if future is not None:
                    future.set_result(done)
        except Exception as e:  # the engine died: every request in it and after it fails
            log.error("engine failed mid-run: %s", e)
            with self.lock:
                self.failed = f"engine failed: {e}"
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
        for request_id, future in left.items():
            future.set_result(Completion(request_id, None, self.failed))
