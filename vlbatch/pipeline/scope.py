"""scope: the job's inputs -> a frozen plan of what this run still has to do.

survey (globs, stat; hashes and probes, in worker processes, of the new and changed files
only: survey.py) -> the first `limit` pages in input order -> minus the page x task rows
earlier runs finished in this output folder (history.judge, in columns). Ordering for
generation needs the model's token counts and comes after (`order`), once the processor has loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import polars as pl
import pyarrow as pa

from vlbatch.job import Job
from vlbatch.pipeline import ingest
from vlbatch.pipeline.discover import Source
from vlbatch.pipeline.identity import task_hashes
from vlbatch.pipeline.plan import PageUnit, order_for_generation
from vlbatch.pipeline.survey import Survey, survey
from vlbatch.pipeline.workers import WorkerPool
from vlbatch.output.history import History, judge

log = logging.getLogger("vlbatch")
PAGES = pa.schema([("source", pa.string()), ("page", pa.int32())])


@dataclass(frozen=True)
class Plan:
    inputs: int  # files the globs matched
    pages_in_scope: int
    todo: tuple[PageUnit, ...]  # pages with tasks left, in input order
    stale: int = 0  # rows to do again because their settings changed
    pages: pa.Table = field(default_factory=PAGES.empty_table)  # every input page: all current rows
    history: History = field(default_factory=History)  # what the sink asks about the rows to do
    unreadable: int = 0  # files that could not be read
    todo_keys: pl.DataFrame | None = None  # (source, page, task) of the rows to do

    @property
    def unopenable(self) -> tuple[PageUnit, ...]:
        """Files (or pages) that failed before rendering: error rows only."""
        return tuple(u for u in self.todo if u.error)

    @property
    def renderable(self) -> tuple[PageUnit, ...]:
        return tuple(u for u in self.todo if not u.error)


def probe_all(pool: WorkerPool, job: Job, sources: list[Source]) -> list[ingest.Probe]:
    r = job.render
    probes = []
    for _, result in pool.imap(ingest.probe, sources,
                               lambda s: (s.abs_path, r.dpi, r.pdf_password, r.max_image_megapixels)):
        probes.append(result if isinstance(result, ingest.Probe)
                      else ingest.Probe("unknown", [], str(result)))
    return probes


def survey_inputs(job: Job, output_root, pool: WorkerPool, verify: bool = False) -> Survey:
    """Every input with its hash and probe, hashing and probing only what is new."""
    return survey(job, output_root, lambda sources: probe_all(pool, job, sources), verify)


def unit_frame(files: pl.DataFrame) -> pl.DataFrame:
    """One row per page of each file (page null: the file itself failed), in input order,
    numbered (`order`)."""
    failed = pl.col("read_error").is_not_null() | pl.col("probe_error").is_not_null()
    bad = files.filter(failed).select(
        "file_order", "shown", "path", "size", "sha256", pl.col("kind").fill_null("unknown"),
        pl.lit(None, pl.Int32).alias("page"), pl.lit(0, pl.Int32).alias("width"),
        pl.lit(0, pl.Int32).alias("height"),
        pl.coalesce("read_error", "probe_error").alias("error"))
    good = files.filter(~failed).select("file_order", "shown", "path", "size", "sha256", "kind",
                                        "pages").explode("pages").unnest("pages")
    good = good.with_columns(  # a file probed with no pages and no reason (never expected)
        error=pl.when(pl.col("page").is_null() & pl.col("error").is_null())
        .then(pl.lit("the file has no pages")).otherwise(pl.col("error")),
        width=pl.col("width").fill_null(0), height=pl.col("height").fill_null(0))
    units = pl.concat([good.select(bad.columns), bad]).sort(["file_order", "page"],
                                                            nulls_last=False, maintain_order=True)
    return units.with_row_index("order")


def make_plan(job: Job, files: pl.DataFrame, current: pl.DataFrame, limit: int | None = None,
              retry_errors: bool = False) -> Plan:
    """The pages in scope with the tasks earlier runs left to do (history.judge). A row to
    do again whose page and task had a row for the same file under other settings (prompt,
    sampling, model, render) is stale, and counted."""
    units = unit_frame(files)
    in_scope = units if limit is None else units.head(limit)
    hashes = task_hashes(job)
    tasks = pl.DataFrame({"task": [t.name for t in job.tasks],
                          "task_hash": [hashes[t.name] for t in job.tasks],
                          "task_index": list(range(len(job.tasks)))},
                         schema={"task": pl.String, "task_hash": pl.String, "task_index": pl.Int64})
    wanted = in_scope.select("order", pl.col("path").alias("source"), "page", "sha256") \
        .join(tasks, how="cross")
    judged = judge(wanted, current, retry_errors=retry_errors, max_attempts=job.max_attempts,
                   max_model_len=job.engine.max_model_len)
    todo_rows = judged.filter(~pl.col("done"))
    stale = todo_rows.filter(pl.col("answered") & (pl.col("attempt") == 0)).height
    by_name = {t.name: t for t in job.tasks}
    left = todo_rows.sort(["order", "task_index"]).group_by("order", maintain_order=True) \
        .agg(pl.col("task"))
    todo, sources = [], {}
    for row in in_scope.join(left, on="order", how="inner", maintain_order="left") \
            .iter_rows(named=True):
        source = sources.get(row["path"])
        if source is None:
            source = sources[row["path"]] = Source(
                row["shown"], row["path"], row["size"], row["sha256"],
                row["error"] if row["sha256"] is None else None)
        todo.append(PageUnit(row["order"], source, row["kind"], row["page"], row["width"],
                             row["height"], error=row["error"],
                             tasks=tuple(by_name[t] for t in row["task"])))
    pages = units.select(pl.col("path").alias("source"), "page").to_arrow().cast(PAGES)
    return Plan(files.height, in_scope.height, tuple(todo), stale, pages,
                History.of_todo(todo_rows), int(files["read_error"].is_not_null().sum()),
                todo_rows.select("source", "page", "task"))


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
