"""vLLM's input processing for page requests, in threads of its own, once a page.

vLLM's offline `LLM` runs the model's HF processor (resize, normalise, patchify), hashing
and the request's assembly on the thread that steps the engine, one request at a time; on
W1 that thread, not the GPU, sets the pace (docs/benchmarks.md). Here several threads run
the same code (`InputProcessor.process_inputs`, which vLLM's own `add_request` calls) and
hand the stepping thread finished `EngineCoreRequest`s, which `LLMEngine.add_request`
takes as they are. Torch and the tokenizer release the GIL, so the threads run in parallel.

A page's tasks share one processing: the first task's request is processed in full; each
other task of the same page (the same image object, next in the feed) is built from it: the
task's prompt tokenized, the first request's image span (its pad tokens expanded by the
processor) spliced in where the placeholder stands, and the same processed image, hash and
placeholder handed to `process_inputs` as a processed multi-modal input
(`vllm.inputs.engine.mm_input`), which skips the HF processor. The engine then sees the
same image hash in each, so its encoder cache and prefix cache share the page's image work.
Where the splice cannot be made safely (the prompt before the image differs, the image span
is not where the placeholder stands), the request is processed in full instead.

vLLM internals used, present in 0.26 (GPU) and 0.32 (CPU build), checked by
tests/test_e2e_vllm.py: `LLMEngine.input_processor.process_inputs(request_id, prompt,
params, supported_tasks=...)` (also with a processed input), `LLMEngine.get_supported_tasks()`,
`LLMEngine.get_tokenizer()`, `EngineCoreRequest.mm_features` (data, mm_hash, mm_position),
`vllm.inputs.engine.mm_input`, and `add_request` taking an `EngineCoreRequest`.

vLLM's front-end processor cache is taken off the renderer while these threads run (its LRU
is not made for concurrent use); its twin in the engine core (the receiver cache, which
keeps the processed images it was sent, by hash) stays, and `PixelsOnce` uses it as vLLM's
own front end does: a page's later requests go to the engine core without the image's
pixels, which the core still holds (W3: one copy a page, not one a task).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait

log = logging.getLogger("vlbatch")
MAX_PLACEHOLDER_TOKENS = 4  # the image's placeholder in the prompt text, before expansion


class Unshareable(Exception):
    """The page's first request cannot stand for another task's (processed in full)."""


class InputFront:
    def __init__(self, llm_engine, threads: int, torch_threads: int,
                 pixels_in_model_dtype: bool = False):
        self.engine = llm_engine
        self.pixel_dtype = _lower_float(llm_engine.model_config.dtype) \
            if pixels_in_model_dtype else None
        self.processor = llm_engine.input_processor
        self.supported_tasks = llm_engine.get_supported_tasks()
        self.tokenizer = llm_engine.get_tokenizer()
        self._last: tuple[object, Future, str] | None = None  # image, first request, its text
        self._lock = threading.Lock()
        self.shared = 0  # requests built from their page's first request
        self.unshared = 0  # a page's later requests processed in full (Unshareable)
        self._reported = (0, 0)  # shared, unshared at the last report
        self.closed = False
        self.warmed = 0  # warm-up requests the threads processed (warm_up)
        # vLLM sets torch's thread count from OMP_NUM_THREADS around each request's
        # processing (vllm/utils/torch_utils.py): the count for these threads. Set after the
        # engine started, so its own processes keep theirs.
        os.environ["OMP_NUM_THREADS"] = str(torch_threads)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="vlbatch-frontend")

    def warm_up(self, prompts: list[dict], params, timeout_s: float) -> float:
        """Process `prompts` (one a thread, all at once, none added to the engine) so that
        each thread exists and has met vLLM's processing before the run's first page: a
        thread's first request took about a second on the H100 host (docs/benchmarks.md),
        while the GPU waited. The seconds it took; a failure or a stall (bounded by
        `timeout_s`) only costs the warm-up."""
        started = time.monotonic()
        # every task waits for the others: each is held by a thread of its own
        together = threading.Barrier(len(prompts))

        def process(i: int, prompt: dict):
            together.wait(timeout_s)
            return self._process(f"vlbatch-thread-warm-up-{i}", prompt, params)

        futures = [self.pool.submit(process, i, prompt) for i, prompt in enumerate(prompts)]
        done, stalled = wait(futures, timeout=timeout_s)
        failures = [e for e in (f.exception() for f in done) if e is not None]
        seconds = time.monotonic() - started
        if failures or stalled:
            together.abort()
            log.debug("input threads' warm-up: %d failed (%s), %d did not finish in %.0f s",
                      len(failures), failures[0] if failures else "-", len(stalled), timeout_s)
        self.warmed = len(done) - len(failures)
        log.debug("input threads' warm-up (%d requests, one a thread) took %.2f s",
                  len(prompts), seconds)
        return seconds

    def prepare(self, request_id: str, prompt: dict, params) -> Future:
        """The request as vLLM's add_request would build it (a Future). A request for the
        image of the one before it is built from that one's processing."""
        image = prompt.get("multi_modal_data", {}).get("image")
        last = self._last
        if image is not None and last is not None and last[0] is image:
            derived: Future = Future()
            first_text = last[2]
            last[1].add_done_callback(lambda first: self._submit_derived(
                derived, first, first_text, request_id, prompt, params))
            return derived
        future = self.pool.submit(self._process, request_id, prompt, params)
        self._last = (image, future, prompt.get("prompt")) if image is not None else None
        return future

    def _process(self, request_id: str, prompt, params):
        request = self.processor.process_inputs(request_id, prompt, params,
                                                supported_tasks=self.supported_tasks)
        if self.pixel_dtype is not None:
            for feature in request.mm_features or ():
                if feature.data is not None:
                    feature.data = pixels_in(feature.data, self.pixel_dtype)
        return request

    def _submit_derived(self, derived: Future, first: Future, first_text, request_id, prompt,
                        params):
        try:
            inner = self.pool.submit(self._derive, first, first_text, request_id, prompt, params)
        except RuntimeError as e:  # the front was closed meanwhile
            derived.set_exception(e)
            return
        inner.add_done_callback(lambda f: _copy_outcome(f, derived))

    def _derive(self, first: Future, first_text, request_id: str, prompt: dict, params):
        if first.exception() is None and isinstance(first_text, str):
            try:
                shared = shared_input(first.result(), first_text, prompt["prompt"],
                                      self.tokenizer)
            except Unshareable as e:
                with self._lock:
                    self.unshared += 1
                    said = self.unshared == 1
                if said:
                    log.debug("a page's request processed in full, not shared: %s", e)
            else:
                request = self._process(request_id, shared, params)
                with self._lock:
                    self.shared += 1
                return request
        return self._process(request_id, prompt, params)

    def report(self) -> None:
        """Logs how many requests were shared since the last report (a run's end) and
        starts the next run afresh: its first request is processed in full."""
        with self._lock:
            totals = self.shared, self.unshared
        shared, unshared = (n - before for n, before in zip(totals, self._reported))
        self._reported = totals
        self._last = None
        if shared or unshared:
            log.info("input threads: %d requests built from their page's first task's "
                     "processing, %d processed in full", shared, unshared)

    def close(self) -> None:
        """Stops the threads (what is queued is dropped) after a last report; once, whoever
        calls first (the generator's end or the engine's close)."""
        if self.closed:
            return
        self.closed = True
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.report()


PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
# vLLM's front-end processor caches whose twin in the engine core keeps the processed items
# it is sent (the "lru" cache type): 0.26's name, 0.32's
PAIRED_SENDER_CACHES = ("MultiModalProcessorSenderCache", "LruKeyReplicatedSenderCache")


def detach_processor_cache(llm_engine) -> int:
    """Takes vLLM's front-end processor cache off its renderer (the input threads process
    without it) and returns how many bytes of processed images the engine core's twin cache
    keeps: 0 where it has none (the cache is off, or of another type)."""
    renderer = llm_engine.input_processor.renderer
    if hasattr(renderer, "_mm_processor_cache"):  # vLLM 0.32: handed to each processing
        cache, renderer._mm_processor_cache = renderer._mm_processor_cache, None
    else:  # vLLM 0.26: held by the processor
        processor = getattr(renderer, "mm_processor", None)
        cache = getattr(processor, "cache", None)
        if cache is not None:
            processor.cache = None
    if type(cache).__name__ not in PAIRED_SENDER_CACHES:
        return 0
    return int(llm_engine.model_config.get_multimodal_config().mm_processor_cache_gb * 2**30)


class PixelsOnce:
    """A request whose image the engine core still holds goes without the image's data.

    The engine core's receiver cache (vLLM's, `detach_processor_cache`) keeps each image it
    is sent, by hash, in an LRU of `capacity` bytes, and hands a request that comes without
    data the kept one (vLLM's own front end relies on the same). Requests reach the core in
    the order they are added, so this mirrors that LRU: each image added, with its data or
    without, moves to the newest end; the oldest leave once the images held pass half the
    capacity (a margin: the core keeps at least what the mirror keeps). The data is left out
    only for an image the mirror holds: a page's later tasks, which may enter after other
    pages' first tasks (prefix_gate.py). Used on the thread that adds requests."""

    def __init__(self, capacity: int):
        self.capacity = capacity  # bytes the engine core's receiver cache keeps
        self.budget = capacity // 2  # what the mirror keeps (the margin)
        self.held: OrderedDict[str, int] = OrderedDict()  # image key: bytes, oldest first
        self.held_bytes = 0
        self.sent_without = 0  # requests sent without their image's data

    def strip(self, request):
        """Leaves the image's data out of `request` where the core holds it; returns the
        features as they were (to put back if the add fails), else None."""
        features = request.mm_features
        if not self.held or not features or len(features) != 1:
            return None
        feature = features[0]
        if feature.data is None or _cache_key(feature) not in self.held:
            return None
        request.mm_features = [dataclasses.replace(feature, data=None)]
        return features

    def added(self, request, stripped) -> None:
        """`request` reached the engine (`stripped`: what `strip` returned); None: a request
        vLLM processed itself, unseen here."""
        if request is None:
            self.forget()
            return
        features = request.mm_features
        if not features:  # a text-only request leaves the core's cache as it was
            return
        if len(features) != 1:
            self.forget()
            return
        key = _cache_key(features[0])
        if stripped is not None:
            self.sent_without += 1
            self.held.move_to_end(key)
            return
        if features[0].data is None or key is None:
            self.forget()
            return
        if key in self.held:  # the core already had it: it only moves to the newest end
            self.held.move_to_end(key)
            return
        size = _item_bytes(features[0].data) if self.budget else 0
        if not 0 < size <= self.budget:  # no cache, or one the core would not keep it in
            return
        self.held[key] = size
        self.held_bytes += size
        while self.held_bytes > self.budget:
            _, oldest = self.held.popitem(last=False)
            self.held_bytes -= oldest

    def failed(self, request, stripped) -> None:
        """The add raised: the data is put back; nothing is assumed of the core's cache."""
        if stripped is not None:
            request.mm_features = stripped
        self.forget()

    def forget(self) -> None:
        """Nothing is assumed of the core's cache: each next image goes with its data."""
        self.held.clear()
        self.held_bytes = 0


