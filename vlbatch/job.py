"""The job: one typed object, validated when the YAML is loaded, passed down to every stage.

Field names fixed by DESIGN.md: name, inputs, output, cache, model, tasks. Paths in the file
are relative to the job file's folder; CLI overrides are relative to the current directory.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vlbatch.errors import JobFileError

# Placeholders a prompt may use; any other brace is literal text (prompts often hold JSON).
PROMPT_PLACEHOLDERS = ("text_layer", "source", "page")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Task(_Strict):
    """One question asked of every page, with its own sampling settings."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=1024, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks force a fixed output length with it

    def render_prompt(self, **values: object) -> str:
        """Substitute the known {placeholders} by name; leave every other brace as it is."""
        text = self.prompt
        for key in PROMPT_PLACEHOLDERS:
            if key in values:
                text = text.replace("{" + key + "}", str(values[key]))
        return text

    def uses(self, placeholder: str) -> bool:
        return "{" + placeholder + "}" in self.prompt

    def fingerprint(self) -> str:
        """Hash of everything that changes this task's answers (prompt and sampling)."""
        return _task_fingerprint(self)


@lru_cache(maxsize=1024)  # asked for every row and every done-check; tasks are frozen
def _task_fingerprint(task: Task) -> str:
    fields = task.model_dump(exclude={"name"})
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


class Render(_Strict):
    """How pages become images: PDF DPI and the model's pixel budget (Qwen3-VL smart resize)."""

    dpi: int = Field(default=150, ge=18, le=1200)
    min_pixels: int = Field(default=64 * 32 * 32, ge=32 * 32)
    max_pixels: int = Field(default=1280 * 32 * 32, ge=32 * 32)
    workers: int = Field(default=0, ge=0)  # 0: one per CPU core
    page_timeout_s: float = Field(default=120.0, gt=0)  # a page taking longer: error row
    file_timeout_s: float = Field(default=900.0, gt=0)  # render time a file may use in all
    pdf_password: str | None = None

    @model_validator(mode="after")
    def _bounds(self) -> Render:
        if self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels must not exceed max_pixels")
        return self


class Dedupe(_Strict):
    """Near-duplicate merging: candidates by perceptual hash, then a pixel-level check."""

    near_duplicates: bool = True  # exact copies (same pixels) always merge
    max_phash_distance: int = Field(default=24, ge=0, le=256)  # of 256 bits
    # the pixel check (pipeline/dedupe.py): the largest block difference (0-255) and how far
    # it may stand out above the 20th largest (a local change of content), for the same
    # raster (JPEG, noise) and for re-renders that carry the same text layer
    max_block_diff: float = Field(default=11.0, ge=0.0, le=255.0)
    max_peak_ratio: float = Field(default=2.0, ge=1.0)
    rerender_max_block_diff: float = Field(default=45.0, ge=0.0, le=255.0)
    rerender_max_peak_ratio: float = Field(default=3.5, ge=1.0)


class Engine(_Strict):
    """vLLM engine settings (None: vLLM's own default)."""

    max_model_len: int | None = Field(default=None, ge=64)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=64)
    dtype: str = "auto"
    tensor_parallel_size: int = Field(default=1, ge=1)
    load_format: str = "auto"  # "dummy": the real architecture with random weights
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    seed: int = 0
    # requests handed to vLLM at once: enough to fill the KV cache (H200, 30B-A3B: ~450 W1
    # requests resident), bounded so host memory stays flat
    max_in_flight: int = Field(default=512, ge=1)
    cpu_kv_cache_gib: float = Field(default=2.0, gt=0)  # CPU build only
    # torch.compile the vision encoder too (vLLM option; no effect with enforce_eager); +11% on
    # prefill (shared/DESIGN.md); on W1 end to end within noise (H200, docs/benchmarks.md)
    compile_mm_encoder: bool = True
    # CUDA graphs of the vision encoder (vLLM option, GPU only): on W1 no faster (H200, 2026-12-03:
    # raw 10.24 vs 10.48 pages/s; docs/benchmarks.md) and 1 GiB less KV cache, so off
    cudagraph_mm_encoder: bool = False
    compile_cache_dir: Path | None = None  # vLLM's cache root (compiled graphs); None: ~/.cache/vllm
    trust_remote_code: bool = False


