"""scope: the job's inputs -> a frozen plan of what this run still has to do.

discover (globs, file hashes) -> probe (page counts and sizes, in worker processes, no
rendering) -> the first `limit` pages in input order -> minus the page x task rows earlier
runs finished in this output folder. Ordering for generation needs the model's token counts
and comes after (`order`), once the processor has loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vlbatch.errors import JobCannotRunError
from vlbatch.job import Job, Task
from vlbatch.pipeline import ingest
from vlbatch.pipeline.discover import Source, discover
from vlbatch.pipeline.plan import PageUnit, done_key, order_for_generation, page_units, select_todo
from vlbatch.pipeline.workers import WorkerPool
from vlbatch.pipeline.write import DoneKey


@dataclass(frozen=True)
class Plan:
    sources: tuple[Source, ...]
    pages_in_scope: int
    todo: tuple[PageUnit, ...]  # pages with tasks left, in input order

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
    for _, result in pool.imap(ingest.probe, sources, lambda s: (s.abs_path, r.dpi, r.pdf_password)):
        probes.append(result if isinstance(result, ingest.Probe)
                      else ingest.Probe("unknown", [], str(result)))
    return probes


def is_done_in(done: frozenset[DoneKey] | set[DoneKey]) -> Callable[[PageUnit, Task], bool]:
    return lambda unit, task: done_key(unit, task) in done


def make_plan(job: Job, sources: tuple[Source, ...], probes: list[ingest.Probe],
              done: frozenset[DoneKey] | set[DoneKey], limit: int | None = None) -> Plan:
    units = page_units(sources, probes)
    in_scope = units if limit is None else units[:limit]
    todo = select_todo(in_scope, job.tasks, is_done_in(done))
    return Plan(sources, len(in_scope), tuple(todo))


def order(job: Job, units: tuple[PageUnit, ...], prompts) -> list[PageUnit]:
    """The pages in the order to generate them (prompts: the model's PromptBuilder)."""
    return order_for_generation(units, prompts.text_tokens, job.render.min_pixels,
                                job.render.max_pixels)
