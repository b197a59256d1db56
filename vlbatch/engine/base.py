"""The engine interface: requests in (streamed), completions out (as they finish).

The pipeline knows only this; vLLM (GPU or CPU build) sits behind it, and tests of other
stages may put a fake behind it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from PIL import Image

from vlbatch.job import Task


@dataclass
class Request:
    request_id: str
    image: Image.Image  # already at the size the model sees
    text: str  # the task's prompt, placeholders filled
    task: Task
    chat_prompt: str | None = None  # the text in the model's chat template; None: the
    # engine applies it (the local route thread does, so the engine's thread need not)
    retry: bool = False  # generated once more after a failed review: the task's retry settings
    # the page's requests handed over with this one (its tasks to generate, this one included);
    # only where > 1 does the page's first get per-step outputs and hold the rest (prefix_gate.py)
    page_requests: int = 1


@dataclass
class Completion:
    request_id: str
    text: str | None
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    rejected: bool = False  # the engine refused the request (error set): never generated
    finish_reason: str | None = None  # vLLM's: 'stop' (end of answer), 'length' (max_tokens)
    tries: int = 1  # generations it took (2: the first answer failed its review)
    error_output: str | None = None  # the text of an answer kept as an error (schema, loop)
    # prompt tokens vLLM served from its prefix cache (a page's later tasks: its image)
    cached_prompt_tokens: int | None = None


class GenerationEngine(Protocol):
    def generate(self, feed: Iterator[Request | None]) -> Iterator[Completion]:
        """Consume `feed` (None: nothing ready yet, keep the engine stepping) with a bounded
        number of requests in flight; yield each completion as soon as it finishes. A request
        the engine rejects comes back as a completion with `error` and `rejected` set."""
        ...

    def close(self) -> None: ...
