"""The benchmarks' stand-ins for the engine and the prompt builder: an engine that answers
at once and a token count by words, so a benchmark measures the pipeline, not a model.
Kept apart from the scripts that make test data, so a measured process imports only what
`vlbatch run` imports."""

from __future__ import annotations

from collections.abc import Iterator

from vlbatch.engine.base import Completion, Request


class InstantEngine:
    """Answers every request at once with 200 characters (the engine is not measured)."""

    def generate(self, feed: Iterator[Request | None]) -> Iterator[Completion]:
        for request in feed:
            if request is not None:
                yield Completion(request.request_id, "x" * 200, None, 100, 50)

    def close(self) -> None:
        pass


class WordCount:
    @staticmethod
    def text_tokens(text: str) -> int:
        return len(text.split())
