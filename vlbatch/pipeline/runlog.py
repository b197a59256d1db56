"""runlog: what the run report plots, gathered while the run goes, in bounded memory.

`Timeline`: the run's counters sampled over time (pages and requests finished, requests
waiting on the engine, output tokens, error rows). At most `max_samples` are kept: when
full, every other sample goes and the interval doubles, so a 10-hour run keeps as many
points as a 10-minute one. `FileLog`: render seconds, pages, output tokens and error rows
per input file, for the report's "slowest files" (the manifest keeps the top ones only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

TIMELINE_COLUMNS = ("t_s", "pages", "requests", "waiting_on_engine", "output_tokens",
                    "rows_error")


class Timeline:
    def __init__(self, interval_s: float = 1.0, max_samples: int = 1200,
                 clock=time.monotonic):
        self.interval_s, self.max_samples, self.clock = interval_s, max_samples, clock
        self.started = clock()
        self.samples: list[tuple] = []
        self._last = float("-inf")

    def sample(self, pages: int, requests: int, waiting: int, output_tokens: int,
               rows_error: int, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        row = (round(now - self.started, 3), pages, requests, waiting, output_tokens, rows_error)
        if force and self.samples and self.samples[-1][0] == row[0]:
            self.samples[-1] = row
            return
        self.samples.append(row)
        if len(self.samples) >= self.max_samples:
            self.samples = self.samples[::2] if len(self.samples) % 2 else \
                [*self.samples[:-1:2], self.samples[-1]]  # the newest sample stays
            self.interval_s *= 2

    def as_dict(self) -> dict:
        return {"columns": list(TIMELINE_COLUMNS), "interval_s": self.interval_s,
                "rows": [list(r) for r in self.samples]}


@dataclass
class FileFigures:
    pages: int = 0
    render_s: float = 0.0
    output_tokens: int = 0
    rows_error: int = 0


class FileLog:
    def __init__(self):
        self.files: dict[str, FileFigures] = {}

    def of(self, source: str) -> FileFigures:
        figures = self.files.get(source)
        if figures is None:
            figures = self.files[source] = FileFigures()
        return figures

    def page(self, source: str, render_s: float) -> None:
        """One of the file's pages rendered (or failed), with the seconds it cost."""
        figures = self.of(source)
        figures.pages += 1
        figures.render_s += render_s

    def slowest(self, n: int = 20) -> list[dict]:
        """The `n` files that took the most render seconds (ties: more pages first)."""
        top = sorted(self.files.items(), key=lambda kv: (-kv[1].render_s, -kv[1].pages))[:n]
        return [{"source": s, "pages": f.pages, "render_s": round(f.render_s, 3),
                 "output_tokens": f.output_tokens, "rows_error": f.rows_error} for s, f in top]
