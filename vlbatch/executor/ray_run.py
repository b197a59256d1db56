"""`executor: ray`: the same run as a local one, with rendering and generation on a Ray
cluster through Ray Data.

This process (the driver) does what a local run does before and after: discover, probe,
plan, and write every row (so the output folder, its lock, the manifest and resume work as
they do locally, and no row is written twice). Between them runs one Ray Data pipeline over
the planned pages, in plan order:

    pages --map_batches(RenderPages, CPU actors)--> rendered and hashed pages
          --map_batches(PlanPages, one actor)--> dedupe and result-cache decisions
          --map_batches(GeneratePages, one actor per GPU group)--> answers --> the driver

Order is preserved through the pipeline, so dedupe sees pages in the order a local run
does and makes the same decisions, and a copy's origin always reaches the driver first.
An actor that dies is restarted and its block retried by Ray Data; the driver writes a
block's rows only when the block arrives whole, so nothing is lost or written twice.
"""

from __future__ import annotations

import json
import logging
import math
import re
import socket
import time
from concurrent.futures import Future
from types import SimpleNamespace

from vlbatch.engine.base import Completion
from vlbatch.errors import JobCannotRunError
from vlbatch.executor.ray_stages import GeneratePages, PlanPages, RenderPages, job_to_dict
from vlbatch.pipeline.cache import FeatureCache, ResultCache
from vlbatch.pipeline.plan import PageUnit
from vlbatch.pipeline.workers import WorkerPool
from vlbatch.runner import JobRun, _Pending, cached_completion

log = logging.getLogger("vlbatch")
# every Ray process a run starts: NVLink multicast off (shared/device/README.md)
WORKER_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "NVSHMEM_DISABLE_NVLS": "1", "VLLM_NO_USAGE_STATS": "1"}
CONNECT_TIMEOUT_S = 10  # an explicit address: how long to wait for its port to answer


def connect(address: str | None):
    """Ray, started here (address None: a new local cluster, never one that happens to be
    running, nor RAY_ADDRESS's) or joined; the run's processes get WORKER_ENV."""
    try:
        import ray
    except ImportError:
        raise JobCannotRunError("executor: ray needs Ray: pip install 'vlbatch[ray]'") from None
    if ray.is_initialized():
        return ray, False
    if address:
        check_listening(address, bootstrap_address(address))
    debug = log.isEnabledFor(logging.DEBUG)
    try:
        ray.init(address=address or "local", runtime_env={"env_vars": WORKER_ENV}, log_to_driver=debug,
                 include_dashboard=False, logging_level=logging.DEBUG if debug else logging.WARNING)
    except (Exception, SystemExit) as e:  # Ray exits when it gives up on an address
        raise JobCannotRunError(f"cannot reach the Ray cluster at {address or 'a new local one'}: "
                                f"{root_cause(e)}") from None
    if not debug:  # Ray's console chatter only with --debug: vlbatch reports progress itself
        import ray.data  # noqa: F401 - sets up Ray Data's loggers, whose console we quieten

        logging.getLogger("ray").setLevel(logging.ERROR)
        for handler in logging.getLogger("ray.data").handlers:
            if not isinstance(handler, logging.FileHandler):  # its log file stays complete
                handler.setLevel(logging.ERROR)
    return ray, True


def bootstrap_address(address: str) -> str:
    """Where Ray will connect for `address`: for "auto", the cluster Ray finds itself
    (RAY_ADDRESS, else the last `ray start` on this machine, recorded in Ray's temp folder,
    which outlives a stopped cluster); any other address as given. Where Ray cannot say,
    "auto" stays, and Ray reports the problem itself."""
    if address != "auto":
        return address
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address("auto") or address
    except Exception:  # no cluster found (Ray's own error is clear and quick), or Ray moved it
        return address


