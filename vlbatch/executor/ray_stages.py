"""The stages of `executor: ray`, as Ray Data `map_batches` callables (each runs in an actor
of its own pool): render pages, plan them (dedupe and result cache, one actor, in plan
order), generate with vLLM (one long-lived actor per GPU or tensor-parallel group).

Blocks are pyarrow tables, one row per page; a page's tasks travel together in its row (as
JSON) so its image crosses the cluster once and its requests reach vLLM together. Nothing
here imports Ray: the classes are plain Python, so they are tested and reused without it.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from concurrent.futures import Future

import pyarrow as pa
from PIL import Image

from vlbatch.engine.base import Completion, Request
from vlbatch.job import Job
from vlbatch.pipeline import ingest
from vlbatch.pipeline.cache import prompt_and_key

PAGE_COLUMNS = {  # what every stage passes on (stages add their own columns)
    "order": pa.int64(), "source": pa.string(), "page": pa.int32(), "error": pa.string(),
    "row_error": pa.string(), "width": pa.int32(), "height": pa.int32(), "rgb": pa.binary(),
    "text_layer": pa.string(), "content_hash": pa.string(), "phash": pa.string(),
    "from_cache": pa.bool_(), "healed": pa.bool_(), "tasks": pa.string(),
}


def job_to_dict(job: Job) -> dict:
    """The job as plain data for the actors (its paths are absolute once loaded)."""
    return {**job.model_dump(mode="json"), "base_dir": str(job.base_dir)}


def _table(rows: list[dict], extra: dict | None = None) -> pa.Table:
    columns = {**PAGE_COLUMNS, **(extra or {})}
    schema = pa.schema(list(columns.items()))
    return pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows], schema=schema)


class RenderPages:
    """Renders and hashes pages (through the feature cache, as a local run does) in one
    worker process of its own, so a page that hangs or crashes a native library becomes
    an error row, never a lost block. A file's render time limit (render.file_timeout_s)
    counts the time this actor spent on the file."""

    def __init__(self, job: dict):
        from vlbatch.pipeline.workers import WorkerPool

        self.job = Job.model_validate(job)
        self.pool = WorkerPool(1, self.job.render.page_timeout_s, lookahead=2)
        self.budget = ingest.FileTimeBudget(self.job.render.file_timeout_s,
                                            self.job.render.page_timeout_s)

    def __call__(self, batch: pa.Table) -> pa.Table:
        r, job = self.job.render, self.job
        cache_dir = str(job.cache) if job.feature_cache else None
        rows = batch.to_pylist()
        args = lambda row: (row["path"], row["kind"], row["page"], r.dpi, r.min_pixels,  # noqa: E731
                            r.max_pixels, r.pdf_password, cache_dir, row["page_key"])

        def within_time_limit():
            for row in rows:
                if self.budget.used_up(row["path"]):
                    row.update(error=self.budget.reason, row_error=self.budget.reason)
                else:
                    yield row

        for row, page in self.pool.imap(ingest.render_page, within_time_limit(), args):
            self.budget.charge(row["path"], page)
            if isinstance(page, Exception):
                page_error, row_error = ingest.failure_reasons(page)
                row.update(error=page_error, row_error=row_error)
                continue
            row.update(width=page.width, height=page.height, rgb=page.rgb,
                       text_layer=page.text_layer, content_hash=page.content_hash,
                       phash=page.phash, from_cache=page.from_cache, healed=page.healed)
        return _table(rows)


class PlanPages:
    """Decides, page by page in plan order (one actor), what each task needs: the same
    decisions a local run makes. A page is mapped to its canonical page (dedupe, with the
    feature cache's index of earlier runs); a request already sent in this run is a copy of
    it, one in the result cache is answered from there, anything else is generated."""

    def __init__(self, job: dict):
        from vlbatch.pipeline.cache import FeatureCache, ResultCache
        from vlbatch.pipeline.dedupe import Deduper

        self.job = job = Job.model_validate(job)
        self.tasks = {t.name: t for t in job.tasks}
        # indexed at once: this actor is not the one feeding an engine, and may be stopped
        # as soon as the last block has passed
        self.features = (FeatureCache(job.cache, job.cache_size_gib, index_in_background=False)
                         if job.feature_cache else None)
        self.deduper = Deduper(job.dedupe, index=self.features)
        self.results = ResultCache(job.cache, job.cache_size_gib) if job.result_cache else None
        self.sent: dict[str, str] = {}  # request key -> the page ("source#page") it came from

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        for row in rows:
            if row["error"] is not None:
                continue
            image = Image.frombytes("RGB", (row["width"], row["height"]), row["rgb"])
            merged = self.deduper.near_merged
            canonical = self.deduper.canonical(row["content_hash"], row["phash"], image,
                                               row["text_layer"])
            row["near_merged"] = self.deduper.near_merged > merged
            plans = [self._plan(row, canonical, name) for name in json.loads(row["tasks"])]
            row["tasks"] = json.dumps(plans)
            if not any(p["action"] == "generate" for p in plans):
                row["rgb"] = None  # no need to ship the image on
        return _table(rows, {"near_merged": pa.bool_()})

    def _plan(self, row: dict, canonical: str, name: str) -> dict:
        text, key = prompt_and_key(self.job, self.tasks[name], canonical, row["text_layer"],
                                   row["source"], row["page"])
        if key in self.sent:
            return {"name": name, "key": key, "action": "copy", "origin": self.sent[key]}
        hit = self.results.get(key) if self.results is not None else None
        if hit is not None:
            return {"name": name, "key": key, "action": "cached", "origin": hit.get("origin"),
                    "output": hit["output"], "prompt_tokens": hit.get("prompt_tokens"),
                    "output_tokens": hit.get("output_tokens")}
        self.sent[key] = f"{row['source']}#{row['page']}"
        return {"name": name, "key": key, "action": "generate", "prompt": text}


class EngineLoop:
    """One engine fed from several threads: a thread runs `engine.generate` over a queue
    that never ends, so requests of the next block join the running batch while the last
    ones finish (the engine is never drained between blocks)."""

    IDLE_WAIT_S = 0.005

    def __init__(self, engine):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: dict[str, Future] = {}
        self.lock = threading.Lock()
        self.failed: str | None = None
        threading.Thread(target=self._run, name="vlbatch-engine", daemon=True).start()

    def submit(self, request: Request) -> Future:
        future: Future = Future()
        with self.lock:
            if self.failed is not None:
                future.set_result(Completion(request.request_id, None, self.failed))
                return future
            self.waiting[request.request_id] = future
        self.inbox.put(request)
        return future

    def _feed(self):
        while True:
            try:
                yield self.inbox.get(timeout=self.IDLE_WAIT_S)
            except queue.Empty:
                yield None

    def _run(self) -> None:
        try:
            for done in self.engine.generate(self._feed()):
                with self.lock:
                    future = self.waiting.pop(done.request_id, None)
                if future is not None:
                    future.set_result(done)
        except Exception as e:  # the engine died: every request in it and after it fails
            with self.lock:
                self.failed = f"engine failed: {e}"
                left, self.waiting = self.waiting, {}
            for request_id, future in left.items():
                future.set_result(Completion(request_id, None, self.failed))


def default_engine(job: Job):
    from vlbatch.engine.vllm_engine import VllmEngine

    return VllmEngine(job)


class GeneratePages:
    """A long-lived vLLM actor: loads the model once and answers the `generate` tasks of
    every page block it is given, several blocks at once (a threaded actor)."""

    def __init__(self, job: dict, engine_factory=None):
        self.job = Job.model_validate(job)
        self.tasks = {t.name: t for t in self.job.tasks}
        started = time.monotonic()
        self.engine = (engine_factory or default_engine)(self.job)
        self.start_s = round(time.monotonic() - started, 1)
        self.version = getattr(self.engine, "version", None)
        self.loop = EngineLoop(self.engine)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        waiting = []
        for row in rows:
            plans = json.loads(row["tasks"] or "[]")
            row["tasks"] = plans
            if row["rgb"] is None:
                continue
            image = Image.frombytes("RGB", (row["width"], row["height"]), row["rgb"])
            for plan in plans:
                if plan["action"] == "generate":
                    request = Request(f"{row['order']}-{plan['name']}-{uuid.uuid4().hex[:8]}",
                                      image, plan.pop("prompt"), self.tasks[plan["name"]])
                    waiting.append((plan, self.loop.submit(request)))
        for plan, future in waiting:
            done: Completion = future.result()
            plan.update(output=done.text, error=done.error, prompt_tokens=done.prompt_tokens,
                        output_tokens=done.output_tokens)
        for row in rows:
            row.update(tasks=json.dumps(row["tasks"]), rgb=None, engine_version=self.version,
                       engine_start_s=self.start_s)
        return _table(rows, {"near_merged": pa.bool_(), "engine_version": pa.string(),
                             "engine_start_s": pa.float64()})
