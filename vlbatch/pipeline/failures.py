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
    "engine closed at shutdown",  # SIGTERM with requests in it (engine/loop.py)
)


REJECTED = "request rejected"


def rejection_prefix(max_model_len: int | None) -> str:
    """How a request the engine refused starts its error: with the limit it was refused
    under, so that raising (or changing) engine.max_model_len tries it again."""
    return f"{REJECTED} (engine.max_model_len {max_model_len or 'default'}): "


def refused_under(error: str | None) -> int | None:
    """The max_model_len a rejected row was refused under: the number, 0 for the model's
    default; None for any other row (and rejections written before the limit was named)."""
    prefix = f"{REJECTED} (engine.max_model_len "
    if not error or not error.startswith(prefix):
        return None
    limit = error[len(prefix):].split(")", 1)[0]
    return 0 if limit == "default" else int(limit) if limit.isdigit() else None


def error_kind(error: str | None) -> ErrorKind | None:
    if error is None:
        return None
    return "transient" if error.startswith(TRANSIENT_REASONS) else "permanent"
