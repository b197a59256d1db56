"""vLLM's input processing for page requests, in threads of its own.

vLLM's offline `LLM` runs the model's HF processor (resize, normalise, patchify), hashing
and the request's assembly on the thread that steps the engine, one request at a time; on
W1 that thread, not the GPU, sets the pace (docs/benchmarks.md). Here several threads run
the same code (`InputProcessor.process_inputs`, which vLLM's own `add_request` calls) and
hand the stepping thread finished `EngineCoreRequest`s, which `LLMEngine.add_request`
takes as they are. Torch and the tokenizer release the GIL, so the threads run in parallel.

vLLM internals used, present in 0.26 (GPU) and 0.32 (CPU build), checked by
tests/test_e2e_vllm.py: `LLMEngine.input_processor.process_inputs(request_id, prompt,
params, supported_tasks=...)`, `LLMEngine.get_supported_tasks()`, and `add_request` taking
an `EngineCoreRequest`. vLLM's processor cache is off while these threads run (its LRU is
not made for concurrent use); vlbatch dedupes pages before they reach the engine, and the
engine's encoder and prefix caches still share a page's image work between its tasks.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor


class InputFront:
    def __init__(self, llm_engine, threads: int, torch_threads: int):
        self.engine = llm_engine
        self.processor = llm_engine.input_processor
        self.supported_tasks = llm_engine.get_supported_tasks()
        # vLLM sets torch's thread count from OMP_NUM_THREADS around each request's
        # processing (vllm/utils/torch_utils.py): the count for these threads. Set after the
        # engine started, so its own processes keep theirs.
        os.environ["OMP_NUM_THREADS"] = str(torch_threads)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="vlbatch-frontend")

    def prepare(self, request_id: str, prompt: dict, params) -> Future:
        """The request as vLLM's add_request would build it (a Future)."""
        return self.pool.submit(self.processor.process_inputs, request_id, prompt, params,
                                supported_tasks=self.supported_tasks)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
