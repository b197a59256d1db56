"""One run of a job: the frame around the stages, the same for every executor.

    lock the output -> scope (discover, probe, what is still to do: a frozen Plan)
      -> the executor renders, routes and generates the plan into the sink
      -> the sink's rows are flushed and the run's manifest written -> the error budget

See docs/architecture.md for the stages, what flows between them and where each runs.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from datetime import datetime, timezone

from vlbatch import __version__
from vlbatch.cost import add_cost
from vlbatch.engine.base import GenerationEngine
from vlbatch.engine.vllm_engine import start_vllm_engine
from vlbatch.errors import ErrorBudgetExceeded, JobCannotRunError, RunInterrupted
from vlbatch.executor.context import RunContext
from vlbatch.job import Job
from vlbatch.pipeline import scope
from vlbatch.pipeline.cache import FeatureCache, ResultCache
from vlbatch.pipeline.render import RenderFailure, render_pool
from vlbatch.pipeline.sink import RunSink, RunStats
from vlbatch.pipeline.workers import default_workers
from vlbatch.output.folder import OutputFolder
from vlbatch.output.migrate import migrate_output, needs_migration
from vlbatch.output.history import held_among
from vlbatch.output.retire import retire_dropped_tasks, retire_stale
from vlbatch.output.source_index import write_index
from vlbatch.output.schemas import FIELDS_KEY, PAGE_KEY

ProgressCallback = Callable[[RunStats], None]
log = logging.getLogger("vlbatch")


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


def import_once() -> None:
    """transformers (and torch under it) imported on this thread, before the processor loads
    on another while vLLM imports them on this one. Two threads in transformers' lazy
    imports at once failed one engine start in 17: "cannot import name 'PreTrainedConfig'
    from 'transformers'" (issue 20)."""
    import transformers

    for name in ("PreTrainedConfig", "PretrainedConfig", "AutoConfig", "AutoProcessor",
                 "AutoTokenizer", "AutoImageProcessor", "ProcessorMixin"):
        getattr(transformers, name, None)  # each loads its submodule, here and now


def default_prompts(job: Job):
    """The model's processor (chat template, tokenizer): token counts for planning, and the
    prompts the engine sends. Loaded once, only when there are pages to render."""
    from vlbatch.engine.prompts import PromptBuilder

    try:
        return PromptBuilder(job.model_path(), job.engine.trust_remote_code)
    except Exception as e:  # not a model folder, not on the hub, no processor
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise JobCannotRunError(f"cannot load the model's processor from {job.model!r}: "
                                f"{reason}") from e


class _Laps:
    """Seconds per stage, into the run's timings."""

    def __init__(self, timings: dict[str, float]):
        self.timings, self.last = timings, time.monotonic()

    def __call__(self, name: str | None = None) -> None:
        now = time.monotonic()
        if name is not None:
            self.timings[name] = round(now - self.last, 2)
        self.last = now


def _executor(job: Job, engine_factory):
    if job.executor == "ray":
        from vlbatch.executor.ray_run import RayExecutor

        return RayExecutor(engine_factory)
    from vlbatch.executor.local import LocalExecutor

    return LocalExecutor()


