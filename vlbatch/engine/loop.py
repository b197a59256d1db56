"""One engine on a thread of its own, fed from other threads.

The thread runs `engine.generate` over an inbox that ends only at `close()`, so requests
join the running batch as they become ready and the engine is never drained between
them. It does nothing else: it hands ready requests to the engine and resolves each
request's future with its completion. Used by the local executor and by each vLLM actor
on Ray. If the engine dies and the loop was given a way to start another (`restart`), it
starts one, once, and hands it again what the dead one held; if that one dies too (or
there is no restart), every request in it and every later one fails with the reason, and
`on_down` is told.

Given a `review` (pipeline/answers.py), each answer is looked at as it arrives: one that
fails (a schema broken, a loop to max_tokens) goes back to the engine once, as a retry
(`Request.retry`), ahead of the inbox; if the retry fails too, the request's completion is
an error with the reason and the text (`error_output`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from vlbatch.engine.base import Completion, GenerationEngine, Request

log = logging.getLogger("vlbatch")
IDLE_WAIT_S = 0.005  # nothing ready: how long the engine waits before it steps again
RETRY_SUFFIX = "#retry"  # a retry's request id: its request's, and this
_CLOSE = object()


class EngineLoop:
    def __init__(self, engine: GenerationEngine, max_waiting: int = 0,
                 restart: Callable[[], GenerationEngine] | None = None,
                 on_down: Callable[[str], None] | None = None,
                 review: Callable[[Request, Completion], str | None] | None = None):
        """max_waiting: requests submitted but not yet taken by the engine, at most
        (`submit` blocks beyond it); 0: no bound. restart: starts a new engine after the
        first death; on_down: called with the reason once the loop has given up; review:
        why an answer is not to be kept (None: keep it)."""
        self.engine = engine
        self.restart, self.on_down, self.review = restart, on_down, review
        self.retries: deque[Request] = deque()  # to the engine before the inbox (its thread)
        self.retrying: dict[str, Request] = {}  # retry id -> the retry, until answered
        self.restarts = 0
        self.inbox: queue.Queue = queue.Queue(maxsize=max_waiting)
        self.waiting: dict[str, tuple[Future, Request]] = {}  # submitted, not answered
        self.in_engine: dict[str, None] = {}  # of those, the ones the engine took, in order
        self.lock = threading.Lock()
        self.failed: str | None = None
        self.closing = False  # close() was called: an engine that fails now is being shut
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
        """Let the engine finish what it holds (for up to timeout_s), then end the thread.
        From here on an engine that fails is being shut down, not dead: none is started in
        its place (the caller may close the engine itself after a short timeout)."""
        self.closing = True
        if self.thread.is_alive():
            self.inbox.put(_CLOSE)
            self.thread.join(timeout_s)

    def _feed(self, replay: list[Request]):
        for request in replay:  # what a dead engine held, to the new one first
            self.in_engine[request.request_id] = None
            yield request
        while True:
            if self.retries:
                retry = self.retries.popleft()
                self.in_engine[retry.request_id] = None
                yield retry
                continue
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
                    self.in_engine.pop(done.request_id, None)
                    done = self._reviewed(done)
                    if done is None:  # generated again
                        continue
                    with self.lock:
                        waiting = self.waiting.pop(done.request_id, None)
                    if waiting is not None:
                        waiting[0].set_result(done)
                self._end_retries()
                return
            except Exception as e:  # the engine died, or was closed at shutdown
                if self.closing:
                    log.debug("the engine stopped as it was closed: %s", e)
                    self._shut(f"engine closed at shutdown: {e}")
                    return
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
                    replay = [self.retrying.get(r) or self.waiting[r][1] for r in self.in_engine
                              if r in self.retrying or r in self.waiting]
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

    def _shut(self, reason: str) -> None:
        """Closed with requests in it: they fail (the executor keeps no rows for them, the
        next run does them); no engine is started, nobody is told the engine is down."""
        with self.lock:
            self.failed = reason
        self._end_retries()
        self._fail_waiting()

    def _reviewed(self, done: Completion) -> Completion | None:
        """The completion to resolve its request with; None when it went back to the engine."""
        retry = self.retrying.pop(done.request_id, None)
        if retry is not None:
            done = replace(done, request_id=done.request_id.removesuffix(RETRY_SUFFIX), tries=2)
        if self.review is None:
            return done
        with self.lock:
            entry = self.waiting.get(done.request_id)
        if entry is None:
            return done
        problem = self.review(entry[1], done)
        if problem is None:
            return done
        if retry is None:  # once more, with the task's retry settings
            again = replace(entry[1], request_id=done.request_id + RETRY_SUFFIX, retry=True,
                            page_requests=1)
            self.retrying[again.request_id] = again
            self.retries.append(again)
            return None
        return Completion(done.request_id, None, problem, done.prompt_tokens, done.output_tokens,
                          finish_reason=done.finish_reason, tries=2, error_output=done.text)

    def _end_retries(self) -> None:
        """Retries the engine never took (it was closed first): failed with the reason."""
        while self.retries:
            retry = self.retries.popleft()
            self.retrying.pop(retry.request_id, None)
            request_id = retry.request_id.removesuffix(RETRY_SUFFIX)
            with self.lock:
                entry = self.waiting.pop(request_id, None)
            if entry is not None:
                entry[0].set_result(Completion(request_id, None, "engine closed before a retry"))

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
