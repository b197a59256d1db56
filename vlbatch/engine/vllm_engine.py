"""vLLM behind the engine interface: the same code on the GPU build and the CPU build.

Requests are fed to vLLM's LLMEngine with add_request/step, a bounded number in flight, so
the engine is never handed one giant list and never drained between chunks. vLLM is
imported here only, when an engine is started.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, wait

from vlbatch.engine.base import Completion, Request
from vlbatch.engine.prefix_gate import PrefixGate
from vlbatch.engine.prompts import PromptBuilder
from vlbatch.engine.vllm_frontend import InputFront, PixelsOnce, detach_processor_cache
from vlbatch import library_chatter
from vlbatch.errors import JobCannotRunError
from vlbatch.pipeline.failures import rejection_prefix
from vlbatch.job import Job, Task

log = logging.getLogger("vlbatch")
GPU_WARMUP_PAGES = 16  # engine.warmup_pages' default on a GPU (as raw's 16-page warm-up)
WARMUP_TOKENS = 8  # generated for each warm-up page: prefill and a few decode steps
THREAD_WARMUP_TIMEOUT_S = 60.0  # the input threads' warm-up at engine start, at most
IDLE_WAIT_S = 0.005  # nothing in flight and nothing ready: how long to wait before asking again


def engine_kwargs(job: Job) -> dict:
    """vLLM LLM(...) arguments from the job (None settings left to vLLM's defaults)."""
    e = job.engine
    kwargs = dict(
        model=job.model_path(), seed=e.seed, dtype=e.dtype,
        tensor_parallel_size=e.tensor_parallel_size,
        load_format=e.load_format,
        enforce_eager=e.enforce_eager, trust_remote_code=e.trust_remote_code,
        limit_mm_per_prompt={"image": 1, "video": 0},
        use_tqdm_on_load=library_chatter(),  # progress bars with carriage returns in cron logs
        # pages arrive already fitted to this budget, so the processor resizes nothing
        mm_processor_kwargs={"size": {"shortest_edge": job.render.min_pixels,
                                      "longest_edge": job.render.max_pixels}},
    )
    optional = dict(max_model_len=e.max_model_len, max_num_seqs=e.max_num_seqs,
                    gpu_memory_utilization=e.gpu_memory_utilization,
                    max_num_batched_tokens=e.max_num_batched_tokens,
                    enable_prefix_caching=e.enable_prefix_caching, quantization=e.quantization,
                    kv_cache_dtype=e.kv_cache_dtype)
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if e.mm_tensor_ipc is not None:
        kwargs["mm_tensor_ipc"] = e.mm_tensor_ipc
    if any(t.answer_schema is not None for t in job.tasks):
        # JSON without free whitespace: a weak or random model given a grammar that allows
        # it writes '{' and then whitespace to max_tokens. Engine-wide in vLLM (a request's
        # own setting is ignored); it needs a backend named, xgrammar here.
        kwargs["structured_outputs_config"] = {"backend": "xgrammar",
                                               "disable_any_whitespace": True}
    compilation = {name: True for name, on in (("compile_mm_encoder", e.compile_mm_encoder),
                                               ("cudagraph_mm_encoder", e.cudagraph_mm_encoder)) if on}
    if compilation:
        kwargs["compilation_config"] = compilation
    return kwargs


def is_bad_request(error: Exception) -> bool:
    """vLLM's word for a request it refuses as such (an over-long prompt, a bad image):
    ValueError in 0.26, VLLMClientError in 0.32."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return isinstance(error, ValueError)
    return isinstance(error, (ValueError, VLLMClientError))


class VllmEngine:
    def __init__(self, job: Job, prompts: PromptBuilder | None = None):
        self.job = job
        self.max_in_flight = job.engine.max_in_flight
        # the processor may still be loading (a Future) while the engine starts
        self._prompts = prompts
        self._params: dict[tuple[str, bool, bool], object] = {}
        self._thread_failures: dict[str, int] = {}  # exception name: count
        started = time.monotonic()
        try:
            if job.engine.compile_cache_dir is not None:  # read when vLLM is imported
                os.environ["VLLM_CACHE_ROOT"] = str(job.engine.compile_cache_dir)
            from vllm import LLM
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                # the CPU build needs a KV cache size; in-process starts in seconds, not 30
                os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{job.engine.cpu_kv_cache_gib:g}")
                os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            if job.engine.mm_tensor_ipc == "torch_shm":  # vLLM refuses it with fork
                os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
            self.llm = LLM(**engine_kwargs(job))
        except Exception as e:  # model not found, out of memory, bad setting, ...
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise JobCannotRunError(f"engine failed to start ({type(e).__name__}): {reason}") from e
        self.version = __import__("vllm").__version__
        self.warm_up_seconds = self.warm_up_input_processing()
        gpu = not current_platform.is_cpu()
        self.device = "gpu" if gpu else "cpu"  # what the run held (cost.py)
        pages = job.engine.warmup_pages
        self.warm_up_seconds += self.warm_up_generation(
            (GPU_WARMUP_PAGES if gpu else 0) if pages is None else pages)
        # with input threads, vLLM's front-end processor cache comes off (not for concurrent
        # use); the engine core's twin still spares a page's later tasks its pixels
        self._pixels = PixelsOnce(detach_processor_cache(self.llm.llm_engine)) \
            if job.engine.frontend_threads else None
        self._front: InputFront | None = None
        if job.engine.frontend_threads:
            self._front = self._new_input_front()
            self.warm_up_seconds += self._front.warm_up(
                [self.vllm_prompt(self._random_page_request(f"vlbatch-thread-warm-up-{i}"))
                 for i in range(job.engine.frontend_threads)],
                self.sampling_params(job.tasks[0]), THREAD_WARMUP_TIMEOUT_S)
        self.start_seconds = time.monotonic() - started
        log.debug("vLLM %s started in %.1f s (torch threads %d, OMP_NUM_THREADS %s)", self.version,
                  self.start_seconds, __import__("torch").get_num_threads(),
                  os.environ.get("OMP_NUM_THREADS"))

    def _random_page_request(self, request_id: str) -> Request:
        """A page-sized request of random pixels: no real page can share its hash, so no
        cache of vLLM's (processor, encoder, prefix) ever stands in for a real page."""
        from PIL import Image

        from vlbatch.pipeline.imaging import fit_to_budget

        r, task = self.job.render, self.job.tasks[0]
        w, h = 1240, 1754  # an A4 page at 150 dpi
        image = fit_to_budget(Image.frombytes("RGB", (w, h), os.urandom(w * h * 3)),
                              r.min_pixels, r.max_pixels)
        return Request(request_id, image, task.render_prompt(text_layer=""), task)

    def warm_up_generation(self, pages: int) -> float:
        """Generate `pages` random-pixel requests, WARMUP_TOKENS each, and drop them; the
        seconds it took. On a GPU the first steps of an engine JIT-compile Triton kernels
        (the fused MoE, the vision encoder's position embedding: about 6 s on the H200, GPU
        idle) that a user's own warm-up absorbs; here they happen in engine start, not in
        the run's first pages. A failure only costs the warm-up."""
        if pages <= 0:
            return 0.0
        from vllm import SamplingParams

        started = time.monotonic()
        params = SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, temperature=0.0)
        prompts = [self.vllm_prompt(self._random_page_request(f"vlbatch-warm-up-{i}"))
                   for i in range(pages)]
        try:
            self.llm.generate(prompts, params, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - e.g. a prompt over max_model_len
            log.debug("generation warm-up: %s", e)
        seconds = time.monotonic() - started
        log.debug("generation warm-up of %d pages took %.1f s", pages, seconds)
        return seconds

    def warm_up_input_processing(self) -> float:
        """Process one page-sized request (not added to the engine), on this thread.

        vLLM 0.26's offline LLM builds its multi-modal processor at the first request: 12 s
        on the H200 host, holding the GIL (docs/benchmarks.md). Several input threads
        meeting that first request at once each build it, and the run waited 67 s. Done
        once here, as part of engine start, the threads find it built (the request's random
        pixels: `_random_page_request`)."""
        request = self._random_page_request("vlbatch-warm-up")
        task = request.task
        engine = self.llm.llm_engine
        started = time.monotonic()
        try:
            engine.input_processor.process_inputs(
                request.request_id, self.vllm_prompt(request), self.sampling_params(task),
                supported_tasks=engine.get_supported_tasks())
        except Exception as e:  # e.g. the prompt is too long: that page's row will say so
            log.debug("input processing warm-up: %s", e)
        seconds = time.monotonic() - started
        log.debug("input processing warm-up took %.1f s", seconds)
        return seconds

    @property
    def prompts(self) -> PromptBuilder:
        if self._prompts is None:
            self._prompts = PromptBuilder(self.job.model_path(), self.job.engine.trust_remote_code)
        elif isinstance(self._prompts, Future):
            self._prompts = self._prompts.result()
        return self._prompts

    def sampling_params(self, task: Task, retry: bool = False, lead: bool = False):
        """The task's settings; a retry (its first answer looped or broke its schema) adds
        the task's repetition penalty. A schema task's answers follow its JSON Schema. A
        page's lead (prefix_gate.py) has an output at each step, so its first is seen."""
        if (task.name, retry, lead) not in self._params:
            from vllm import SamplingParams
            from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

            schema = task.answer_schema
            # only finished requests are read: without FINAL_ONLY (LLM.generate's setting)
            # vLLM builds an output per running request at every step on the feeding thread
            self._params[task.name, retry, lead] = SamplingParams(
                max_tokens=task.max_tokens, temperature=task.temperature, top_p=task.top_p,
                seed=task.seed, ignore_eos=task.ignore_eos,
                repetition_penalty=task.retry_repetition_penalty if retry else 1.0,
                structured_outputs=StructuredOutputsParams(json=schema) if schema else None,
                output_kind=RequestOutputKind.CUMULATIVE if lead
                else RequestOutputKind.FINAL_ONLY)
        return self._params[task.name, retry, lead]

    def vllm_prompt(self, request: Request) -> dict:
        return {"prompt": request.chat_prompt or self.prompts.chat_prompt(request.text),
                "multi_modal_data": {"image": request.image}}

    def generate(self, feed: Iterator[Request | None]) -> Iterator[Completion]:
        """Requests from `feed` go to the input threads (or, with none, straight to vLLM);
        this thread adds what is ready to the engine, in order, and steps it."""
        engine = self.llm.llm_engine
        front = None
        if self.job.engine.frontend_threads:  # the threads warmed at engine start
            if self._front is None or self._front.closed:
                self._front = self._new_input_front()
            front = self._front
        in_flight: set[str] = set()
        preparing: deque[tuple[Request, Future, bool]] = deque()
        pages = PagesInFlight()
        gate = PrefixGate(self.job.engine.share_image_prefix and len(self.job.tasks) > 1
                          and self.job.engine.enable_prefix_caching is not False,
                          self.job.engine.max_pages_starting)

        def enter(request: Request, prepared: Future | None, lead: bool) -> Completion | None:
            """The request into the engine (or held for its page's lead); a Completion when
            the engine refuses it."""
            page = pages.page_of[request.request_id]
            if not lead and gate.hold(page, (request, prepared)):
                return None
            done = self._add(engine, request, prepared, lead)
            if done is None:
                in_flight.add(request.request_id)
                ramp.added()
                if lead:
                    gate.lead_added(request.request_id, page)
            else:
                pages.done(done.request_id)
                if lead:
                    gate.refused()
            return done

        sent_before = self._pixels.sent_without if self._pixels is not None else 0
        waiting = None  # a new page's request, taken while max_in_flight pages are in flight
        exhausted = False
        ramp = FeedRamp()
        try:
            while True:
                while not exhausted:
                    request, waiting = (waiting or next(feed, StopIteration)), None
                    if request is StopIteration:
                        exhausted = True
                    elif request is None:  # nothing rendered yet
                        if in_flight or preparing:
                            break
                        time.sleep(IDLE_WAIT_S)
                    elif not pages.joins_last(request) and (len(pages) >= self.max_in_flight
                                                            or gate.full()):
                        waiting = request
                        break
                    elif front is not None:
                        first = ramp.first_taken is None
                        ramp.taken()
                        lead = gate.leads(pages.joins_last(request), request.page_requests)
                        pages.take(request)
                        params = self.sampling_params(request.task, request.retry, lead)
                        prepared = front.prepare(request.request_id,
                                                 self.vllm_prompt(request), params)
                        if first:
                            prepared.add_done_callback(ramp.processed)
                        preparing.append((request, prepared, lead))
                    else:
                        ramp.taken()
                        lead = gate.leads(pages.joins_last(request), request.page_requests)
                        pages.take(request)
                        done = enter(request, None, lead)
                        if done is not None:
                            yield done
                if preparing and not in_flight:  # nothing to step: wait for the next one
                    wait([preparing[0][1]], timeout=IDLE_WAIT_S * 10)
                while preparing and preparing[0][1].done():
                    done = enter(*preparing.popleft())
                    if done is not None:
                        yield done
                if not in_flight:
                    if exhausted and not preparing:
                        return
                    continue
                for out in engine.step():
                    if gate.is_waited_on(out.request_id):  # the lead's prefill is done
                        for request, prepared in gate.started(out.request_id):
                            done = enter(request, prepared, False)
                            if done is not None:
                                yield done
                    if not out.finished:
                        continue
                    in_flight.discard(out.request_id)
                    pages.done(out.request_id)
                    yield self._completion(out)
        finally:
            if front is not None:
                front.report()
            if ramp.first_taken is not None:
                log.info("feed start: %s", ramp.describe())
            if gate.held_total:
                log.info("%d requests entered vLLM once their page's first task had begun to "
                         "decode (its image's prefix cached)", gate.held_total)
            if self._pixels is not None and self._pixels.sent_without > sent_before:
                log.info("%d requests sent to the engine core without their page's pixels "
                         "(it held them)", self._pixels.sent_without - sent_before)

    def _new_input_front(self) -> InputFront:
        e = self.job.engine
        return InputFront(self.llm.llm_engine, e.frontend_threads, e.frontend_torch_threads,
                          pixels_in_model_dtype=e.pixels_in_model_dtype)

    def _add(self, engine, request: Request, prepared: Future | None,
             lead: bool = False) -> Completion | None:
        """Add a request to the engine, processed by an input thread (`prepared`) or here;
        a Completion when it is refused (over-long prompt, bad image, ...)."""
        params = self.sampling_params(request.task, request.retry, lead)
        processed = None
        if prepared is not None:
            try:
                processed = prepared.result()
            except Exception as e:  # processed again below, alone: what fails then is final
                self._note_thread_failure(e)
        pixels = self._pixels
        stripped = pixels.strip(processed) if pixels is not None and processed is not None \
            else None
        try:
            engine.add_request(request.request_id,
                               processed if processed is not None else self.vllm_prompt(request),
                               params)
        except Exception as e:
            if pixels is not None:
                pixels.failed(processed, stripped)
            if is_bad_request(e):  # e.g. a prompt over max_model_len: the same tomorrow,
                # unless the limit changes (failures.refused_under: such rows are tried again)
                return Completion(request.request_id, None,
                                  f"{rejection_prefix(self.job.engine.max_model_len)}{e}",
                                  rejected=True)
            # not the request's fault: the next run tries it again (failures.py)
            return Completion(request.request_id, None, f"request refused by the engine: "
                              f"{type(e).__name__}: {e}", rejected=True)
        if pixels is not None:
            pixels.added(processed, stripped)
        return None

    def _note_thread_failure(self, error: Exception) -> None:
        """An input thread's failure; the request is processed again on the stepping thread.
        A bad request (an over-long prompt: `is_bad_request`) fails there too and is
        refused; a failure of the threads themselves (a race in a library) costs time, not
        answers: the first of each other kind is logged."""
        kind = type(error).__name__
        if kind not in self._thread_failures and not is_bad_request(error):
            log.warning("input thread failed (%s: %s); processing such requests again on "
                        "the engine thread", kind, str(error)[:200])
        self._thread_failures[kind] = self._thread_failures.get(kind, 0) + 1

    @staticmethod
    def _completion(out) -> Completion:
        prompt_tokens = len(out.prompt_token_ids) if out.prompt_token_ids is not None else None
        if not out.outputs:
            return Completion(out.request_id, None, "engine returned no output", prompt_tokens)
        first = out.outputs[0]
        if first.finish_reason == "abort":
            return Completion(out.request_id, None, "request aborted by the engine", prompt_tokens)
        return Completion(out.request_id, first.text, None, prompt_tokens, len(first.token_ids),
                          finish_reason=first.finish_reason,
                          cached_prompt_tokens=getattr(out, "num_cached_tokens", None))

    def close(self) -> None:
        front = getattr(self, "_front", None)
        if front is not None:  # the generator may not have ended
            front.close()
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine_core = getattr(llm.llm_engine, "engine_core", None)
            shutdown = getattr(engine_core, "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None


class FeedRamp:
    """How fast a run's first requests reach the engine: the GPU idles at a run's start
    until enough are in (the benchmark's log shows it)."""

    MARKS_S = (0.5, 1.0, 2.0)

    def __init__(self):
        self.first_taken: float | None = None  # the first request taken from the feed
        self.first_processed: float | None = None  # by an input thread (if any)
        self.first_added: float | None = None
        self.by_mark = [0] * len(self.MARKS_S)  # requests added within each mark of the first

    def taken(self) -> None:
        if self.first_taken is None:
            self.first_taken = time.monotonic()

    def processed(self, _future=None) -> None:
        """The first request's processing is done (an input thread calls it)."""
        if self.first_processed is None:
            self.first_processed = time.monotonic()

    def added(self) -> None:
        now = time.monotonic()
        if self.first_added is None:
            self.first_added = now
        since = now - (self.first_taken if self.first_taken is not None else now)
        for i, mark in enumerate(self.MARKS_S):
            if since <= mark:
                self.by_mark[i] += 1

    def describe(self) -> str:
        if self.first_added is None:
            return "no request added"
        marks = ", ".join(f"{n} by {m:g} s" for n, m in zip(self.by_mark, self.MARKS_S))
        processed = "" if self.first_processed is None else \
            f"processed {self.first_processed - self.first_taken:.2f} s and "
        return (f"first request {processed}added {self.first_added - self.first_taken:.2f} s "
                f"after it was taken; requests added: {marks}")


class PagesInFlight:
    """Requests taken from the feed and not yet done, counted by page: a page's tasks (the
    same image, one after another in the feed) count once, as they share its pixels."""

    def __init__(self):
        self.requests: dict[int, int] = {}  # page: its requests not yet done
        self.page_of: dict[str, int] = {}  # request id: its page
        self._image = None  # the last page's image
        self._page = 0

    def __len__(self) -> int:
        return len(self.requests)

    def joins_last(self, request: Request) -> bool:
        return request.image is not None and request.image is self._image

    def take(self, request: Request) -> None:
        if not self.joins_last(request):
            self._page += 1
            self._image = request.image
        self.requests[self._page] = self.requests.get(self._page, 0) + 1
        self.page_of[request.request_id] = self._page

    def done(self, request_id: str) -> None:
        page = self.page_of.pop(request_id, None)
        if page is None:
            return
        if self.requests[page] > 1:
            self.requests[page] -= 1
        else:
            del self.requests[page]


def start_vllm_engine(job: Job, prompts=None) -> VllmEngine:
    """The default engine factory: vLLM; `prompts` is the PromptBuilder (or its Future),
    None where the engine loads its own (a Ray actor)."""
    return VllmEngine(job, prompts)
