"""One run of a job, stage by stage: discover -> probe -> plan -> render -> dedupe/cache ->
generate -> write -> report. Every input file and page ends up as result rows or error rows.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from vlbatch import __version__
from vlbatch.engine.base import Completion, Engine, Request
from vlbatch.errors import ErrorBudgetExceeded, JobCannotRunError
from vlbatch.job import Job, Task
from vlbatch.pipeline import ingest
from vlbatch.pipeline.cache import FeatureCache, ResultCache, prompt_and_key
from vlbatch.pipeline.dedupe import Deduper
from vlbatch.pipeline.discover import discover
from vlbatch.pipeline.plan import PageUnit, order_for_generation, page_units, select_todo
from vlbatch.pipeline.workers import CallTimedOut, WorkerPool, default_workers
from vlbatch.pipeline.write import PAGE_SCHEMA, RESULT_SCHEMA, OutputFolder, PartWriter

log = logging.getLogger("vlbatch")


@dataclass
class RunStats:
    run_id: str = ""
    sources: int = 0
    pages_total: int = 0  # pages (and unopenable files) in scope for this run
    pages_already_done: int = 0
    pages_todo: int = 0
    pages_finished: int = 0
    requests_total: int = 0
    requests_finished: int = 0
    generated: int = 0
    cache_hits: int = 0
    duplicates_merged: int = 0
    rows_ok: int = 0
    rows_error: int = 0
    pages_with_errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    engine_start_s: float | None = None
    generation_s: float | None = None  # from engine ready to the last answer
    seconds: float = 0.0
    pages_per_s: float = 0.0
    cache_corrupt: int = 0
    feature_cache_hits: int = 0  # pages not rendered: read from the feature cache
    near_duplicates: int = 0  # pages merged with a confirmed near-copy
    error_reasons: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage


ProgressCallback = Callable[[RunStats], None]


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


def default_engine_factory(job: Job, prompts) -> Engine:
    from vlbatch.engine.vllm_engine import VllmEngine

    return VllmEngine(job, prompts)


def default_prompts(job: Job):
    """The model's processor (chat template, tokenizer): token counts for planning, and the
    prompts the engine sends. Loaded once, while the inputs are probed."""
    from vlbatch.engine.prompts import PromptBuilder

    try:
        return PromptBuilder(job.model_path(), job.engine.trust_remote_code)
    except Exception as e:  # not a model folder, not on the hub, no processor
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise JobCannotRunError(f"cannot load the model's processor from {job.model!r}: "
                                f"{reason}") from e


def cached_completion(hit: dict) -> Completion:
    """An answer as the result cache keeps it."""
    return Completion("", hit["output"], None, hit.get("prompt_tokens"), hit.get("output_tokens"))


def _in_background(fn: Callable, *args) -> Future:
    """Run fn in a daemon thread (never waited for when its result is not needed)."""
    future: Future = Future()

    def target() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # handed to whoever asks for the result
            future.set_exception(e)

    threading.Thread(target=target, name="vlbatch-load", daemon=True).start()
    return future


class _Pending:
    """A request in the engine, and the duplicate pages waiting on its answer."""

    def __init__(self, key: str, unit: PageUnit, task: Task, hashes: tuple[str, str]):
        self.key, self.unit, self.task, self.hashes = key, unit, task, hashes
        self.waiters: list[tuple[PageUnit, Task, tuple[str, str]]] = []


class JobRun:
    def __init__(self, job: Job, *, limit: int | None = None, retry_errors: bool = False,
                 engine_factory: Callable[[Job, object], Engine] = default_engine_factory,
                 prompts_factory: Callable[[Job], object] = default_prompts,
                 progress: ProgressCallback | None = None):
        self.job, self.limit, self.retry_errors = job, limit, retry_errors
        self.engine_factory, self.prompts_factory = engine_factory, prompts_factory
        self.prompts = None
        self.progress = progress or (lambda stats: None)
        self.stats = RunStats(run_id=new_run_id())
        self.timings = self.stats.timings
        self._last_lap = time.monotonic()
        self.engine: Engine | None = None
        self.engine_version: str | None = None
        self._pending: dict[str, _Pending] = {}
        self._by_key: dict[str, _Pending] = {}
        # answers given in this run, for later copies: in the result cache when there is one
        # (host memory stays flat), else here
        self._answered: set[str] = set()
        self._answers: dict[str, tuple[str, Completion]] = {}  # key -> (origin page, answer)
        self._tasks_left: dict[int, int] = {}  # unit order -> rows still to write
        self._error_pages: set[int] = set()

    def _lap(self) -> float:
        now = time.monotonic()
        seconds, self._last_lap = round(now - self._last_lap, 2), now
        return seconds

    # ----- rows -----
    def _row(self, unit: PageUnit, task: Task, *, output: str | None = None,
             error: str | None = None, hashes: tuple[str, str] | None = None,
             cached: bool = False, reused_from: str | None = None,
             prompt_tokens: int | None = None, output_tokens: int | None = None) -> None:
        status = "error" if error is not None else "ok"
        self.results.add(dict(
            source=unit.source.path, page=unit.page, task=task.name,
            output=None if error is not None else output, status=status, error=error,
            content_hash=hashes[0] if hashes else None, phash=hashes[1] if hashes else None,
            cached=cached, reused_from=reused_from, model=self.job.model,
            run_id=self.stats.run_id, source_sha256=unit.source.sha256,
            task_hash=task.fingerprint(), prompt_tokens=prompt_tokens,
            output_tokens=output_tokens, finished_at=datetime.now(timezone.utc)))
        s = self.stats
        if error is None:
            s.rows_ok += 1
        else:
            s.rows_error += 1
            self._error_pages.add(unit.order)
            s.pages_with_errors = len(self._error_pages)
            reason = error.split(":")[0][:80]
            s.error_reasons[reason] = s.error_reasons.get(reason, 0) + 1
        left = self._tasks_left[unit.order] = self._tasks_left[unit.order] - 1
        if left == 0:
            s.pages_finished += 1
        s.requests_finished += 1
        self.progress(s)

    def _error_rows(self, unit: PageUnit, reason: str, hashes=None) -> None:
        for task in unit.tasks:
            self._row(unit, task, error=reason, hashes=hashes)

    # ----- stages -----
    def _probe_all(self, pool: WorkerPool, sources) -> list[ingest.Probe]:
        r = self.job.render
        probes = []
        for source, result in pool.imap(ingest.probe, sources,
                                        lambda s: (s.abs_path, r.dpi, r.pdf_password)):
            if isinstance(result, Exception):
                result = ingest.Probe("unknown", [], str(result))
            probes.append(result)
        return probes

    def _is_done(self, done: set) -> Callable[[PageUnit, Task], bool]:
        return lambda unit, task: (unit.source.path, unit.page, task.name, unit.source.sha256,
                                   task.fingerprint()) in done

    def _render_ahead(self, pool: WorkerPool, units: list[PageUnit], use_features: bool) -> queue.Queue:
        """Render in planned order in the worker pool; a thread hands results over."""
        r = self.job.render
        rendered: queue.Queue = queue.Queue(maxsize=pool.lookahead)
        cache_dir = str(self.job.cache) if use_features else None

        def args(u: PageUnit) -> tuple:
            return (u.source.abs_path, u.kind, u.page, r.dpi, r.min_pixels, r.max_pixels,
                    r.pdf_password, cache_dir, u.feature_key(r))

        budget = ingest.FileTimeBudget(r.file_timeout_s, r.page_timeout_s)

        def schedule() -> Iterator[PageUnit]:
            for unit in units:
                if budget.used_up(unit.source.path):
                    rendered.put((unit, CallTimedOut(budget.reason)))
                else:
                    yield unit

        def produce() -> None:
            try:
                for unit, page in pool.imap(ingest.render_page, schedule(), args):
                    budget.charge(unit.source.path, page)
                    rendered.put((unit, page.with_image() if isinstance(page, ingest.RenderedPage)
                                  else page))
            except Exception as e:  # the pool itself failed: every page left gets an error
                log.error("rendering stopped: %s", e)
            rendered.put(None)

        threading.Thread(target=produce, name="vlbatch-render", daemon=True).start()
        return rendered

    def _feed(self, units: list[PageUnit], rendered: queue.Queue,
              cache: ResultCache | None) -> Iterator[Request | None]:
        seen: set[int] = set()  # results may arrive out of plan order (file time limits)
        while len(seen) < len(units):
            try:
                item = rendered.get(timeout=0.05)
            except queue.Empty:
                yield None
                continue
            if item is None:  # the render thread died: account for the rest
                for unit in units:
                    if unit.order not in seen:
                        self._page_row(unit, None, "render pool failed")
                        self._error_rows(unit, "render pool failed")
                return
            unit, page = item
            seen.add(unit.order)
            if isinstance(page, Exception):
                page_error, row_error = ingest.failure_reasons(page)
                self._page_row(unit, None, page_error)
                self._error_rows(unit, row_error)
                continue
            self._page_row(unit, page, None)
            yield from self._requests_for(unit, page, cache)

    def _page_row(self, unit: PageUnit, page: ingest.RenderedPage | None, error: str | None):
        self.pages.add(dict(
            source=unit.source.path, page=unit.page,
            width=page.width if page else None, height=page.height if page else None,
            text_layer=page.text_layer if page else None,
            content_hash=page.content_hash if page else None,
            phash=page.phash if page else None, source_sha256=unit.source.sha256,
            error=error, run_id=self.stats.run_id))

    def _requests_for(self, unit: PageUnit, page: ingest.RenderedPage,
                      cache: ResultCache | None) -> Iterator[Request]:
        hashes = (page.content_hash, page.phash)
        self.stats.feature_cache_hits += page.from_cache
        self.stats.cache_corrupt += page.healed
        image = page.image()
        canonical = self.deduper.canonical(page.content_hash, page.phash, image, page.text_layer)
        self.stats.near_duplicates = self.deduper.near_merged
        for task in unit.tasks:
            text, key = prompt_and_key(self.job, task, canonical, page.text_layer,
                                       unit.source.path, unit.page)
            if key in self._by_key:  # the same page and prompt is in the engine now
                self._by_key[key].waiters.append((unit, task, hashes))
                self.stats.duplicates_merged += 1
                continue
            reuse = self._earlier_answer(key, cache)
            if reuse is not None:  # answered earlier in this run, or in an earlier run
                origin, answer = reuse
                if key in self._answered:
                    self.stats.duplicates_merged += 1
                else:
                    self.stats.cache_hits += 1
                self._answer_row(unit, task, hashes, answer, origin if origin != unit.ref else None)
                continue
            request_id = f"{self.stats.run_id}-{len(self._pending) + self.stats.generated}"
            pending = _Pending(key, unit, task, hashes)
            self._pending[request_id] = self._by_key[key] = pending
            yield Request(request_id, image, text, task)

    def _earlier_answer(self, key: str, cache: ResultCache | None) -> tuple[str | None, Completion] | None:
        """(origin page, answer) of a request answered earlier in this run or, through the
        result cache, in an earlier one; None if there is none."""
        if key in self._answers:
            return self._answers[key]
        hit = cache.get(key) if cache is not None else None
        return (hit.get("origin"), cached_completion(hit)) if hit is not None else None

    def _answer_row(self, unit, task, hashes, answer: Completion, reused_from: str | None):
        self._row(unit, task, output=answer.text, error=answer.error, hashes=hashes, cached=True,
                  reused_from=reused_from, prompt_tokens=answer.prompt_tokens,
                  output_tokens=answer.output_tokens)

    def _complete(self, done: Completion, cache: ResultCache | None) -> None:
        pending = self._pending.pop(done.request_id)
        del self._by_key[pending.key]
        unit, task = pending.unit, pending.task
        self.stats.generated += 1
        self.stats.prompt_tokens += done.prompt_tokens or 0
        self.stats.output_tokens += done.output_tokens or 0
        self._row(unit, task, output=done.text, error=done.error, hashes=pending.hashes,
                  prompt_tokens=done.prompt_tokens, output_tokens=done.output_tokens)
        if done.error is None:
            self._answered.add(pending.key)
            if cache:
                cache.put(pending.key, {"output": done.text, "origin": unit.ref,
                                        "prompt_tokens": done.prompt_tokens,
                                        "output_tokens": done.output_tokens})
            else:
                self._answers[pending.key] = (unit.ref, done)
        for w_unit, w_task, w_hashes in pending.waiters:
            self._answer_row(w_unit, w_task, w_hashes, done, unit.ref)

    def _start_engine(self, prompts) -> None:
        started = time.monotonic()
        self.engine = self.engine_factory(self.job, prompts)
        self.stats.engine_start_s = round(time.monotonic() - started, 1)
        self.engine_version = getattr(self.engine, "version", None)

    def _worth_starting_early(self, units: list[PageUnit], features: FeatureCache | None) -> bool:
        """Start the engine while planning and rendering run, unless every page may be
        answered from the caches (an identical re-run into a new output folder never
        starts it): some page was never rendered before, or there is no result cache."""
        if not self.job.result_cache:
            return True
        if features is None:
            return False
        return any(not features.has_page(u.feature_key(self.job.render)) for u in units)

    def _plan(self, units: list[PageUnit], prompts: Future) -> list[PageUnit]:
        self.prompts = prompts.result()
        ordered = order_for_generation(units, self.prompts.text_tokens,
                                       self.job.render.min_pixels, self.job.render.max_pixels)
        self.timings["plan_s"] = self._lap()
        return ordered

    def _plan_and_render(self, pool: WorkerPool, units: list[PageUnit], prompts: Future,
                         use_features: bool) -> tuple[list[PageUnit], queue.Queue]:
        ordered = self._plan(units, prompts)
        return ordered, self._render_ahead(pool, ordered, use_features)

    def _generate(self, feed: Iterator[Request | None], cache: ResultCache | None) -> None:
        first = None
        for item in feed:  # rows that need no engine are written as the feed runs
            if item is not None:
                first = item
                break
        if first is None:
            return  # nothing to generate: the engine is never started
        if self.engine is None:  # not started early: start it now that there is work
            self.timings["to_first_request_s"] = self._lap()
            self._start_engine(self.prompts)

        def chained() -> Iterator[Request | None]:
            yield first
            yield from feed

        stream = chained()
        ready = time.monotonic()
        try:
            for done in self.engine.generate(stream):
                self._complete(done, cache)
            self.stats.generation_s = round(time.monotonic() - ready, 2)
            self._lap()
        except Exception as e:  # the engine died mid-run: every request left gets a row
            log.error("engine failed mid-run: %s", e)
            reason = f"engine failed: {e}"
            for _ in stream:  # the feed registers each request it yields as pending
                pass
            for request_id in list(self._pending):
                self._complete(Completion(request_id, None, reason), cache)

    def _render_and_generate(self, pool: WorkerPool, units: list[PageUnit], prompts: Future,
                             features: FeatureCache | None, cache: ResultCache | None) -> None:
        """This machine: render in worker processes, generate with one engine here."""
        planned = _in_background(self._plan_and_render, pool, units, prompts, features is not None)
        if self._worth_starting_early(units, features):
            # the engine takes longest to start (a minute on a GPU): start it now, while a
            # thread plans and the workers render ahead
            self._start_engine(prompts)
        units, rendered = planned.result()
        self._generate(self._feed(units, rendered, cache), cache)

    # ----- the run -----
    def execute(self) -> RunStats:
        job, stats = self.job, self.stats
        started = time.monotonic()
        output = OutputFolder(job.output)
        with output.lock():
            self._lap()
            sources = discover(job.inputs, job.base_dir)
            self.timings["discover_s"] = self._lap()
            if not sources:
                raise JobCannotRunError(f"no inputs matched {job.inputs} (relative to {job.base_dir})")
            stats.sources = len(sources)
            cache = ResultCache(job.cache, job.cache_size_gib) if job.result_cache else None
            features = FeatureCache(job.cache, job.cache_size_gib) if job.feature_cache else None
            self.deduper = Deduper(job.dedupe, index=features)
            self.results = PartWriter(output.results, stats.run_id, RESULT_SCHEMA,
                                      job.part_rows, job.part_seconds)
            self.pages = PartWriter(output.pages, stats.run_id, PAGE_SCHEMA,
                                    job.part_rows, job.part_seconds)
            workers = default_workers(job.render.workers)
            status = "failed"
            try:
                with WorkerPool(workers, job.render.page_timeout_s) as pool:
                    prompts = _in_background(self.prompts_factory, job)  # while probing
                    units = page_units(sources, self._probe_all(pool, sources))
                    self.timings["probe_s"] = self._lap()
                    scope = units if self.limit is None else units[:self.limit]
                    todo = select_todo(scope, job.tasks, self._is_done(output.done_keys(
                        self.retry_errors)))
                    stats.pages_total, stats.pages_todo = len(scope), len(todo)
                    stats.pages_already_done = len(scope) - len(todo)
                    stats.requests_total = sum(len(u.tasks) for u in todo)
                    self._tasks_left = {u.order: len(u.tasks) for u in todo}
                    for unit in todo:
                        if unit.error:
                            self._page_row(unit, None, unit.error)
                            self._error_rows(unit, unit.error)
                    renderable = [u for u in todo if not u.error]
                    if renderable:
                        self._render_and_generate(pool, renderable, prompts, features, cache)
                status = "finished"
            finally:
                self._lap()
                self.results.flush()
                self.pages.flush()
                if self.engine is not None:
                    self.engine.close()
                for opened in (cache, features):
                    if opened is not None:
                        stats.cache_corrupt += opened.corrupt
                        opened.close()
                self.timings["finish_s"] = self._lap()
                stats.seconds = round(time.monotonic() - started, 2)
                stats.pages_per_s = round(stats.pages_finished / stats.seconds, 3) if stats.seconds else 0.0
                output.write_manifest(stats.run_id, self._manifest(status, sources))
        rate = stats.pages_with_errors / stats.pages_todo if stats.pages_todo else 0.0
        if rate > job.max_error_rate:
            raise ErrorBudgetExceeded(
                f"{stats.pages_with_errors} of {stats.pages_todo} pages failed "
                f"({rate:.1%}), over max_error_rate {job.max_error_rate:.1%}")
        return stats

    def _manifest(self, status: str, sources) -> dict:
        return {
            "run_id": self.stats.run_id, "status": status, "job": self.job.name,
            "config_hash": self.job.config_hash(),
            "config": self.job.model_dump(mode="json", exclude={"base_dir"}),
            "limit": self.limit, "retry_errors": self.retry_errors,
            "inputs": [{"path": s.path, "sha256": s.sha256, "size": s.size} for s in sources],
            "versions": {"vlbatch": __version__, "vllm": self.engine_version,
                         "model": self.job.model},
            "summary": asdict(self.stats),
            "finished_at": datetime.now(timezone.utc).isoformat(),
        }


def job_run_for(job: Job, **kwargs) -> JobRun:
    """The run for the job's executor: this machine, or a Ray cluster."""
    if job.executor == "ray":
        from vlbatch.executor.ray_run import RayJobRun

        return RayJobRun(job, **kwargs)
    return JobRun(job, **kwargs)


def run_job(job: Job, **kwargs) -> RunStats:
    return job_run_for(job, **kwargs).execute()
