"""`vlbatch plan JOB.yaml`: what a run of the job would do, without running it.

The same scope as a run (discover, probe in worker processes, the output's history), then
estimates: prompt tokens from the page sizes and the model's tokenizer, output tokens from
the answers earlier runs generated in this output (else max_tokens, an upper bound), and
the time from the newest earlier run's rate in that output. No engine starts, nothing is
rendered and nothing is written: an output folder that does not exist is not made.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

from vlbatch.errors import JobCannotRunError
from vlbatch.job import Job
from vlbatch.pipeline import scope
from vlbatch.pipeline.imaging import IMAGE_FACTOR
from vlbatch.pipeline.plan import PageUnit, image_tokens
from vlbatch.pipeline.render import render_pool
from vlbatch.pipeline.workers import default_workers
from vlbatch.output.history import current_rows
from vlbatch.output.folder import OutputFolder

PROBE_WORKERS = 4  # at most: a plan is a quick look, not a run


@dataclass
class RunPlan:
    job: str
    output: str
    inputs_matched: int
    inputs_unreadable: int
    pages_in_scope: int
    pages_unopenable: int  # files and pages that fail before rendering: error rows only
    pages_already_done: int
    pages_to_do: int
    rows_stale: int  # rows done again: their settings changed
    requests: int  # page x task requests to send, before dedupe and the result cache
    requests_by_task: dict[str, int]
    prompt_tokens: int | None  # estimated, before any text layer
    prompt_tokens_note: str
    output_tokens: int | None
    output_tokens_note: str
    estimated_seconds: float | None
    estimate_note: str
    probe_s: float
    notes: list[str] = field(default_factory=list)


def plan_job(job: Job, *, limit: int | None = None, retry_errors: bool = False,
             prompts_factory=None, verify: bool = False) -> RunPlan:
    """The plan of a run of `job` now (prompts_factory: the model's PromptBuilder, as in
    run_job; its failure makes the token estimate rougher, not the plan fail)."""
    missing = job.missing_model_folder()
    if missing is not None:
        raise JobCannotRunError(missing)
    started = time.monotonic()
    exists = (job.output / "_runs").is_dir()
    output = OutputFolder(job.output, create=False) if exists else None
    workers = min(PROBE_WORKERS, default_workers(job.render.workers))
    with render_pool(job, workers) as pool:  # the night's own survey; its index not written
        survey = scope.survey_inputs(job, job.output, pool, verify)
    current = output.current_results() if output else current_rows(iter(()))
    plan = scope.make_plan(job, survey.files, current, limit, retry_errors)
    probe_s = round(time.monotonic() - started, 2)
    todo = plan.renderable
    by_task = Counter(t.name for u in todo for t in u.tasks)
    requests = sum(by_task.values())
    prompt_tokens, prompt_note = _prompt_tokens(job, todo, prompts_factory)
    output_tokens, output_note = _output_tokens(job, by_task, output)
    seconds, estimate_note = _estimate_seconds(output, requests, probe_s)
    notes = []
    if not exists:
        notes.append(f"no earlier run in {job.output}: every page is to do")
    if requests:
        notes.append("requests are an upper bound: exact and near copies and result-cache "
                     "hits are found while rendering")
    return RunPlan(
        job=job.name, output=str(job.output), inputs_matched=plan.inputs,
        inputs_unreadable=plan.unreadable,
        pages_in_scope=plan.pages_in_scope, pages_unopenable=len(plan.unopenable),
        pages_already_done=plan.pages_in_scope - len(plan.todo), pages_to_do=len(plan.todo),
        rows_stale=plan.stale, requests=requests, requests_by_task=dict(by_task),
        prompt_tokens=prompt_tokens, prompt_tokens_note=prompt_note,
        output_tokens=output_tokens, output_tokens_note=output_note,
        estimated_seconds=seconds, estimate_note=estimate_note, probe_s=probe_s, notes=notes)


def _prompt_tokens(job: Job, todo: tuple[PageUnit, ...], prompts_factory) -> tuple[int | None, str]:
    if not todo:
        return 0, "nothing to do"
    prompts, why = None, ""
    if prompts_factory is not None:
        try:
            prompts = prompts_factory(job)
        except Exception as e:  # noqa: BLE001 - a rougher estimate, said
            why = f" (the model's tokenizer did not load: {str(e) or type(e).__name__})"
    factor = getattr(prompts, "image_factor", IMAGE_FACTOR)
    total = 0
    for unit in todo:
        image = image_tokens(unit, job.render.min_pixels, job.render.max_pixels, factor)
        for task in unit.tasks:
            text = task.render_prompt(text_layer="", source=unit.source.path, page=unit.page)
            total += image + (prompts.text_tokens(text) if prompts else len(text) // 4 + 20)
    how = "the model's tokenizer" if prompts else "about 4 characters a token" + why
    return total, f"image tokens from page sizes, text by {how}; any text layer not counted"


def _output_tokens(job: Job, by_task: Counter, output: OutputFolder | None) -> tuple[int | None, str]:
    if not by_task:
        return 0, "nothing to do"
    means = _mean_output_tokens(output) if output else {}
    total, guessed = 0, []
    for task in job.tasks:
        n = by_task.get(task.name, 0)
        if not n:
            continue
        if task.name in means:
            total += round(means[task.name] * n)
        else:
            total += task.max_tokens * n
            guessed.append(task.name)
    if not guessed:
        return total, "the mean of the answers earlier runs wrote in this output, per task"
    return total, (f"max_tokens (an upper bound) for {', '.join(guessed)}: no earlier answers "
                   f"in this output; else the mean of earlier answers in this output, per task")


def _mean_output_tokens(output: OutputFolder) -> dict[str, float]:
    import pyarrow as pa
    import pyarrow.compute as pc

    sums: Counter = Counter()
    counts: Counter = Counter()
    for batch in output.result_batches(["task", "output_tokens"]):
        table = pa.Table.from_batches([batch])
        if "output_tokens" not in table.column_names:
            continue
        generated = table.filter(pc.is_valid(table["output_tokens"]))  # cached ones too
        for row in generated.group_by("task").aggregate([("output_tokens", "sum"),
                                                         ("output_tokens", "count")]).to_pylist():
            sums[row["task"]] += row["output_tokens_sum"]
            counts[row["task"]] += row["output_tokens_count"]
    return {task: sums[task] / counts[task] for task in counts if counts[task]}


def _estimate_seconds(output: OutputFolder | None, requests: int,
                      probe_s: float) -> tuple[float | None, str]:
    if not requests:
        return round(probe_s, 1), "nothing to generate: about the time to scan the inputs"
    for summary, run_id in _earlier_runs(output):
        answered = (summary.get("generated") or 0) + (summary.get("bad_answers") or 0)
        if answered and summary.get("generation_s"):  # bad answers were generated too
            rate = answered / summary["generation_s"]
            start = summary.get("engine_start_s") or 0.0
            seconds = probe_s + start + requests / rate
            return round(seconds, 1), (f"run {run_id}: {rate:.2f} requests/s while generating, "
                                       f"engine start {start:.0f} s; before dedupe and caches")
    return None, "no earlier run in this output generated anything: no rate to estimate from"


def _earlier_runs(output: OutputFolder | None):
    """(summary, run_id) of the output's runs, newest first."""
    if output is None:
        return
    for path in sorted(output.runs.glob("*.json"), reverse=True):
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a manifest that does not read is no help to an estimate
        yield manifest.get("summary", {}), manifest.get("run_id", path.stem)