def run_job(job: Job, *, limit: int | None = None, retry_errors: bool = False,
            engine_factory: Callable[[Job, object], GenerationEngine] = start_vllm_engine,
            prompts_factory: Callable[[Job], object] = default_prompts, verify: bool = False,
            progress: ProgressCallback | None = None,
            on_start: Callable[[RunStats], None] | None = None) -> RunStats:
    """Run the job; its stats. `on_start` gets the stats object as soon as it exists (the
    CLI shows it however the run ends)."""
    started = time.monotonic()
    missing = job.missing_model_folder()
    if missing is not None:  # said now, not after probing every input
        raise JobCannotRunError(missing)
    output = OutputFolder(job.output)
    with output.lock():
        if needs_migration(output):  # a folder of an earlier version's parts: once
            migrate_output(output)
        output.check_tables()  # a damaged table: exit 3 before anything is written
        run_id = new_run_id()
        results = ResultCache(job.tenant_cache, job.cache_size_gib) if job.result_cache else None
        sink = RunSink(job, run_id, output, results, progress)
        stats = sink.stats
        if on_start is not None:
            on_start(stats)
        lap = _Laps(stats.timings)
        features, plan, changes, status, closing_error = None, None, None, "failed", None
        reason: str | None = None  # why a run that did not finish stopped (the manifest)
        background = ThreadPoolExecutor(1, thread_name_prefix="vlbatch-load")
        try:
            features = FeatureCache(job.tenant_cache, job.cache_size_gib) if job.feature_cache else None
            with render_pool(job, default_workers(job.render.workers)) as pool:
                survey = scope.survey_inputs(job, output.root, pool, verify)
                lap("discover_s")
                changes = survey.changes
                stats.sources = changes.matched
                if survey.index_changed:  # what the hashes and probes learnt outlives a kill
                    write_index(output.root, survey.index)
                survey.index = None  # written or unchanged: not held while the night plans
                plan = scope.make_plan(job, survey.files, output.current_results(), limit,
                                       retry_errors)
                survey = None  # the night's files and index: given back
                lap("todo_s")
                # before anything is generated, so a night killed midway shows none of them
                stats.rows_retired = _retire_what_is_gone(job, output, list(sink.fields), run_id,
                                                         plan)
                lap("retire_s")
                sink.history = plan.history
                if plan.todo:  # which of the keys to do the pages and fields tables hold
                    pages = plan.todo_keys.select("source", "page")
                    sink.held = {"pages": held_among(output.table_keys(output.pages, PAGE_KEY),
                                                     pages, list(PAGE_KEY)),
                                 **{t: held_among(output.table_keys(output.fields / t, FIELDS_KEY),
                                                  plan.todo_keys, list(FIELDS_KEY))
                                    for t in sink.fields}}
                stats.pages_total, stats.pages_todo = plan.pages_in_scope, len(plan.todo)
                stats.pages_already_done = plan.pages_in_scope - len(plan.todo)
                stats.rows_stale = plan.stale
                sink.expect(plan.todo)
                for unit in plan.unopenable:
                    sink.page_failed(unit, RenderFailure(unit.error, unit.error))
                if plan.renderable:  # the processor loads while the engine starts
                    import_once()
                    prompts: Future = background.submit(prompts_factory, job)
                    context = RunContext(job, pool, prompts, features, results,
                                         engine_factory, lap)
                    _executor(job, engine_factory).run(context, plan.renderable, sink)
            status = "finished"
            budget_error = _over_error_budget(job, stats)
            if budget_error is not None:
                status, reason = "error_budget_exceeded", str(budget_error)
        except RunInterrupted as e:
            status, reason = "interrupted", str(e)
            raise
        except PermissionError as e:  # a folder of the output or cache that cannot be written
            reason = f"cannot write {e.filename or 'the output'}: {e.strerror or e}"
            raise JobCannotRunError(reason) from e
        except BaseException as e:
            reason = str(e) or type(e).__name__
            raise
        finally:
            background.shutdown(wait=False)
            lap()
            sink.close()
            for opened in (results, features):
                if opened is not None:
                    stats.cache_corrupt += opened.corrupt
                    try:
                        opened.close()
                    except JobCannotRunError as e:  # said after the manifest is written
                        status, closing_error, reason = "failed", e, str(e)
            lap("finish_s")
            stats.seconds = round(time.monotonic() - started, 2)
            stats.pages_per_s = round(stats.pages_finished / stats.seconds, 3) if stats.seconds else 0.0
            add_cost(job, stats, stats.engine_start_s is not None)
            manifest = _manifest(job, stats, status, changes,
                                 sink.engine_version, limit,
                                 retry_errors)
            manifest.update(reason=reason, timeline=sink.timeline.as_dict(),
                            slowest_files=sink.file_log.slowest())
            output.write_manifest(run_id, manifest)
            if job.report:
                _write_report(output, run_id)
    if closing_error is not None:
        raise closing_error
    if budget_error is not None:
        raise budget_error
    return stats


def _retire_what_is_gone(job: Job, output: OutputFolder, typed: list[str], run_id: str,
                         plan: scope.Plan) -> int:
    """Retires the rows no input or task stands behind now (vanished, moved, shortened or
    unreadable files; tasks taken out of the job); the results rows retired."""
    retired = retire_stale([*(output.fields / t for t in typed), output.results, output.pages],
                           run_id, plan.pages)
    dropped = retire_dropped_tasks(output.results, output.fields, run_id,
                                   [t.name for t in job.tasks], typed)
    return retired.get(str(output.results), 0) + dropped.get(str(output.results), 0)


def _write_report(output: OutputFolder, run_id: str) -> None:
    """The run's HTML report beside its manifest. A report that cannot be made is said in
    the log; the run's outcome stays what it was."""
    from vlbatch.run_report import write_report

    try:
        path = write_report(output.root, run_id)
        log.info("report: %s", path)
    except Exception as e:  # noqa: BLE001 - the report is never worth a failed night
        log.warning("run report not written: %s", str(e) or type(e).__name__)


def _over_error_budget(job: Job, stats: RunStats) -> ErrorBudgetExceeded | None:
    rate = stats.pages_with_errors / stats.pages_todo if stats.pages_todo else 0.0
    if rate <= job.max_error_rate:
        return None
    return ErrorBudgetExceeded(f"{stats.pages_with_errors} of {stats.pages_todo} pages failed "
                               f"({rate:.1%}), over max_error_rate {job.max_error_rate:.1%}")


def _manifest(job: Job, stats: RunStats, status: str, changes, engine_version: str | None,
              limit: int | None, retry_errors: bool) -> dict:
    """The run's manifest; `inputs`: what this night saw change (survey.Changes), not every
    input."""
    return {
        "run_id": stats.run_id, "status": status, "job": job.name,
        "config_hash": job.config_hash(),
        "config": job.model_dump(mode="json", exclude={"base_dir"}, by_alias=True),
        "limit": limit, "retry_errors": retry_errors,
        "inputs": changes.as_dict() if changes is not None else None,
        "versions": {"vlbatch": __version__, "vllm": engine_version, "model": job.model},
        "summary": asdict(stats),
        "finished_at": datetime.now(timezone.utc).isoformat(),
    }
