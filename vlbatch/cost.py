"""cost: what a run cost in GPU time, and in money when the job says what a GPU-hour costs.

GPU-hours are the run's wall time times the GPUs its engines held (`Job.gpus`): on a
rented or dedicated GPU server that is what the night costs, engine start, rendering and
waiting on the CPU included. A run that never started an engine (every answer from the
caches) held none: 0 GPU-hours, cost 0; nor did one whose engine ran on the CPU (vLLM's CPU
build): its summary says so instead of GPU figures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlbatch.job import Job
    from vlbatch.pipeline.sink import RunStats


def add_cost(job: Job, stats: RunStats, engine_started: bool) -> None:
    """Fill the stats' GPU and cost figures from its `seconds` and `pages_finished`."""
    stats.gpus = job.gpus() if engine_started and stats.engine_device != "cpu" else 0
    stats.gpu_hours = round(stats.gpus * stats.seconds / 3600, 6)
    stats.pages_per_gpu_hour = (round(stats.pages_finished / stats.gpu_hours, 1)
                                if stats.gpu_hours else None)
    stats.cost_per_gpu_hour = job.cost_per_gpu_hour
    if job.cost_per_gpu_hour is None:
        return
    stats.cost = round(job.cost_per_gpu_hour * stats.gpu_hours, 6)
    stats.cost_per_million_pages = (round(stats.cost / stats.pages_finished * 1e6, 2)
                                    if stats.pages_finished else None)


def cost_rows(stats: RunStats) -> list[tuple[str, str]]:
    """The cost lines of the summary table and the report."""
    if stats.engine_device == "cpu":
        return [("engine ran on", "the CPU (vLLM's CPU build): no GPU held")]
    rows = [("GPUs held", str(stats.gpus)), ("GPU-hours", f"{stats.gpu_hours:.4f}"),
            ("pages per GPU-hour", "-" if stats.pages_per_gpu_hour is None
             else f"{stats.pages_per_gpu_hour:,.0f}")]
    if stats.cost_per_gpu_hour is not None:
        rows += [("cost (at %g a GPU-hour)" % stats.cost_per_gpu_hour, f"{stats.cost:.4f}"),
                 ("cost per million pages", "-" if stats.cost_per_million_pages is None
                  else f"{stats.cost_per_million_pages:,.2f}")]
    return rows
