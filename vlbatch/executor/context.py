"""What a run hands its executor besides the plan and the sink."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from vlbatch.engine.base import GenerationEngine
from vlbatch.job import Job
from vlbatch.pipeline.workers import WorkerPool


@dataclass(frozen=True)
class RunContext:
    """What the run gives an executor besides the plan and the sink."""

    job: Job
    pool: WorkerPool  # render worker processes (the feature cache open in each)
    prompts: Future  # the model's PromptBuilder, loading in the background
    features: object | None  # the FeatureCache (dedupe index), or None
    results: object | None  # the ResultCache, or None
    engine_factory: Callable[[Job, object], GenerationEngine]
    lap: Callable[[str], None]  # records the seconds since the last lap under a name
