"""`executor: local`: the stages on this machine, wired with threads and bounded queues.

    render thread   orders the plan (once the processor has loaded), renders it in the
                    worker processes, builds each page's image          -> rendered
    route thread    file time budget, dedupe, prompts, keys, cache reads (route.Router);
                    hands the page to the sink and its requests to the engine
    engine thread   engine.loop.EngineLoop: hands requests to the engine, resolves
                    completions; nothing else
    main thread     starts the engine, and runs the sink: rows, counters, cache writes

The engine starts on the main thread as soon as the run knows new pages need it, while the
other threads plan and render; a run whose pages are all answered from the caches never
starts it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future

from vlbatch.engine.base import Request
from vlbatch.engine.loop import EngineLoop
from vlbatch.errors import EngineStayedDown
from vlbatch.executor.context import RunContext
from vlbatch.pipeline import scope
from vlbatch.pipeline.answers import review
from vlbatch.pipeline.comparison import Comparisons
from vlbatch.pipeline.dedupe import Deduper
from vlbatch.pipeline.ingest import RenderedPage
from vlbatch.pipeline.plan import PageUnit
from vlbatch.pipeline.render import FileTimeBudget, PageSpec, render_in_order
from vlbatch.pipeline.route import RoutedPage, Router
from vlbatch.pipeline.sink import RunSink

log = logging.getLogger("vlbatch")
POLL_S = 0.1  # how often a blocked hand-over looks whether the run is stopping


class _Stopped(Exception):
    pass


def _put(q: queue.Queue, item, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            q.put(item, timeout=POLL_S)
            return
        except queue.Full:
            continue
    raise _Stopped


class LocalExecutor:
    def run(self, ctx: RunContext, units: tuple[PageUnit, ...], sink: RunSink) -> None:
        job = ctx.job
        stop = threading.Event()
        rendered: queue.Queue = queue.Queue(maxsize=ctx.pool.lookahead)
        events: queue.Queue = queue.Queue()  # to the main thread: ("page" | "done" | ...)
        engine: Future = Future()  # the EngineLoop, once started
        # comparison images the dedupe needs are made by the render workers, on demand
        router = Router(job, Deduper(job.dedupe, index=ctx.features,
                                     comparisons=Comparisons(job.render, pool=ctx.pool)),
                        ctx.results)

        def render() -> None:
            try:
                ordered = scope.order(job, units, ctx.prompts.result())
                rank = {u.order: i for i, u in enumerate(ordered)}
                ctx.lap("plan_s")
                spec = lambda u: PageSpec(u.source.abs_path, u.kind, u.page,  # noqa: E731
                                          u.feature_key(job.render) if job.feature_cache else None)
                for unit, outcome in render_in_order(
                        ctx.pool, ordered, spec, job.render,
                        FileTimeBudget(job.render.file_timeout_s), lambda u: u.source.abs_path,
                        lambda u: rank[u.order]):
                    if isinstance(outcome, RenderedPage):  # the image built here, not later
                        outcome = outcome.with_image()
                    _put(rendered, (unit, outcome), stop)
                _put(rendered, None, stop)
            except _Stopped:
                return
            except Exception as e:  # the pool itself failed: every page left gets an error
                log.error("rendering stopped: %s", e)
                _put(rendered, RuntimeError("render pool failed"), stop)

        def route() -> None:
            asked = False
            try:
                # prompts in the model's chat template here, not on the engine's thread
                chat_prompt = getattr(ctx.prompts.result(), "chat_prompt", lambda text: None)
                while True:
                    try:
                        item = rendered.get(timeout=POLL_S)
                    except queue.Empty:
                        if stop.is_set():
                            return
                        continue
                    if item is None or isinstance(item, Exception):
                        events.put(("routed_all", str(item) if item is not None else None))
                        return
                    unit, outcome = item
                    routed = router.route(unit.source.abs_path, unit.page, unit.tasks, outcome,
                                          unit.source.path)
                    if not isinstance(routed, RoutedPage):
                        events.put(("failed", unit, routed))
                        continue
                    events.put(("page", unit, outcome.metadata(), routed))
                    requests = routed.to_generate()
                    if requests and not asked:
                        events.put(("start_engine",))
                        asked = True
                    for r in requests:
                        future = engine.result().submit(Request(
                            r.key, outcome.image(), r.prompt, r.task, chat_prompt(r.prompt),
                            page_requests=len(requests)))
                        future.add_done_callback(lambda f: events.put(("done", f.result())))
            except Exception as e:  # a bug, or the engine could not start: the main thread says
                events.put(("route_failed", e))

        threads = [threading.Thread(target=render, name="vlbatch-render", daemon=True),
                   threading.Thread(target=route, name="vlbatch-route", daemon=True)]
        for thread in threads:
            thread.start()
        loop: EngineLoop | None = None
        ready_at, finished = None, False
        try:
            if self._worth_starting_early(ctx, units):
                # the engine takes longest to start (a minute on a GPU): start it now, while
                # the other threads plan and render
                loop = self._start(ctx, sink, engine, events)
                ready_at = time.monotonic()
            routed_all = False
            while not routed_all or sink.waiting_on_engine():
                event = events.get()
                kind = event[0]
                if kind == "page":
                    sink.page_routed(*event[1:])
                elif kind == "done":
                    sink.completed(event[1])
                elif kind == "failed":
                    sink.page_failed(*event[1:])
                elif kind == "start_engine" and loop is None:
                    ctx.lap("to_first_request_s")
                    loop = self._start(ctx, sink, engine, events)
                    ready_at = time.monotonic()
                elif kind == "routed_all":
                    routed_all = True
                    sink.fail_unseen(event[1] or "lost between rendering and routing")
                elif kind == "route_failed":
                    raise event[1]
                elif kind == "engine_down":  # restarted once already: stop, say so
                    stop.set()
                    self._keep_finished(events, sink)
                    sink.fail_pending(event[1])
                    sink.fail_unseen(event[1])
                    raise EngineStayedDown(f"{event[1]} (after one restart); rendering "
                                           f"stopped, the pages left have transient error "
                                           f"rows that the next run retries")
            if loop is not None and loop.failed is not None and loop.restart is not None:
                raise EngineStayedDown(f"{loop.failed} (after one restart)")  # all were in flight
            if ready_at is not None:
                sink.stats.generation_s = round(time.monotonic() - ready_at, 2)
            finished = True
        finally:
            stop.set()
            if not finished:  # interrupted or failed: keep what is already finished
                self._keep_finished(events, sink)
            if not engine.done():
                engine.set_exception(_Stopped())
            if loop is not None:
                loop.close(timeout_s=60 if finished else 0)  # it holds nothing when finished
                sink.stats.engine_restarts = loop.restarts
                try:
                    loop.engine.close()
                except Exception as e:  # a dead engine may not close cleanly
                    log.debug("closing the engine: %s", e)
            for thread in threads:
                thread.join(timeout=10)
            dedupe = router.deduper
            sink.stats.pixel_checks = dedupe.pixel_checks
            sink.stats.comparisons_made = dedupe.comparisons.made
            sink.stats.comparisons_failed = dedupe.comparisons.failed
            if not any(thread.is_alive() for thread in threads):  # else the route thread may still read it
                dedupe.close()

    @staticmethod
    def _keep_finished(events: queue.Queue, sink: RunSink) -> None:
        """Rows for the pages and answers already handed to the main thread; what is still
        in the engine is left for the next run (no error rows: they would count as done)."""
        while True:
            try:
                event = events.get_nowait()
            except queue.Empty:
                return
            if event[0] == "page":
                sink.page_routed(*event[1:])
            elif event[0] == "done":
                sink.completed(event[1])
            elif event[0] == "failed":
                sink.page_failed(*event[1:])

    @staticmethod
    def _start(ctx: RunContext, sink: RunSink, engine: Future, events: queue.Queue) -> EngineLoop:
        started = time.monotonic()
        try:
            generation_engine = ctx.engine_factory(ctx.job, ctx.prompts)
        except BaseException as e:
            engine.set_exception(e)
            raise
        sink.stats.engine_start_s = round(time.monotonic() - started, 1)
        sink.engine_version = getattr(generation_engine, "version", None)
        sink.stats.engine_device = getattr(generation_engine, "device", None)
        loop = EngineLoop(generation_engine, max_waiting=64,
                          restart=lambda: ctx.engine_factory(ctx.job, ctx.prompts),
                          on_down=lambda reason: events.put(("engine_down", reason)),
                          review=review)
        engine.set_result(loop)
        return loop

    @staticmethod
    def _worth_starting_early(ctx: RunContext, units: tuple[PageUnit, ...]) -> bool:
        """Start the engine while planning and rendering run, unless every page may be
        answered from the caches (an identical re-run into a new output folder never
        starts it): some page was never rendered before, or there is no result cache."""
        job = ctx.job
        if not job.result_cache:
            return True
        if ctx.features is None:
            return False
        return any(not ctx.features.has_page(u.feature_key(job.render)) for u in units)
