"""scope: the job's inputs -> a frozen plan of what this run still has to do.

discover (globs, file hashes) -> probe (page counts and sizes, in worker processes, no
rendering) -> the first `limit` pages in input order -> minus the page x task rows earlier
runs finished in this output folder. Ordering for generation needs the model's token counts
and comes after (`order`), once the processor has loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from vlbatch.errors import JobCannotRunError
from vlbatch.job import Job, Task
from vlbatch.pipeline import ingest
from vlbatch.pipeline.discover import Source, discover
from vlbatch.pipeline.identity import task_hashes
from vlbatch.pipeline.plan import PageUnit, done_key, order_for_generation, page_units, select_todo
from vlbatch.pipeline.workers import WorkerPool
from vlbatch.output.history import History

log = logging.getLogger("vlbatch")


@dataclass(frozen=True)
class Plan:
    sources: tuple[Source, ...]
    pages_in_scope: int
    todo: tuple[PageUnit, ...]  # pages with tasks left, in input order
    stale: int = 0  # rows to do again because their settings changed
    pages: tuple[tuple[str, int | None], ...] = ()  # every input page (path, page): all current rows

    @property
    def unopenable(self) -> tuple[PageUnit, ...]:
        """Files (or pages) that failed before rendering: error rows only."""
        return tuple(u for u in self.todo if u.error)

    @property
    def renderable(self) -> tuple[PageUnit, ...]:
        return tuple(u for u in self.todo if not u.error)


def find_sources(job: Job) -> tuple[Source, ...]:
    sources = tuple(discover(job.inputs, job.base_dir))
    if not sources:
        raise JobCannotRunError(f"no inputs matched {job.inputs} (relative to {job.base_dir})")
    return sources


def probe_all(pool: WorkerPool, job: Job, sources: tuple[Source, ...]) -> list[ingest.Probe]:
    r = job.render
    probes = []
    for _, result in pool.imap(ingest.probe, sources,
                               lambda s: (s.abs_path, r.dpi, r.pdf_password, r.max_image_megapixels)):
        probes.append(result if isinstance(result, ingest.Probe)
                      else ingest.Probe("unknown", [], str(result)))
    return probes


def is_done_in(history: History, hashes: dict[str, str],
               max_model_len: int | None = None) -> Callable[[PageUnit, Task], bool]:
    """A row is done when history says so, but for a request the engine refused under
    another engine.max_model_len than the job's now: its permanence depended on it."""
    limit = max_model_len or 0

    def done(unit: PageUnit, task: Task) -> bool:
        key = done_key(unit, task, hashes[task.name])
        if not history.is_done(key):
            return False
        refused = history.refused_under(key)
        return refused is None or refused == limit

    return done


def make_plan(job: Job, sources: tuple[Source, ...], probes: list[ingest.Probe],
              history: History, limit: int | None = None) -> Plan:
    """The pages in scope with the tasks earlier runs left to do. A row to do again whose
    page and task had a row under other settings (prompt, sampling, model, render) is
    stale, and counted."""
    units = page_units(sources, probes)
    in_scope = units if limit is None else units[:limit]
    hashes = task_hashes(job)
    todo = select_todo(in_scope, job.tasks, is_done_in(history, hashes, job.engine.max_model_len))
    stale = sum(history.was_answered(key) and not history.attempt(key)
                for key in (done_key(u, t, hashes[t.name]) for u in todo for t in u.tasks))
    return Plan(sources, len(in_scope), tuple(todo), stale,
                tuple((u.source.abs_path, u.page) for u in units))


def order(job: Job, units: tuple[PageUnit, ...], prompts) -> list[PageUnit]:
    """The pages in the order to generate them (prompts: the model's PromptBuilder). Pages
    whose requests are already too long for the model (before their text layer) are said
    before anything is generated: vLLM will refuse them."""
    ordered = order_for_generation(units, prompts.text_tokens, job.render.min_pixels,
                                   job.render.max_pixels)
    limit = job.engine.max_model_len
    too_long = [u for u in ordered if limit and u.est_tokens > limit]
    if too_long:
        log.warning("%d pages have a request of at least %d tokens, over engine.max_model_len "
                    "%d: vLLM will refuse those requests (error rows 'request rejected'); "
                    "raise max_model_len or lower render.max_pixels", len(too_long),
                    min(u.est_tokens for u in too_long), limit)
    return ordered
