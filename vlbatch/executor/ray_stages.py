"""The stages of `executor: ray`, as Ray Data `map_batches` callables, each in an actor of its
own pool: render pages (pipeline.render), route them (pipeline.route: one actor, in plan
order), generate (one long-lived vLLM actor per GPU or tensor-parallel group, fed through
engine.loop.EngineLoop). They call the same stage code a local run does; what is here is
only the transport: pages and decisions as pyarrow rows.

Blocks are pyarrow tables, one row per page; a page's tasks travel together in its row (as
JSON) so its image crosses the cluster once and its requests reach vLLM together. Nothing
here imports Ray: the classes are plain Python, so they are tested and reused without it.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

import pyarrow as pa

from vlbatch.engine.base import Completion, Request
from vlbatch.engine.loop import EngineLoop
from vlbatch.job import Job
from vlbatch.pipeline.ingest import CompareSource, RenderedPage
from vlbatch.pipeline.render import FileTimeBudget, PageSpec, RenderFailure, render_in_order, render_pool
from vlbatch.pipeline.route import RoutedPage, TaskRoute

log = logging.getLogger("vlbatch")

PAGE_COLUMNS = {  # what every stage passes on (stages add their own columns)
    "order": pa.int64(), "rank": pa.int64(), "source": pa.string(), "matched": pa.string(),
    "page": pa.int32(), "error": pa.string(),
    "row_error": pa.string(), "cost_s": pa.float64(), "width": pa.int32(),
    "height": pa.int32(), "rgb": pa.binary(), "text_layer": pa.string(),
    "drawings": pa.string(), "content_hash": pa.string(), "phash": pa.string(), "from_cache": pa.bool_(),
    "thumb": pa.binary(), "compare_png": pa.binary(), "compare_source": pa.string(), "healed": pa.bool_(), "render_s": pa.float64(), "tasks": pa.string(),
}
ROUTED_COLUMNS = {"routes": pa.string()}
ENGINE_COLUMNS = {"engine_version": pa.string(), "engine_start_s": pa.float64(),
                  "engine_device": pa.string(), "engine_restarts": pa.int32(),
                  "engine_down": pa.string()}


def job_to_dict(job: Job) -> dict:
    """The job as plain data for the actors (its paths are absolute once loaded)."""
    return {**job.model_dump(mode="json", by_alias=True), "base_dir": str(job.base_dir)}


def _table(rows: list[dict], *extra: dict) -> pa.Table:
    columns = {**PAGE_COLUMNS}
    for more in extra:
        columns.update(more)
    schema = pa.schema(list(columns.items()))
    return pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows], schema=schema)


# ----- a page's render outcome as row columns, and back -----
def outcome_columns(outcome: RenderedPage | RenderFailure) -> dict:
    if isinstance(outcome, RenderFailure):
        return {"error": outcome.page_error, "row_error": outcome.row_error,
                "cost_s": outcome.cost_s}
    return {"error": None, "row_error": None, "width": outcome.width, "height": outcome.height,
            "rgb": outcome.rgb, "text_layer": outcome.text_layer, "drawings": outcome.drawings,
            "content_hash": outcome.content_hash, "phash": outcome.phash,
            "from_cache": outcome.from_cache, "healed": outcome.healed,
            "render_s": outcome.render_s, "thumb": outcome.thumb,
            "compare_png": outcome.compare_png,
            "compare_source": json.dumps(outcome.compare_source.to_json())
            if outcome.compare_source is not None else None}


def outcome_of(row: dict) -> RenderedPage | RenderFailure:
    if row["error"] is not None:
        return RenderFailure(row["error"], row["row_error"] or row["error"], row["cost_s"] or 0.0)
    return RenderedPage(row["width"], row["height"], row["rgb"] or b"", row["text_layer"],
                        row["content_hash"], row["phash"], bool(row["from_cache"]),
                        row["render_s"] or 0.0, bool(row["healed"]), row.get("drawings"),
                        compare_png=row.get("compare_png"), thumb=row.get("thumb") or b"",
                        compare_source=CompareSource.from_json(json.loads(row["compare_source"]))
                        if row.get("compare_source") else None)


# ----- a routed page (with the answers generated for it) as JSON, and back -----
def routes_json(routed: RoutedPage) -> str:
    tasks = []
    for r in routed.tasks:
        entry = {"task": r.task.name, "key": r.key, "action": r.action, "prompt": r.prompt,
                 "origin": r.origin}
        if r.answer is not None:
            entry["answer"] = answer_json(r.answer)
        tasks.append(entry)
    return json.dumps({"canonical": routed.canonical, "relation": routed.relation,
                       "tasks": tasks})


def answer_json(done: Completion) -> dict:
    return {"text": done.text, "error": done.error, "rejected": done.rejected,
            "prompt_tokens": done.prompt_tokens, "output_tokens": done.output_tokens,
            "finish_reason": done.finish_reason, "tries": done.tries,
            "error_output": done.error_output, "cached_prompt_tokens": done.cached_prompt_tokens}


def answer_of(key: str, entry: dict) -> Completion:
    return Completion(key, entry["text"], entry["error"], entry["prompt_tokens"],
                      entry["output_tokens"], entry["rejected"], entry.get("finish_reason"),
                      entry.get("tries", 1), entry.get("error_output"),
                      entry.get("cached_prompt_tokens"))


def routed_of(text: str, job: Job) -> RoutedPage:
    data, tasks = json.loads(text), {t.name: t for t in job.tasks}
    routes = tuple(TaskRoute(tasks[t["task"]], t["key"], t["action"], t.get("prompt"),
                             answer_of(t["key"], t["answer"]) if "answer" in t else None,
                             t.get("origin")) for t in data["tasks"])
    return RoutedPage(data["canonical"], data["relation"], routes)


class RenderPages:
    """Renders and hashes pages (through the feature cache, as a local run does) in one
    worker process of its own, so a page that hangs or crashes a native library becomes
    an error row, never a lost block. Pages of a file that this actor has seen use up its
    time budget are not rendered (the route actor decides their rows, in plan order)."""

    def __init__(self, job: dict):
        self.job = Job.model_validate(job)
        self.pool = render_pool(self.job, 1, lookahead=2)
        self.skip = FileTimeBudget(self.job.render.file_timeout_s)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        spec = lambda row: PageSpec(row["path"], row["kind"], row["page"], row["page_key"])  # noqa: E731
        for row, outcome in render_in_order(self.pool, rows, spec, self.job.render, self.skip,
                                            lambda row: row["source"], lambda row: row["rank"]):
            row.update(outcome_columns(outcome))
        return _table(rows)


class RoutePages:
    """One actor, pages in plan order: the Router's decisions (file time budget, dedupe
    with the feature cache's index, copies, result-cache answers, requests to generate)."""

    def __init__(self, job: dict):
        from vlbatch.pipeline.cache import FeatureCache, ResultCache
        from vlbatch.pipeline.comparison import Comparisons
        from vlbatch.pipeline.dedupe import Deduper
        from vlbatch.pipeline.route import Router

        self.job = job = Job.model_validate(job)
        self.tasks = {t.name: t for t in job.tasks}
        # indexed at once: this actor may be stopped as soon as the last block has passed
        features = (FeatureCache(job.tenant_cache, job.cache_size_gib, index_in_background=False)
                    if job.feature_cache else None)
        results = ResultCache(job.tenant_cache, job.cache_size_gib) if job.result_cache else None
        # comparison images the dedupe needs are made on demand, by a render worker of its own
        comparisons = Comparisons(job.render, make_pool=lambda: render_pool(job, 1, lookahead=2))
        self.router = Router(job, Deduper(job.dedupe, index=features, comparisons=comparisons),
                             results)
        self.last_rank = -1

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        for row in rows:
            if row["rank"] < self.last_rank:  # never expected (see ray_run): said, not hidden
                log.warning("page %s#%s reached routing after a later page of the plan: its "
                            "dedupe decision may differ from a local run's", row["source"], row["page"])
            self.last_rank = max(self.last_rank, row["rank"])
            tasks = [self.tasks[name] for name in json.loads(row["tasks"])]
            routed = self.router.route(row["source"], row["page"], tasks, outcome_of(row),
                                       row["matched"])
            if isinstance(routed, RenderFailure):
                row.update(outcome_columns(routed), rgb=None)
                continue
            row["routes"] = routes_json(routed)
            if not routed.to_generate():
                row["rgb"] = None  # no need to ship the image on
        return _table(rows, ROUTED_COLUMNS)