def plan_rows(plan: RunPlan) -> list[tuple[str, str]]:
    """The plan as (what, figure) lines for the CLI's table."""
    def n(value):
        return "unknown" if value is None else f"{value:,}"

    seconds = plan.estimated_seconds
    rows = [("inputs matched", n(plan.inputs_matched)),
            ("inputs unreadable", n(plan.inputs_unreadable)),
            ("pages in scope", n(plan.pages_in_scope)),
            ("pages already done", n(plan.pages_already_done)),
            ("pages to do", n(plan.pages_to_do)),
            ("  of them failing before rendering (error rows)", n(plan.pages_unopenable)),
            ("rows stale (settings changed)", n(plan.rows_stale)),
            ("requests to generate (at most)", n(plan.requests))]
    rows += [(f"  task {task}", n(count)) for task, count in plan.requests_by_task.items()]
    rows += [("prompt tokens (estimated)", n(plan.prompt_tokens)),
             ("  how", plan.prompt_tokens_note),
             ("output tokens (estimated)", n(plan.output_tokens)),
             ("  how", plan.output_tokens_note),
             ("time (estimated)", "unknown" if seconds is None else _duration(seconds)),
             ("  how", plan.estimate_note),
             ("scanning the inputs took", f"{plan.probe_s:.1f} s")]
    return rows + [("note", note) for note in plan.notes]


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
