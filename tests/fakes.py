"""A fake engine for tests whose subject is not the engine (caching, dedupe, failures).
It answers deterministically from the request's text and image bytes, and counts calls."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from vlbatch.engine.base import Completion, Request


class FakeEngine:
    def __init__(self, fail_after: int | None = None, reject: str | None = None):
        self.requests: list[Request] = []
        self.fail_after = fail_after  # raise (engine died) after this many completions
        self.reject = reject  # requests whose text contains this are rejected
        self.closed = False

    def generate(self, feed: Iterator[Request | None]) -> Iterator[Completion]:
        for request in feed:
            if request is None:
                continue
            if self.fail_after is not None and len(self.requests) >= self.fail_after:
                raise RuntimeError("engine core died")
            self.requests.append(request)
            if self.reject and self.reject in request.text:
                yield Completion(request.request_id, None, "request rejected: too long")
                continue
            digest = hashlib.sha256(request.image.tobytes() + request.text.encode()).hexdigest()
            yield Completion(request.request_id, f"{request.task.name}:{digest[:12]}", None, 10, 3)

    def close(self) -> None:
        self.closed = True


class DiesOnce(FakeEngine):
    """Kills its whole actor process at its third request, the first time only."""

    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def generate(self, feed):
        import os

        for done in super().generate(feed):
            if len(self.requests) == 3 and not self.marker.exists():
                self.marker.write_text("died")
                os._exit(1)
            yield done


class AnswersPagesTogether(FakeEngine):
    """Holds its requests until those of two pages are in it at once (or 10 s pass), then
    answers them all with how many pages were in it together."""

    def generate(self, feed):
        import time

        held, since = [], None
        for request in feed:
            if request is not None:
                self.requests.append(request)
                held.append(request)
                since = since or time.monotonic()
            pages = {r.request_id.split("-")[0] for r in held}
            if held and (len(pages) >= 2 or time.monotonic() - since > 10):
                for r in held:
                    yield Completion(r.request_id, f"pages together: {len(pages)}", None, 10, 3)
                held, since = [], None


class FakePrompts:
    @staticmethod
    def text_tokens(text: str) -> int:
        return len(text.split())


def fake_prompts(job):
    return FakePrompts()


def engine_that_cannot_start(job, prompts=None):
    raise RuntimeError("CUDA out of memory while loading the model")


class ScriptedEngine(FakeEngine):
    """Answers each request with `answer(request) -> (text, finish_reason)`."""

    def __init__(self, answer):
        super().__init__()
        self.answer = answer

    def generate(self, feed):
        for request in feed:
            if request is None:
                continue
            self.requests.append(request)
            text, finish_reason = self.answer(request)
            yield Completion(request.request_id, text, None, 10, 5, finish_reason=finish_reason)