class GeneratePages:
    """A long-lived vLLM actor: loads the model once and answers the `generate` routes of
    every page block it is given, several blocks at once (a threaded actor). An engine that
    dies is started again once, as locally (engine/loop.py); if the new one dies too, every
    row after says so (`engine_down`) and the driver stops the run (exit 5)."""

    def __init__(self, job: dict, engine_factory=None):
        self.job = Job.model_validate(job)
        self.tasks = {t.name: t for t in self.job.tasks}
        if engine_factory is None:
            from vlbatch.engine.vllm_engine import start_vllm_engine as engine_factory
        started = time.monotonic()
        self.engine = engine_factory(self.job, None)
        self.start_s = round(time.monotonic() - started, 1)
        self.version = getattr(self.engine, "version", None)
        self.device = getattr(self.engine, "device", None)
        from vlbatch.pipeline.answers import review

        self.down: str | None = None  # why the engine stayed down, once it has
        factory = engine_factory
        self.loop = EngineLoop(self.engine, review=review,
                               restart=lambda: factory(self.job, None), on_down=self._down)

    def _down(self, reason: str) -> None:
        self.down = reason

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        waiting = []
        for row in rows:
            if row["routes"] is None:
                continue
            routes = json.loads(row["routes"])
            row["routes"] = routes
            if row["rgb"] is None:
                continue
            image = outcome_of(row).image()
            generating = sum(route["action"] == "generate" for route in routes["tasks"])
            for route in routes["tasks"]:
                if route["action"] == "generate":
                    # the page in the id (a fresh one each time: a retried block never
                    # meets its first attempt's ids); answers go back by route, not by id
                    request = Request(f"{row['order']}-{route['task']}-{uuid.uuid4().hex[:8]}", image,
                                      route.pop("prompt"), self.tasks[route["task"]],
                                      page_requests=generating)
                    waiting.append((route, self.loop.submit(request)))
        for route, future in waiting:
            route["answer"] = answer_json(future.result())
        for row in rows:
            if isinstance(row["routes"], dict):
                row["routes"] = json.dumps(row["routes"])
            row.update(rgb=None, engine_version=self.version, engine_start_s=self.start_s,
                       engine_device=self.device, engine_restarts=self.loop.restarts,
                       engine_down=self.down)
        return _table(rows, ROUTED_COLUMNS, ENGINE_COLUMNS)