class Ray(_Strict):
    """Where and how `executor: ray` runs (see README, "Several GPUs or machines: Ray")."""

    address: str | None = None  # None: a local Ray cluster on this machine; "auto": join the
    # cluster this machine belongs to; "ray://head:10001": a remote cluster's client port
    workers: int = Field(default=1, ge=1)  # vLLM actors, each loading the model once
    gpus_per_worker: float | None = Field(default=None, ge=0)  # None: the engine's
    # tensor_parallel_size when the cluster has GPUs, else 0 (the CPU build)
    render_workers: int = Field(default=0, ge=0)  # render actors at most; 0: the cluster's CPUs
    pages_per_batch: int = Field(default=32, ge=1)  # pages per Ray Data block
    batches_per_worker: int = Field(default=16, ge=1)  # blocks a vLLM actor works on at once,
    # so its engine is fed the next blocks' pages while the last ones finish: 32 x 16 = 512
    # pages in flight per engine, as engine.max_in_flight in a local run


class Job(_Strict):
    name: str = Field(min_length=1)
    inputs: list[str] = Field(min_length=1)
    output: Path
    cache: Path = Path(".vlbatch-cache")
    model: str = Field(min_length=1)
    tasks: list[Task] = Field(min_length=1)
    render: Render = Render()
    engine: Engine = Engine()
    dedupe: Dedupe = Dedupe()
    max_error_rate: float = Field(default=1.0, ge=0.0, le=1.0)
    part_rows: int = Field(default=1000, ge=1)  # a results part is written every N rows...
    part_seconds: float = Field(default=30.0, gt=0)  # ...or every N seconds: the resume point
    result_cache: bool = True  # answers outlive the run in the cache folder
    feature_cache: bool = True  # rendered pages too: a later run skips rendering
    cache_size_gib: float = Field(default=20.0, gt=0)  # per cache (results, features); LRU eviction
    cache_namespace: str = Field(default="default", min_length=1)  # tenants never share answers
    executor: Literal["local", "ray"] = "local"  # ray: render and generate on a Ray cluster
    ray: Ray = Ray()
    base_dir: Path = Field(default=Path("."), exclude=True)  # the job file's folder

    @field_validator("tasks")
    @classmethod
    def _unique_task_names(cls, tasks: list[Task]) -> list[Task]:
        names = [t.name for t in tasks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"task names must be unique; repeated: {', '.join(dupes)}")
        return tasks

    def model_path(self) -> str:
        """The model as vLLM takes it: a local folder (relative to the job file); else a hub
        id's snapshot already in the local Hugging Face cache, so a nightly run on a server
        without network starts at once instead of retrying the hub; else the hub id."""
        local = self.base_dir / self.model
        if local.exists():
            return str(local.resolve())
        return _cached_snapshot(self.model) or self.model

    def config_hash(self) -> str:
        dumped = self.model_dump(mode="json", exclude={"base_dir"})
        return hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()[:16]


@lru_cache(maxsize=64)
def _cached_snapshot(repo_id: str) -> str | None:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached, not a valid id, or no huggingface_hub: use the id as is
        return None


def _describe(error: dict) -> str:
    where = ".".join(str(p) for p in error["loc"]) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"unknown field '{where}'"
    if kind == "missing":
        return f"missing required field '{where}'"
    return f"field '{where}': {error['msg']}"


def load_job(path: str | Path, *, output: str | None = None, cache: str | None = None) -> Job:
    """Read and validate a job file; overrides come from the CLI (relative to the cwd)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise JobFileError(f"{path}: job file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JobFileError(f"{path}: cannot read job file: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        reason = getattr(e, "problem", None) or str(e)
        raise JobFileError(f"{path}: invalid YAML{where}: {reason}") from None
    if not isinstance(raw, dict):
        raise JobFileError(f"{path}: a job file must be a mapping of fields, got {type(raw).__name__}")
    base = path.resolve().parent
    try:
        job = Job.model_validate({**raw, "base_dir": base})
    except ValidationError as e:
        problems = "; ".join(_describe(err) for err in e.errors())
        raise JobFileError(f"{path}: {problems}") from None
    updates: dict = {
        "output": Path(output).resolve() if output else (base / job.output).resolve(),
        "cache": Path(cache).resolve() if cache else (base / job.cache).resolve(),
    }
    if job.engine.compile_cache_dir is not None:
        updates["engine"] = job.engine.model_copy(
            update={"compile_cache_dir": (base / job.engine.compile_cache_dir).resolve()})
    return job.model_copy(update=updates)

