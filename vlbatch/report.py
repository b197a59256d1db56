"""report: progress while a run goes (a rich display on a terminal, a plain log line every
N seconds without one, e.g. under cron) and the summary at the end."""

from __future__ import annotations

import logging
import threading
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from vlbatch.cost import cost_rows
from vlbatch.pipeline.sink import RunStats

log = logging.getLogger("vlbatch")


class ProgressReporter:
    """Called by the run after every row; redraws or logs at most every `interval_s`.
    Without a terminal a line also comes every `interval_s` when no row does (the engine
    starting, long generations), so a log never goes quiet longer than it says."""

    def __init__(self, console: Console, interval_s: float = 30.0):
        self.console = console
        self.live = console.is_terminal
        self.interval_s = 0.2 if self.live else interval_s
        self.last = 0.0
        self.started = time.monotonic()
        self._progress: Progress | None = None
        self._task = None
        self._stats: RunStats | None = None
        self._stop = threading.Event()

    def watch(self, stats: RunStats) -> None:
        """The run's stats, as soon as it has them: the heartbeat reports them."""
        self._stats = stats
        if not self.live:
            threading.Thread(target=self._heartbeat, name="vlbatch-progress", daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(1.0, self.interval_s)):
            if self._stats is not None and time.monotonic() - self.last >= self.interval_s:
                self(self._stats, force=True)

    def __enter__(self) -> ProgressReporter:
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"), TimeRemainingColumn(),
                console=self.console, transient=False)
            self._progress.start()
            self._task = self._progress.add_task("pages", total=None, detail="starting")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, s: RunStats, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.interval_s:
            return
        self.last = now
        elapsed = max(now - self.started, 1e-9)
        detail = (f"{s.pages_finished / elapsed:.2f} pages/s  {s.output_tokens / elapsed:.0f} tok/s  "
                  f"requests {s.requests_finished}/{s.requests_total}  cache hits {s.cache_hits}  "
                  f"copies {s.copied}  errors {s.rows_error}")
        if self._progress is not None:
            self._progress.update(self._task, total=s.pages_todo, completed=s.pages_finished,
                                  detail=detail)
        else:
            log.info("pages %d/%d  %s", s.pages_finished, s.pages_todo, detail)


def prefix_cache_share(s: RunStats) -> str:
    """How much of the generated requests' prompts vLLM served from its prefix cache: a
    page's later tasks reuse its image there, so several questions a page show up here."""
    if not s.prompt_tokens:
        return "-"
    return f"{s.prompt_tokens_cached} of {s.prompt_tokens} ({100 * s.prompt_tokens_cached / s.prompt_tokens:.0f}%)"


def summary_table(s: RunStats) -> Table:
    table = Table(title=f"run {s.run_id}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("sources", s.sources), ("pages in scope", s.pages_total),
        ("pages already done", s.pages_already_done), ("pages processed", s.pages_finished),
        ("rows stale (settings changed)", s.rows_stale),
        ("rows retired (their file, page or task is gone)", s.rows_retired),
        ("requests", s.requests_total), ("generated", s.generated),
        ("rejected by the engine", s.rejected), ("failed in the engine", s.failed),
        ("answers generated twice (looped, broke schema)", s.retried),
        ("answers kept as errors after that", s.bad_answers),
        ("typed fields rows", s.fields_rows),
        ("copies (answers shared in this run)", s.copied),
        ("cache hits (answers from earlier runs)", s.cache_hits),
        ("exact-copy pages", s.exact_copies), ("near-copy pages", s.near_copies),
        ("pages from feature cache", s.pages_from_feature_cache),
        ("rows ok", s.rows_ok), ("rows error", s.rows_error),
        ("of them transient (the next run retries)", s.rows_transient),
        ("engine restarts", s.engine_restarts),
        ("pages with errors", s.pages_with_errors), ("output tokens", s.output_tokens),
        ("prompt tokens from vLLM's prefix cache", prefix_cache_share(s)),
        ("engine start (s)", "-" if s.engine_start_s is None else f"{s.engine_start_s:.1f}"),
        ("seconds", f"{s.seconds:.1f}"), ("pages/s", f"{s.pages_per_s:.2f}"),
        ("pages/s while generating", "-" if not s.generation_s else
         f"{s.pages_finished / s.generation_s:.2f}"),
    ]
    rows += cost_rows(s)
    for name, value in rows:
        table.add_row(name, str(value))
    if s.error_reasons:
        top = sorted(s.error_reasons.items(), key=lambda kv: -kv[1])[:5]
        table.add_row("top errors", "; ".join(f"{r} ({n})" for r, n in top))
    return table
