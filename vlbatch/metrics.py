"""The run's outcome for monitoring: Prometheus text format, the node_exporter textfile
collector's convention (`--metrics-file` or the job's `metrics_file`), written atomically
(a temporary file in the same folder, synced, renamed), so the collector never reads half
a file and an alert fires on a failed night (`vlbatch_last_run_success == 0`)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlbatch.pipeline.sink import RunStats


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics_text(job: str, exit_code: int, status: str, stats: RunStats | None,
                 now: float | None = None) -> str:
    j = f'job="{_label(job)}"'
    rows = []

    def gauge(name: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        rows.append(f"# HELP vlbatch_last_run_{name} {help_text}")
        rows.append(f"# TYPE vlbatch_last_run_{name} gauge")
        for labels, value in samples:
            rows.append(f"vlbatch_last_run_{name}{{{j}{labels}}} {value:g}")

    gauge("success", "1 when the last run exited 0.", [("", int(exit_code == 0))])
    gauge("exit_code", "The last run's exit code (docs/contracts.md).", [("", exit_code)])
    gauge("status", "The last run's status, as a label.", [(f',status="{_label(status)}"', 1)])
    gauge("finished_timestamp_seconds", "When the last run ended (Unix time).",
          [("", round(now if now is not None else time.time(), 3))])
    if stats is not None:
        gauge("duration_seconds", "The last run's wall time.", [("", stats.seconds)])
        gauge("pages", "Pages the last run finished.", [("", stats.pages_finished)])
        gauge("rows", "Result rows the last run wrote, by status.",
              [(',status="ok"', stats.rows_ok), (',status="error"', stats.rows_error)])
        gauge("rows_transient", "Of the error rows, those the next run retries.",
              [("", stats.rows_transient)])
        gauge("cache_hits", "Rows answered from the result cache.", [("", stats.cache_hits)])
    return "\n".join(rows) + "\n"


def write_metrics(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