def check_listening(address: str, resolved: str | None = None,
                    timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A cluster address (host:port, ray://host:port; `resolved` is where "auto" led) where
    nothing listens fails in seconds, not after Ray's retries (2 to 10 minutes, measured)."""
    target = resolved or address
    found = re.fullmatch(r"(?:ray://)?\[?([^\]\s]+?)\]?:(\d+)", target.strip())
    if found is None:
        return
    host, port = found[1], int(found[2])
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        via = f" (where {address!r} leads)" if target != address else ""
        raise JobCannotRunError(f"cannot reach the Ray cluster at {target}{via}: nothing answers "
                                f"at {host}:{port} within {timeout_s:g} s ({e})") from None


def root_cause(error: BaseException) -> str:
    """The innermost 'SomeError: message' line of a Ray error (which wraps the actor's or
    task's own traceback), else its first line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    causes = re.findall(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$", text, re.M)
    if causes:
        name, message = causes[-1]
        return f"{name}: {message.strip()}"
    lines = text.strip().splitlines()
    return lines[0] if lines else type(error).__name__


class RayJobRun(JobRun):
    def __init__(self, job, *, actor_engine_factory=None, **kwargs):
        super().__init__(job, **kwargs)
        self.actor_engine_factory = actor_engine_factory  # tests: a fake engine in the actors
        self._failed: dict[str, str] = {}  # keys whose generation failed in this run

    def _render_and_generate(self, pool: WorkerPool, units: list[PageUnit], prompts: Future,
                             features: FeatureCache | None, cache: ResultCache | None) -> None:
        units = self._plan(units, prompts)
        ray, connected_here = connect(self.job.ray.address)
        try:
            self._stream(ray, units, cache)
        finally:
            if connected_here:
                ray.shutdown()

    def _stream(self, ray, units: list[PageUnit], cache: ResultCache | None) -> None:
        by_order = {u.order: u for u in units}
        seen: set[int] = set()
        started = time.monotonic()
        try:
            for batch in self._pipeline(ray, units).iter_batches(batch_size=None,
                                                                 batch_format="pyarrow"):
                for row in batch.to_pylist():
                    seen.add(row["order"])
                    self._page_done(by_order[row["order"]], row, cache)
            self.stats.generation_s = round(time.monotonic() - started, 2)
        except Exception as e:
            reason = f"Ray pipeline failed: {root_cause(e)}"
            if not seen:  # nothing came back: an actor could not start (no model, no GPU)
                raise JobCannotRunError(reason) from e
            log.error("%s", reason)  # mid-run: every page not back gets error rows
        else:
            reason = "lost in the Ray pipeline"  # never expected: accounted for all the same
        for unit in units:
            if unit.order not in seen:
                self._page_row(unit, None, reason)
                self._error_rows(unit, reason)
        self._lap()

    def _pipeline(self, ray, units: list[PageUnit]):
        from ray.data import ActorPoolStrategy, DataContext

        job, settings = self.job, self.job.ray
        context = DataContext.get_current()
        context.execution_options.preserve_order = True  # dedupe decides in plan order
        context.enable_progress_bars = False  # vlbatch shows its own progress
        context.print_on_execution_start = log.isEnabledFor(logging.DEBUG)
        items = [{"order": u.order, "source": u.source.path, "page": u.page, "path": u.source.abs_path,
                  "kind": u.kind, "tasks": json.dumps([t.name for t in u.tasks]),
                  "page_key": u.feature_key(job.render)} for u in units]
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
        ds = ds.map_batches(PlanPages, fn_constructor_kwargs={"job": spec}, batch_size=per_batch,
                            batch_format="pyarrow", num_cpus=0, compute=ActorPoolStrategy(size=1))
        return ds.map_batches(
            GeneratePages, fn_constructor_kwargs={"job": spec,
                                                  "engine_factory": self.actor_engine_factory},
            batch_size=per_batch, batch_format="pyarrow", num_gpus=gpus, num_cpus=0 if gpus else 1,
            # several blocks in each actor at once, their calls truly concurrent (Ray Data
            # runs one call at a time by default): the engine is fed the next blocks while
            # the last requests of one finish
            compute=ActorPoolStrategy(size=settings.workers,
                                      max_tasks_in_flight_per_actor=settings.batches_per_worker,
                                      max_concurrent_calls_per_actor=settings.batches_per_worker,
                                      enable_true_multi_threading=True))

    def _page_done(self, unit: PageUnit, row: dict, cache: ResultCache | None) -> None:
        """A page back from the pipeline: its page row and one row per task, with the
        counts a local run keeps."""
        if row["error"] is not None:
            self._page_row(unit, None, row["error"])
            self._error_rows(unit, row["row_error"] or row["error"])
            return
        page = SimpleNamespace(**{k: row[k] for k in ("width", "height", "text_layer",
                                                        "content_hash", "phash")})
        self._page_row(unit, page, None)
        hashes = (row["content_hash"], row["phash"])
        self.stats.feature_cache_hits += bool(row["from_cache"])
        self.stats.cache_corrupt += bool(row.get("healed"))
        self.stats.near_duplicates += bool(row.get("near_merged"))
        if row.get("engine_start_s") is not None:  # the slowest actor's start
            self.engine_version = row.get("engine_version")
            self.stats.engine_start_s = max(self.stats.engine_start_s or 0, row["engine_start_s"])
        tasks = {t.name: t for t in unit.tasks}
        for plan in json.loads(row["tasks"]):
            task, key = tasks[plan["name"]], plan["key"]
            if plan["action"] == "generate":
                request_id = f"{self.stats.run_id}-{self.stats.generated}"
                self._pending[request_id] = self._by_key[key] = _Pending(key, unit, task, hashes)
                self._complete(Completion(request_id, plan.get("output"), plan.get("error"),
                                          plan.get("prompt_tokens"), plan.get("output_tokens")), cache)
                if plan.get("error") is not None:
                    self._failed[key] = plan["error"]
            elif plan["action"] == "cached":
                self.stats.cache_hits += 1
                origin = plan.get("origin")
                self._answer_row(unit, task, hashes, cached_completion(plan),
                                 origin if origin != unit.ref else None)
            else:  # a copy of a request sent earlier in this run: its answer is back already
                self.stats.duplicates_merged += 1
                self._answer_row(unit, task, hashes, self._answer_of(key, cache), plan["origin"])

    def _answer_of(self, key: str, cache: ResultCache | None) -> Completion:
        if key in self._failed:
            return Completion("", None, self._failed[key])
        earlier = self._earlier_answer(key, cache)
        return earlier[1] if earlier else Completion("", None, "the answer of the page this copies was lost")