def _cache_key(feature) -> str | None:
    return feature.mm_hash or feature.identifier  # the receiver cache's key


def _item_bytes(item) -> int:
    """The size the receiver cache counts an item at (vLLM's own measure)."""
    try:
        from vllm.multimodal.cache.base import MultiModalCache  # 0.32
    except ImportError:
        from vllm.multimodal.cache import MultiModalCache  # 0.26

    return MultiModalCache.get_item_size(item)


def _lower_float(dtype):
    """The model's dtype where it is a float narrower than float32 (else None)."""
    import torch

    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def pixels_in(item, dtype):
    """The processed image item with its float32 pixel values in `dtype`: Qwen-VL models cast
    them to the vision tower's dtype first thing (`pixel_values.type(self.visual.dtype)`),
    so the values the model computes with are the same, and half the bytes travel to the
    engine core. The item itself is left as it is (a new one is returned)."""
    import dataclasses

    import torch

    changed = {}
    for key in PIXEL_KEYS:
        elem = item.get(key)
        if elem is not None and isinstance(elem.data, torch.Tensor) \
                and elem.data.dtype == torch.float32:
            changed[key] = dataclasses.replace(elem, data=elem.data.to(dtype))
    if not changed:
        return item
    return type(item)({**item, **changed})


def _copy_outcome(source: Future, target: Future) -> None:
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


def shared_input(first, first_text: str, text: str, tokenizer) -> dict:
    """A processed multi-modal input for `text` (a prompt with the same image placeholder)
    built from `first`, the EngineCoreRequest of the page's first task (whose prompt was
    `first_text`): the text tokenized,
    its placeholder tokens replaced by the image span `first`'s processing expanded them to,
    the same image item, hash and placeholder range. Unshareable where that is not sure to
    be what vLLM's processing of `text` gives."""
    from vllm.inputs.engine import mm_input

    features = first.mm_features or []
    if len(features) != 1 or first.prompt_token_ids is None:
        raise Unshareable(f"{len(features)} multi-modal items")
    feature = features[0]
    if feature.data is None or not feature.mm_hash:
        raise Unshareable("the first request carries no image data")
    expanded = list(first.prompt_token_ids)
    start, length = feature.mm_position.offset, feature.mm_position.length
    # where the first request's own text and its expansion differ: the placeholder
    first_ids = tokenizer.encode(first_text, add_special_tokens=False)
    # (the expansion repeats a placeholder token: the common ends stop at the image span)
    prefix = min(_common_prefix(first_ids, expanded), start)
    suffix = min(_common_prefix(first_ids[prefix:][::-1], expanded[prefix:][::-1]),
                 len(expanded) - start - length)
    placeholder = first_ids[prefix:len(first_ids) - suffix]
    replacement = expanded[prefix:len(expanded) - suffix]
    if not (prefix == start and 0 < len(placeholder) <= MAX_PLACEHOLDER_TOKENS):
        raise Unshareable("the image span is not where the placeholder stands")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if ids[:prefix] != first_ids[:prefix] or ids[prefix:prefix + len(placeholder)] != placeholder:
        raise Unshareable("the prompt before the image differs from the first task's")
    rest = ids[prefix + len(placeholder):]
    if _contains(rest, placeholder):
        raise Unshareable("the prompt holds the image placeholder twice")
    return mm_input(first_ids[:prefix] + replacement + rest, {"image": [feature.data]},
                    {"image": [feature.mm_hash]}, {"image": [feature.mm_position]})


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))
