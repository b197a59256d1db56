"""`executor: ray`: the same stages as a local run, with rendering, routing and generation
on a Ray cluster through Ray Data.

This process (the driver) does what a local run does before and after: scope the plan and
run the sink (so the output folder, its lock, the manifest and resume work as they do
locally, and no row is written twice). Between them runs one Ray Data pipeline over the
planned pages, in plan order:

    pages --map_batches(RenderPages, CPU actors)--> rendered and hashed pages
          --map_batches(RoutePages, one actor)--> the Router's decisions, in plan order
          --map_batches(GeneratePages, one actor per GPU group)--> answers --> the sink

Order is preserved through the pipeline (Ray Data hands each stage's blocks on in plan
order, though render actors may render them in any order), so routing sees pages in the
order a local run does and makes the same decisions, and a copy's original always reaches
the sink first.
An actor that dies is restarted and its block retried by Ray Data; the driver hands a
block's pages to the sink only when the block arrives whole, so nothing is lost or written
twice.
"""

from __future__ import annotations

import json
import logging
import math
import time

from vlbatch.errors import EngineStayedDown, JobCannotRunError
from vlbatch.executor.context import RunContext
from vlbatch.executor.ray_cluster import connect, root_cause
from vlbatch.executor.ray_stages import (GeneratePages, RenderPages, RoutePages, job_to_dict,
                                         outcome_of, routed_of)
from vlbatch.pipeline import scope
from vlbatch.pipeline.plan import PageUnit
from vlbatch.pipeline.render import RenderFailure
from vlbatch.pipeline.sink import RunSink

log = logging.getLogger("vlbatch")


class RayExecutor:
    def __init__(self, engine_factory=None):
        self.engine_factory = engine_factory  # runs in the vLLM actors (cloudpickled)

    def run(self, ctx: RunContext, units: tuple[PageUnit, ...], sink: RunSink) -> None:
        ordered = scope.order(ctx.job, units, ctx.prompts.result())
        ctx.lap("plan_s")
        ray, connected_here = connect(ctx.job.ray.address)
        try:
            self._stream(ray, ctx, ordered, sink)
        finally:
            if connected_here:
                ray.shutdown()

    def _stream(self, ray, ctx: RunContext, units: list[PageUnit], sink: RunSink) -> None:
        by_order = {u.order: u for u in units}
        seen = False
        down: str | None = None  # an actor's engine died, and the one started for it too
        started = time.monotonic()
        try:
            for batch in self._pipeline(ray, ctx.job, units).iter_batches(
                    batch_size=None, batch_format="pyarrow"):
                for row in batch.to_pylist():
                    seen = True
                    self._page_back(ctx, by_order[row["order"]], row, sink)
                    down = down or row.get("engine_down")
                if down is not None:  # as locally: stop, the pages left get transient rows
                    break
            sink.stats.generation_s = round(time.monotonic() - started, 2)
        except Exception as e:
            reason = f"Ray pipeline failed: {root_cause(e)}"
            if not seen:  # nothing came back: an actor could not start (no model, no GPU)
                raise JobCannotRunError(reason) from e
            log.error("%s", reason)  # mid-run: every page not back gets error rows
        else:
            # never expected but for an engine that stayed down: accounted for all the same
            reason = down or "lost in the Ray pipeline"
        sink.fail_unseen(reason)
        sink.fail_pending(reason)
        ctx.lap("generate_s")
        if down is not None:
            raise EngineStayedDown(f"{down} (after one restart); the pages left have transient "
                                   f"error rows that the next run retries")

    @staticmethod
    def _page_back(ctx: RunContext, unit: PageUnit, row: dict, sink: RunSink) -> None:
        """A page back from the pipeline: to the sink, as a local run hands it over."""
        if row["routes"] is None:
            failure = outcome_of(row)
            sink.page_failed(unit, failure if isinstance(failure, RenderFailure)
                             else RenderFailure("not routed", "not routed"))
            return
        if row.get("engine_start_s") is not None:  # the slowest actor's start
            sink.engine_version = row.get("engine_version")
            sink.stats.engine_device = row.get("engine_device")
            sink.stats.engine_restarts = max(sink.stats.engine_restarts, row.get("engine_restarts") or 0)
            sink.stats.engine_start_s = max(sink.stats.engine_start_s or 0, row["engine_start_s"])
        routed = routed_of(row["routes"], ctx.job)
        sink.page_routed(unit, outcome_of({**row, "rgb": None}), routed)
        for route in routed.to_generate():
            sink.completed(route.answer)

    def _pipeline(self, ray, job, units: list[PageUnit]):
        from ray.data import ActorPoolStrategy, DataContext

        settings = job.ray
        context = DataContext.get_current()
        context.execution_options.preserve_order = True  # routing decides in plan order
        context.enable_progress_bars = False  # vlbatch shows its own progress
        context.print_on_execution_start = log.isEnabledFor(logging.DEBUG)
        items = [{"order": u.order, "rank": rank, "source": u.source.abs_path,
                  "matched": u.source.path, "page": u.page, "path": u.source.abs_path,
                  "kind": u.kind,
                  "tasks": json.dumps([t.name for t in u.tasks]),
                  "page_key": u.feature_key(job.render) if job.feature_cache else None}
                 for rank, u in enumerate(units)]
        per_batch = settings.pages_per_batch
        cluster = ray.cluster_resources()
        cpus = int(cluster.get("CPU", 1))
        gpus = settings.gpus_per_worker
        if gpus is None:
            gpus = job.engine.tensor_parallel_size if cluster.get("GPU") else 0
        spec = job_to_dict(job)
        ds = ray.data.from_items(items, override_num_blocks=max(1, math.ceil(len(items) / per_batch)))
        ds = ds.map_batches(RenderPages, fn_constructor_kwargs={"job": spec}, batch_size=per_batch,
                            batch_format="pyarrow", num_cpus=1, compute=ActorPoolStrategy(
                                min_size=1, max_size=settings.render_workers or max(1, cpus - 1)))
        # Ray Data lets an actor run its blocks out of order (allow_out_of_order_execution:
        # a block whose input is fetched later waits) and reorders only their outputs; the
        # dedupe must see pages in plan order, or which of two copies is the original would
        # depend on timing
        ds = ds.map_batches(RoutePages, fn_constructor_kwargs={"job": spec}, batch_size=per_batch,
                            batch_format="pyarrow", num_cpus=0, compute=ActorPoolStrategy(size=1),
                            allow_out_of_order_execution=False)
        return ds.map_batches(
            GeneratePages, fn_constructor_kwargs={"job": spec,
                                                  "engine_factory": self.engine_factory},
            batch_size=per_batch, batch_format="pyarrow", num_gpus=gpus, num_cpus=0 if gpus else 1,
            # several blocks in each actor at once, their calls truly concurrent (Ray Data
            # runs one call at a time by default): the engine is fed the next blocks while
            # the last requests of one finish
            compute=ActorPoolStrategy(size=settings.workers,
                                      max_tasks_in_flight_per_actor=settings.batches_per_worker,
                                      max_concurrent_calls_per_actor=settings.batches_per_worker,
                                      enable_true_multi_threading=True))
