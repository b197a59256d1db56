"""route: a rendered page and its tasks -> what happens to each task.

For each page, in plan order: is it within its file's render time (FileTimeBudget), which
page is it a copy of (dedupe: itself, an exact copy, a confirmed near-copy), and for each
of its tasks one of

    copy      the same request (same canonical page, prompt and settings) was sent earlier
              in this run: its answer (or its error) is this one's too
    cached    the result cache holds the answer (an earlier run's)
    generate  anything else: the prompt to send, under its request key

The Router does no I/O but through the caches it is given, prints nothing and writes no
row: both executors call it, locally on the route thread, on Ray in the one route actor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from vlbatch.engine.base import Completion
from vlbatch.job import Job, Task
from vlbatch.pipeline.dedupe import Deduper, Relation
from vlbatch.pipeline.ingest import RenderedPage
from vlbatch.pipeline.identity import model_identity
from vlbatch.pipeline.render import FileTimeBudget, RenderFailure, cost_of


def request_key(namespace: str, content_hash: str, model: str, prompt: str, task: Task) -> str:
    """What makes two requests the same: pixels, model (`model_identity`: its files and the
    settings that change its numerics), prompt as sent, sampling settings."""
    parts = [namespace, content_hash, model, prompt, task.fingerprint()]
    return "result:" + hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class TaskRoute:
    task: Task
    key: str  # the request key; also the request's id in the engine
    action: Literal["generate", "cached", "copy"]
    prompt: str | None = None  # generate: the prompt as sent
    answer: Completion | None = None  # cached: the answer the cache holds
    origin: str | None = None  # cached, copy: the page ("source#page") that answer came from


@dataclass(frozen=True)
class RoutedPage:
    canonical: str  # content hash of the page whose answers this page shares
    relation: Relation  # "new", or an "exact" / "near" copy of an earlier page
    tasks: tuple[TaskRoute, ...]

    def to_generate(self) -> list[TaskRoute]:
        return [r for r in self.tasks if r.action == "generate"]


def cached_answer(key: str, hit: dict) -> Completion:
    """An answer as the result cache keeps it."""
    return Completion(key, hit["output"], None, hit.get("prompt_tokens"), hit.get("output_tokens"),
                      finish_reason=hit.get("finish_reason"))


class Router:
    def __init__(self, job: Job, deduper: Deduper, results=None):
        self.job, self.deduper, self.results = job, deduper, results  # results: a ResultCache
        self.budget = FileTimeBudget(job.render.file_timeout_s)
        self.sent: dict[str, str] = {}  # request key -> the page it was sent for
        self.model = model_identity(job)

    def route(self, source: str, page: int, tasks: Iterable[Task],
              outcome: RenderedPage | RenderFailure,
              matched: str | None = None) -> RoutedPage | RenderFailure:
        """Called once per page, in plan order. source: the input's absolute path (its
        identity); matched: the path as the job's glob matched it, for {source} in prompts."""
        if not self.budget.admit(source, cost_of(outcome)):
            return RenderFailure(self.budget.reason, self.budget.reason)
        if isinstance(outcome, RenderFailure):
            return outcome
        canonical, relation = self.deduper.match(outcome)
        routes = tuple(self._route_task(task, canonical, outcome.text_layer, source, page,
                                        matched or source) for task in tasks)
        return RoutedPage(canonical, relation, routes)

    def _route_task(self, task: Task, canonical: str, text_layer: str | None, source: str,
                    page: int, matched: str) -> TaskRoute:
        prompt = task.render_prompt(text_layer=text_layer or "", source=matched, page=page)
        key = request_key(self.job.cache_namespace, canonical, self.model, prompt, task)
        if key in self.sent:
            return TaskRoute(task, key, "copy", origin=self.sent[key])
        hit = self.results.get(key) if self.results is not None else None
        if hit is not None:
            return TaskRoute(task, key, "cached", answer=cached_answer(key, hit),
                             origin=hit.get("origin"))
        self.sent[key] = f"{source}#{page}"
        return TaskRoute(task, key, "generate", prompt=prompt)
