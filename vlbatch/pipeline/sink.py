"""sink: routed pages and completions -> rows (the output's tables), counters, the result cache.

Both executors hand the sink the same things: a page that failed, a routed page (its page
row, and for each task an answer now, a copy to answer when its original is answered, or a
request in flight), and each completion. The sink is called from one thread only (locally
the run's main thread, on Ray the driver). Every planned page gets its rows: what was never
routed or answered gets error rows with the reason (`fail_unseen`, `fail_pending`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from vlbatch.engine.base import Completion
from vlbatch.pipeline.answers import checked_fields, fields_schema
from vlbatch.job import Job, Task
from vlbatch.pipeline.ingest import RENDERERS, RenderedPage
from vlbatch.pipeline.failures import error_kind
from vlbatch.pipeline.identity import task_hashes
from vlbatch.pipeline.plan import PageUnit, done_key
from vlbatch.pipeline.render import RenderFailure
from vlbatch.pipeline.route import RoutedPage, cached_answer
from vlbatch.pipeline.runlog import FileLog, Timeline
from vlbatch.output.folder import OutputFolder
from vlbatch.output.history import HeldKeys, History
from vlbatch.output.schemas import FIELDS_KEY, PAGE_KEY, PAGE_SCHEMA, RESULT_KEY, RESULT_SCHEMA
from vlbatch.output.table import TableWriter

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
    # rows, by where their answer came from
    generated: int = 0  # answers the engine generated in this run
    rejected: int = 0  # requests the engine refused (too long, bad image, ...)
    failed: int = 0  # requests that failed in the engine (it died, aborted them)
    copied: int = 0  # rows given the answer of a request sent for another page of this run
    cache_hits: int = 0  # rows answered from the result cache (earlier runs)
    # pages
    exact_copies: int = 0  # pages with the same pixels as an earlier page of this run
    near_copies: int = 0  # pages merged with a confirmed near-copy
    pixel_checks: int = 0  # the dedupe's pixel checks (at most 4 a page)
    comparisons_made: int = 0  # comparison images made on demand for them
    comparisons_failed: int = 0  # ... that could not be made (file changed, timeout): no merge
    pages_from_feature_cache: int = 0  # not rendered: read from the feature cache
    cache_corrupt: int = 0  # cache entries that did not decode (dropped, recomputed)
    rows_ok: int = 0
    rows_error: int = 0
    rows_transient: int = 0  # error rows the next run retries by itself (failures.py)
    engine_restarts: int = 0  # engines started again after one died mid-run
    retried: int = 0  # answers generated once more: they looped or broke their schema
    bad_answers: int = 0  # generated, but kept as errors (schema:, degenerate output)
    fields_rows: int = 0  # typed rows written to fields/<task>/
    rows_stale: int = 0  # rows done again: their prompt, sampling, model or render changed
    rows_retired: int = 0  # current rows retired: their file vanished, moved, shrank, broke
    pages_with_errors: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0  # of them, served from vLLM's prefix cache
    output_tokens: int = 0
    engine_start_s: float | None = None
    engine_device: str | None = None  # what the engine ran on: 'gpu', 'cpu' (vLLM's CPU build)
    generation_s: float | None = None  # from engine ready to the last answer
    seconds: float = 0.0
    pages_per_s: float = 0.0
    # what the run cost (cost.py): its wall time x the GPUs its engines held
    gpus: int = 0  # 0: no engine started (every answer came from the caches)
    gpu_hours: float = 0.0
    pages_per_gpu_hour: float | None = None
    cost_per_gpu_hour: float | None = None  # the job's, when it gives one
    cost: float | None = None
    cost_per_million_pages: float | None = None
    error_reasons: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage


@dataclass(frozen=True)
class _Row:
    """Where a result row goes: its page, task and page hashes."""

    unit: PageUnit
    task: Task
    hashes: tuple[str | None, str | None]


class AnswerBook:
    """Answers generated in this run, for the copies that share them: a copy waits until
    its original is answered, or gets the answer at once. With a result cache the texts
    live there (host memory stays flat); errors and, without a cache, texts live here."""

    def __init__(self, results=None):
        self.results = results  # a ResultCache, or None
        self.origin: dict[str, str] = {}  # key -> the page it was generated for
        self.kept: dict[str, Completion] = {}
        self.waiting: dict[str, list[tuple[_Row, str]]] = {}  # key -> copies, their origin

    def answer(self, key: str, origin: str, done: Completion) -> list[tuple[_Row, str]]:
        """Record an answer; the copies that waited for it."""
        self.origin[key] = origin
        if done.error is None and self.results is not None:
            self.results.put(key, {"output": done.text, "origin": origin,
                                   "prompt_tokens": done.prompt_tokens,
                                   "output_tokens": done.output_tokens,
                                   "finish_reason": done.finish_reason})
        else:
            self.kept[key] = done
        return self.waiting.pop(key, [])

    def lookup(self, key: str) -> Completion | None:
        """The answer of a key answered in this run; None while it is not."""
        if key not in self.origin:
            return None
        if key in self.kept:
            return self.kept[key]
        hit = self.results.get(key)
        return cached_answer(key, hit) if hit is not None else \
            Completion(key, None, "the answer of the page this copies was lost")

    def wait(self, key: str, row: _Row, origin: str) -> None:
        self.waiting.setdefault(key, []).append((row, origin))


class RunSink:
    def __init__(self, job: Job, run_id: str, output: OutputFolder, results=None,
                 progress: Callable[[RunStats], None] | None = None):
        self.job = job
        self.stats = RunStats(run_id=run_id)
        self.engine_version: str | None = None  # the engine that answered, as it reports it
        self.progress = progress or (lambda stats: None)
        self.history = History()  # the rows to do, as the results table held them (run.py)
        # which of their keys the pages and fields tables held then (run.py): a flush of
        # rows whose keys a table cannot hold yet is an append, else a merge
        self.held: dict[str, HeldKeys] = {}
        had_row = lambda row: self.history.has_row(row["source"], row["page"], row["task"])  # noqa: E731
        self.pages = TableWriter(output.pages, run_id, PAGE_SCHEMA, PAGE_KEY, job.part_rows,
                                 job.part_seconds, known=self._held("pages", PAGE_KEY))
        # a schema task's typed rows (answers.py), after their pages
        self.fields = {t.name: TableWriter(output.fields / t.name, run_id, fields_schema(t),
                                           FIELDS_KEY, job.part_rows, job.part_seconds,
                                           before_flush=self.pages.flush,
                                           known=self._held(t.name, FIELDS_KEY))
                       for t in job.tasks if t.answer_schema is not None}
        # pages and fields first: a reader never sees a result row without its page row
        self.results = TableWriter(output.results, run_id, RESULT_SCHEMA, RESULT_KEY,
                                   job.part_rows, job.part_seconds,
                                   before_flush=self._flush_pages_and_fields, known=had_row)
        self.book = AnswerBook(results)
        self.pending: dict[str, _Row] = {}  # request key -> the row its answer goes to
        self.unseen: dict[int, PageUnit] = {}  # planned pages without a page row yet
        self.tasks_left: dict[int, int] = {}
        self.error_pages: set[int] = set()
        self.task_hashes = task_hashes(job)
        self.timeline = Timeline()  # for the run report (runlog.py)
        self.file_log = FileLog()

    def _held(self, table: str, key: tuple[str, ...]) -> Callable[[dict], bool]:
        def held(row: dict) -> bool:
            keys = self.held.get(table)
            return keys is None or tuple(row[c] for c in key) in keys
        return held

    # ----- what the executors call -----
    def expect(self, units: Iterable[PageUnit]) -> None:
        for unit in units:
            self.unseen[unit.order] = unit
            self.tasks_left[unit.order] = len(unit.tasks)
            self.stats.requests_total += len(unit.tasks)
        self._sample(force=True)

    def page_failed(self, unit: PageUnit, failure: RenderFailure) -> None:
        if unit.order not in self.unseen:  # already accounted for (fail_unseen got there first)
            return
        self._page_row(unit, None, failure.page_error)
        self.file_log.page(unit.source.abs_path, failure.cost_s)
        for task in unit.tasks:
            self._row(_Row(unit, task, (None, None)), error=failure.row_error)

    def page_routed(self, unit: PageUnit, page: RenderedPage, routed: RoutedPage) -> None:
        if unit.order not in self.unseen:  # already accounted for (fail_unseen got there first)
            return
        s = self.stats
        self._page_row(unit, page, None)
        s.pages_from_feature_cache += page.from_cache
        s.cache_corrupt += page.healed
        s.exact_copies += routed.relation == "exact"
        s.near_copies += routed.relation == "near"
        self.file_log.page(unit.source.abs_path, page.render_s)
        hashes = (page.content_hash, page.phash)
        for route in routed.tasks:
            row = _Row(unit, route.task, hashes)
            if route.action == "generate":
                self.pending[route.key] = row
            elif route.action == "cached":
                s.cache_hits += 1
                self._answer_row(row, route.answer, route.origin, cached=True)
            else:
                answer = self.book.lookup(route.key)
                if answer is None:
                    self.book.wait(route.key, row, route.origin)
                else:
                    self._copy_row(row, answer, route.origin)
        self._sample()

    def completed(self, done: Completion) -> None:
        """An answer (or error) for a request in flight; its copies get it too."""
        row = self.pending.pop(done.request_id, None)
        if row is None:  # already failed by fail_pending
            return
        s = self.stats
        if done.error is None:
            s.generated += 1
        elif done.error_output is not None:  # generated, twice; answers.py said no
            s.bad_answers += 1
        elif done.rejected:
            s.rejected += 1
        else:
            s.failed += 1
        s.retried += done.tries > 1
        s.prompt_tokens += done.prompt_tokens or 0
        s.prompt_tokens_cached += done.cached_prompt_tokens or 0
        s.output_tokens += done.output_tokens or 0
        self.file_log.of(row.unit.source.abs_path).output_tokens += done.output_tokens or 0
        self._answer_row(row, done, None, cached=False)
        for copy, origin in self.book.answer(done.request_id, row.unit.ref, done):
            self._copy_row(copy, done, origin)

    def waiting_on_engine(self) -> bool:
        return bool(self.pending)

    def fail_pending(self, reason: str) -> None:
        """Requests never answered: error rows, for them and their copies."""
        for key in list(self.pending):
            self.completed(Completion(key, None, reason))

    def fail_unseen(self, reason: str) -> None:
        """Planned pages that never came back from rendering or routing: error rows."""
        for unit in list(self.unseen.values()):
            self.page_failed(unit, RenderFailure(reason, reason))

    def close(self) -> None:
        self._sample(force=True)
        self.results.flush()  # the pages and fields with it

    def _flush_pages_and_fields(self) -> None:
        self.pages.flush()
        for writer in self.fields.values():
            writer.flush()

    # ----- rows -----
    def _copy_row(self, row: _Row, answer: Completion, origin: str) -> None:
        self.stats.copied += 1
        self._answer_row(row, answer, origin, cached=True)

    def _answer_row(self, row: _Row, answer: Completion, origin: str | None, cached: bool) -> None:
        self._row(row, output=answer.text, error=answer.error, cached=cached,
                  reused_from=origin if origin != row.unit.ref else None,
                  prompt_tokens=answer.prompt_tokens, output_tokens=answer.output_tokens,
                  finish_reason=answer.finish_reason, tries=answer.tries,
                  error_output=answer.error_output)

    def _row(self, row: _Row, *, output: str | None = None, error: str | None = None,
             cached: bool = False, reused_from: str | None = None,
             prompt_tokens: int | None = None, output_tokens: int | None = None,
             finish_reason: str | None = None, tries: int = 1,
             error_output: str | None = None) -> None:
        unit, task, s = row.unit, row.task, self.stats
        finished_at = datetime.now(timezone.utc)
        if error is None and task.name in self.fields:
            error, error_output = self._fields_row(row, output, finished_at)
        if error is not None and task.name in self.fields and self._held(task.name, FIELDS_KEY)(
                dict(source=unit.source.abs_path, page=unit.page, task=task.name)):
            # its earlier typed row is not current any more
            self.fields[task.name].remove(dict(source=unit.source.abs_path, page=unit.page,
                                               task=task.name))
        kind = error_kind(error)
        self.results.add(dict(
            source=unit.source.abs_path, page=unit.page, task=task.name,
            output=None if error is not None else output,
            status="error" if error is not None else "ok", error=error,
            content_hash=row.hashes[0], phash=row.hashes[1], cached=cached,
            reused_from=reused_from, model=self.job.model, run_id=s.run_id,
            source_sha256=unit.source.sha256, task_hash=self.task_hashes[task.name],
            prompt_tokens=prompt_tokens, output_tokens=output_tokens, finished_at=finished_at,
            attempt=self.history.attempt(done_key(unit, task, self.task_hashes[task.name])) + tries,
            error_kind=kind, matched_path=unit.source.path, finish_reason=finish_reason,
            error_output=error_output))
        if error is None:
            s.rows_ok += 1
        else:
            s.rows_error += 1
            s.rows_transient += kind == "transient"
            self.file_log.of(unit.source.abs_path).rows_error += 1
            self.error_pages.add(unit.order)
            s.pages_with_errors = len(self.error_pages)
            reason = error.split(":")[0][:80]
            s.error_reasons[reason] = s.error_reasons.get(reason, 0) + 1
        self.tasks_left[unit.order] -= 1
        if self.tasks_left[unit.order] == 0:
            s.pages_finished += 1
        s.requests_finished += 1
        self._sample()
        self.progress(s)

    def _sample(self, force: bool = False) -> None:
        s = self.stats
        self.timeline.sample(s.pages_finished, s.requests_finished, len(self.pending),
                             s.output_tokens, s.rows_error, force)

    def _fields_row(self, row: _Row, output: str | None,
                    finished_at: datetime) -> tuple[str | None, str | None]:
        """The typed row of an ok answer of a schema task; (error, its text) when the answer
        does not fit (checked when generated; an answer from a cache or a copy is checked
        here again)."""
        values, problem = checked_fields(row.task, output or "", None)
        if problem is not None:
            return problem, output
        unit = row.unit
        self.fields[row.task.name].add(dict(
            source=unit.source.abs_path, page=unit.page, task=row.task.name,
            run_id=self.stats.run_id, finished_at=finished_at, content_hash=row.hashes[0],
            **values))
        self.stats.fields_rows += 1
        return None, None

    def _page_row(self, unit: PageUnit, page: RenderedPage | None, error: str | None) -> None:
        self.unseen.pop(unit.order, None)
        self.pages.add(dict(
            source=unit.source.abs_path, page=unit.page, matched_path=unit.source.path,
            width=page.width if page else None, height=page.height if page else None,
            text_layer=page.text_layer if page else None,
            content_hash=page.content_hash if page else None,
            phash=page.phash if page else None, source_sha256=unit.source.sha256,
            error=error, run_id=self.stats.run_id,
            renderer=RENDERERS.get(unit.kind) if page else None))
