"""Which error rows the next run retries by itself.

Transient: the failure says nothing about the page: the engine died or refused the request
for resources, a page or file ran out of time, a worker process died, a page was lost
between stages. The next run generates such rows again, up to the job's `max_attempts`
(the `attempt` column counts them), and `--retry-errors` goes on past that.

Permanent: the same input fails the same way again: the file cannot be opened, is
encrypted, has no pages, a page fails to render, the prompt is longer than the model
allows. Only `--retry-errors` retries them.

vlbatch writes every error reason itself, so the reason's opening words say its class.
"""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal["transient", "permanent"]

TRANSIENT_REASONS = (
    "timeout:",  # a page's render time limit, or its file's (render.py, workers.py)
    "worker process died",
    "render pool failed",
    "lost between rendering and routing",
    "lost in the Ray pipeline",
    "Ray pipeline failed",
    "engine failed",  # the engine died mid-run (engine/loop.py)
    "engine returned no output",
    "request aborted by the engine",
    "request refused by the engine",  # not a bad request: resources (vllm_engine.py)
    "the answer of the page this copies was lost",
    "engine closed before a retry",
)


def error_kind(error: str | None) -> ErrorKind | None:
    if error is None:
        return None
    return "transient" if error.startswith(TRANSIENT_REASONS) else "permanent"
