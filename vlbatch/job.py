"""The job: one typed object, validated when the YAML is loaded, passed down to every stage.

Field names fixed by DESIGN.md: name, inputs, output, cache, model, tasks. Paths in the file
are relative to the job file's folder; CLI overrides are relative to the current directory.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from vlbatch import answer_schema
from vlbatch.errors import JobFileError

# Placeholders a prompt may use; any other brace is literal text (prompts often hold JSON).
PROMPT_PLACEHOLDERS = ("text_layer", "source", "page")
DEFAULT_MAX_IMAGE_MEGAPIXELS = 200.0
_PLACEHOLDER = re.compile(r"\{\{([A-Za-z_]\w*)\}\}|\{(" + "|".join(PROMPT_PLACEHOLDERS) + r")\}")
_WORD_IN_BRACES = re.compile(r"\{\{[A-Za-z_]\w*\}\}|\{([A-Za-z_]\w*)\}")  # group 1: not escaped


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Task(_Strict):
    """One question asked of every page, with its own sampling settings."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="The task's "
                      "name: the results' `task` column and OUTPUT/fields/<name>/.")
    prompt: str = Field(min_length=1, description="What is asked of each page; {text_layer}, "
                        "{source} and {page} are filled in, any other brace is literal.")
    max_tokens: int = Field(default=1024, ge=1, description="Most tokens an answer may have; "
                            "one that reaches it has finish_reason 'length'.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0: "
                               "greedy (the same page gives the same answer).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling: the "
                         "smallest set of tokens whose probabilities sum to top_p.")
    seed: int | None = Field(default=None, description="The sampling seed of this task's "
                             "requests; None: the engine's (engine.seed).")
    ignore_eos: bool = Field(default=False, description="Generate max_tokens whatever the "
                             "model says (benchmarks force a fixed output length with it).")
    json_schema: str | None = Field(default=None, alias="schema", description="The fields "
                                    "this task extracts, as a JSON Schema: a mapping, or a "
                                    ".json/.yaml file relative to the job file. Enforced while "
                                    "generating; typed columns in OUTPUT/fields/<task>/.")
    fields: str | None = Field(default=None, description="The same in a compact form: field "
                               "name -> string | integer | number | boolean | date | datetime | "
                               "list[T] | [one, of] | a mapping; '?' for nullable "
                               "(vlbatch/answer_schema.py).")
    retry_repetition_penalty: float = Field(default=1.2, ge=1.0, description="An answer that "
                                            "loops to max_tokens (or breaks its schema) is "
                                            "generated once more with this repetition penalty.")

    @field_validator("json_schema", mode="before")
    @classmethod
    def _load_schema(cls, value, info: ValidationInfo):
        """Held as canonical JSON (a task stays hashable); read once, here."""
        if value is None:
            return None
        base = (info.context or {}).get("base_dir")
        schema = answer_schema.load_schema(value, Path(base) if base else None)
        answer_schema.check_schema(schema)
        return json.dumps(schema, sort_keys=True)

    @field_validator("fields", mode="before")
    @classmethod
    def _compact_fields(cls, value):
        if value is None:
            return None
        if isinstance(value, str):  # as dumped (Ray's actors get the job as plain data)
            value = json.loads(value)
        answer_schema.check_schema(answer_schema.compact_to_json_schema(value))
        return json.dumps(value)  # in the order written: the columns' order

    @model_validator(mode="after")
    def _one_schema(self) -> Task:
        if self.json_schema is not None and self.fields is not None:
            raise ValueError("give `schema` or `fields`, not both")
        return self

    @property
    def answer_schema(self) -> dict | None:
        """The JSON Schema answers must follow, or None for free text."""
        if self.json_schema is not None:
            return _parsed(self.json_schema)
        if self.fields is not None:
            return _compact(self.fields)
        return None

    @field_validator("prompt")
    @classmethod
    def _known_placeholders(cls, prompt: str) -> str:
        """A {word} that is not a placeholder is a typo ({textlayer}) that would reach the
        model as it is: refused. JSON braces ({"a": 1}) are not words; {{word}} is sent as
        {word}."""
        unknown = sorted({m[1] for m in _WORD_IN_BRACES.finditer(prompt) if m[1] is not None
                          and m[1] not in PROMPT_PLACEHOLDERS})
        if unknown:
            known = ", ".join("{" + k + "}" for k in PROMPT_PLACEHOLDERS)
            raise ValueError(f"unknown placeholder {', '.join('{' + u + '}' for u in unknown)} "
                             f"(known: {known}; write {{{{word}}}} for a literal {{word}})")
        return prompt

    def render_prompt(self, **values: object) -> str:
        """Substitute the known {placeholders} by name, in one pass (a text layer that says
        "{page}" stays as it is); {{word}} becomes {word}; every other brace stays."""
        def fill(m: re.Match) -> str:
            if m[1] is not None:  # {{word}}
                return "{" + m[1] + "}"
            return str(values[m[2]]) if m[2] in values else m[0]

        return _PLACEHOLDER.sub(fill, self.prompt)

    def fingerprint(self) -> str:
        """Hash of everything that changes this task's answers (prompt and sampling)."""
        return _task_fingerprint(self)


@lru_cache(maxsize=64)
def _parsed(text: str) -> dict:
    return json.loads(text)


@lru_cache(maxsize=64)
def _compact(text: str) -> dict:
    return answer_schema.compact_to_json_schema(json.loads(text))


@lru_cache(maxsize=1024)  # asked for every row and every done-check; tasks are frozen
def _task_fingerprint(task: Task) -> str:
    fields = task.model_dump(exclude={"name"})
    # settings added later are left out at their defaults: older rows stay current
    for name, default in (("json_schema", None), ("fields", None),
                          ("retry_repetition_penalty", 1.2)):
        if fields[name] == default:
            del fields[name]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


class Render(_Strict):
    """How pages become images: PDF DPI and the model's pixel budget (Qwen3-VL smart resize)."""

    dpi: int = Field(default=150, ge=18, le=1200, description="PDF render DPI (lowered for "
                     "pages larger than the pixel budget).")
    min_pixels: int = Field(default=64 * 32 * 32, ge=32 * 32, description="The model's pixel "
                            "budget, lower bound (Qwen3-VL: one image token per 32x32 pixels).")
    max_pixels: int = Field(default=1280 * 32 * 32, ge=32 * 32,
                            description="The model's pixel budget, upper bound.")
    workers: int = Field(default=0, ge=0, description="Render processes; 0: one per CPU core.")
    page_timeout_s: float = Field(default=120.0, gt=0, description="A page whose rendering "
                                  "takes longer gets an error row 'timeout'.")
    file_timeout_s: float = Field(default=900.0, gt=0, description="Render seconds a file may "
                                  "use in all, counted in plan order; its later pages get "
                                  "error rows 'timeout'.")
    pdf_password: str | None = Field(default=None, description="Tried on encrypted PDFs; "
                                     "one that it does not open gets an error row.")
    max_image_megapixels: float = Field(default=DEFAULT_MAX_IMAGE_MEGAPIXELS, gt=0, description=
                                        "Image files larger than this are refused (a "
                                        "decompression bomb guard); large-format scans run to "
                                        "100-150 MP.")

    @model_validator(mode="after")
    def _bounds(self) -> Render:
        if self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels must not exceed max_pixels")
        return self


class Dedupe(_Strict):
    """Near-duplicate merging: candidates by perceptual hash, then a pixel-level check."""

    near_duplicates: bool = Field(default=True, description="Merge confirmed near-copies; "
                                  "exact copies (same pixels) always merge.")
    max_phash_distance: int = Field(default=24, ge=0, le=256, description="Candidates: "
                                    "perceptual-hash distance, of 256 bits.")
    max_blank_mark: float = Field(default=8.0, ge=0.0, le=255.0, description="Pixel check: "
                                  "the most ink (8x8 block mean, 0-255) one page may have "
                                  "where the other is blank paper.")
    max_blank_dot: float = Field(default=64.0, ge=0.0, le=255.0, description="Pixel check: "
                                 "how dark (0-255) one pixel of ink may be that one page has "
                                 "where the other is blank paper, when it stands out above "
                                 "the rest (max_blank_dot_ratio).")
    max_blank_dot_ratio: float = Field(default=6.0, ge=1.0, description="Pixel check: "
                                       "how far that pixel may stand out above the 20th darkest "
                                       "such pixel (rendering noise leaves many alike).")
    max_ink_shift_ratio: float = Field(default=2.0, ge=1.0, description="Pixel check: how "
                                       "far the largest change of a 16x16 area's ink level may "
                                       "stand out above the 20th.")
    max_block_diff: float = Field(default=45.0, ge=0.0, le=255.0, description="Pixel check: "
                                  "the largest 8x8 block difference (re-renders: up to ~36).")
    max_peak_ratio: float = Field(default=2.0, ge=1.0, description="Pixel check: how far the "
                                  "largest block difference (of 8x8 blocks, and of 4x4) may stand "
                                  "out above the 20th.")
    max_spread_diff: float = Field(default=40.0, ge=0.0, le=255.0, description="Pixel check: "
                                   "the 20th largest 8x8 block difference, an absolute bound "
                                   "for changes spread over the page (re-renders: up to ~32).")
    max_colour_diff: float = Field(default=40.0, ge=0.0, le=510.0, description="Pixel check: "
                                   "the largest 8x8 block difference of colour alone (|Cb| + "
                                   "|Cr|; re-renders and JPEG: up to ~23; red against green "
                                   "of the same grey: 182).")


class EngineSettings(_Strict):
    """The job's `engine:` section: vLLM engine settings (None: vLLM's own default)."""

    max_model_len: int | None = Field(default=None, ge=64, description="Longest request "
                                      "(prompt + answer tokens); longer ones are refused "
                                      "('request rejected'); None: the model's own.")
    gpu_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0, description=
                                                 "Share of GPU memory vLLM may take (weights, "
                                                 "KV cache); None: vLLM's default (0.92 in "
                                                 "0.26; on an 80 GB card 0.9 left 16% less "
                                                 "KV cache, docs/benchmarks.md).")
    max_num_seqs: int | None = Field(default=None, ge=1, description="Requests vLLM runs in "
                                     "one step at most; None: vLLM's default.")
    max_num_batched_tokens: int | None = Field(default=None, ge=64, description="Tokens one "
                                               "engine step may hold; None: vLLM's default.")
    dtype: str = Field(default="auto", description="Weights and activations: auto (the model's "
                       "config), bfloat16, float16, float32.")
    quantization: str | None = Field(default=None, description="vLLM's quantization method, "
                                     "e.g. 'fp8' (online); None: what the model's config says.")
    kv_cache_dtype: Literal["fp8", "fp8_e4m3", "fp8_e5m2"] | None = Field(
        default=None, description="The KV cache's dtype: 'fp8' stores keys and values in one "
        "byte, twice the cached tokens in the same memory (more requests decoding at once when "
        "the KV cache is what limits them, e.g. several questions a page on an 80 GB card); "
        "answers are not bit-identical. None: the model's dtype.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one engine spreads "
                                      "the model over.")
    load_format: str = Field(default="auto", description="'dummy': the real architecture with "
                             "random weights (benchmarks).")
    enforce_eager: bool = Field(default=False, description="No CUDA graphs or torch.compile: "
                                "a faster start, slower steps.")
    enable_prefix_caching: bool | None = Field(default=None, description="vLLM's prefix cache "
                                               "(a page's tasks share their image's prefix); "
                                               "None: vLLM's default.")
    seed: int = Field(default=0, description="The engine's sampling seed.")
    max_in_flight: int = Field(default=512, ge=1, description="Pages handed to vLLM at once "
                               "(a page's tasks count once: they share its pixels): enough to "
                               "fill its KV cache, bounded so host memory stays flat.")
    cpu_kv_cache_gib: float = Field(default=2.0, gt=0, description="KV cache of the CPU build.")
    compile_mm_encoder: bool = Field(default=True, description="torch.compile the vision "
                                     "encoder too (no effect with enforce_eager).")
    cudagraph_mm_encoder: bool = Field(default=False, description="CUDA graphs of the vision "
                                       "encoder (GPU only; costs GPU memory, see "
                                       "docs/benchmarks.md).")
    compile_cache_dir: Path | None = Field(default=None, description="vLLM's cache root "
                                           "(compiled graphs); None: ~/.cache/vllm.")
    trust_remote_code: bool = Field(default=False, description="Run the model folder's own "
                                    "Python code (models not built into transformers).")
    warmup_pages: int | None = Field(default=None, ge=0, description="Random-pixel page "
                                     "requests generated (a few tokens each) as part of engine "
                                     "start, so the GPU's first-step kernel compiles happen "
                                     "before the run's pages; None: 16 on a GPU, 0 on the CPU "
                                     "build. Nothing of them is kept.")
    frontend_threads: int = Field(default=4, ge=0, description="Threads that run vLLM's input "
                                  "processing (the HF processor, hashing) for page requests, "
                                  "off the thread that steps the engine; 0: on that thread, as "
                                  "vLLM's LLM does. vLLM's processor cache is off when > 0.")
    frontend_torch_threads: int = Field(default=2, ge=1, description="Torch threads each of "
                                        "those threads uses (OMP_NUM_THREADS for vLLM's "
                                        "input processing).")
    share_image_prefix: bool = Field(default=True, description="A page's later tasks enter "
                                     "vLLM once its first task has begun to decode, so each "
                                     "finds the page's image in vLLM's prefix cache (less "
                                     "prefill, less KV cache); false: a page's tasks enter "
                                     "together, as vLLM's LLM.generate has them. On an H100, "
                                     "W3 ran 1.20x as fast with it (docs/benchmarks.md).")
    max_pages_starting: int = Field(default=64, ge=1, description="With share_image_prefix: "
                                    "pages whose first task is in vLLM and not yet decoding; "
                                    "a next page waits past this many, so a page's later tasks "
                                    "queue behind few others and are scheduled while its first "
                                    "task still holds the image's KV blocks. On an H100 (218,768 "
                                    "KV tokens, 1,280-token pages): 64 fastest; 32 0.93x, 128 "
                                    "0.64x of it (docs/benchmarks.md).")
    pixels_in_model_dtype: bool = Field(default=False, description="The input threads hand "
                                        "the engine a page's float32 pixel values in the model's "
                                        "dtype (bfloat16: half the bytes), the cast Qwen-VL "
                                        "models make first themselves, so answers are the same; "
                                        "no gain measured on an H100 (docs/benchmarks.md), so off.")
    mm_tensor_ipc: Literal["direct_rpc", "torch_shm"] | None = Field(default=None, description="vLLM's transport of image "
                                      "tensors to its engine core (e.g. 'torch_shm'); None: "
                                      "vLLM's default.")


class RaySettings(_Strict):
    """The job's `ray:` section: where and how `executor: ray` runs (README, "Ray")."""

    address: str | None = Field(default=None, description="None: a new local Ray cluster on "
                                "this machine; 'auto': the cluster this machine belongs to; "
                                "'ray://head:10001': a remote cluster's client port.")
    workers: int = Field(default=1, ge=1, description="vLLM actors, each loading the model once.")
    gpus_per_worker: float | None = Field(default=None, ge=0, description="None: the engine's "
                                          "tensor_parallel_size when the cluster has GPUs, else 0.")
    render_workers: int = Field(default=0, ge=0, description="Render actors at most; 0: the "
                                "cluster's CPUs less one.")
    pages_per_batch: int = Field(default=32, ge=1, description="Pages per Ray Data block.")
    batches_per_worker: int = Field(default=16, ge=1, description="Blocks a vLLM actor works on "
                                    "at once, so its engine is never drained between blocks.")


class Job(_Strict):
    name: str = Field(min_length=1, description="The job's name (manifests, logs, metrics).")
    inputs: list[str] = Field(min_length=1, description="Globs of PDFs and images, relative to "
                              "the job file ('**' matches folders at any depth).")
    output: Path = Field(description="The output folder (its tables, manifests and lock), "
                         "relative to the job file.")
    cache: Path = Field(default=Path(".vlbatch-cache"), description="The cache folder "
                        "(answers, rendered pages, the dedupe index), relative to the job file.")
    model: str = Field(min_length=1, description="A model folder (relative to the job file) or "
                       "a Hugging Face model id.")
    tasks: list[Task] = Field(min_length=1, description="The questions asked of every page.")
    render: Render = Field(default=Render(), description="How pages become images.")
    engine: EngineSettings = Field(default=EngineSettings(), description="vLLM's settings.")
    dedupe: Dedupe = Field(default=Dedupe(), description="When two pages count as one.")
    max_error_rate: float = Field(default=1.0, ge=0.0, le=1.0, description="Share of pages "
                                  "that may fail before the run exits 4 (1.0: never).")
    max_attempts: int = Field(default=3, ge=1, description="Tries a row with a transient error "
                              "(engine died, timeout, worker died) gets, over the runs that "
                              "retry it by themselves; --retry-errors goes on past it.")
    part_rows: int = Field(default=1000, ge=1, description="Finished rows are committed to the "
                           "output tables every part_rows rows or part_seconds: the point a "
                           "killed run resumes from.")
    part_seconds: float = Field(default=30.0, gt=0, description="Seconds between commits "
                                "of finished rows at most (see part_rows).")
    verify_every_nights: int | None = Field(default=None, ge=1, description="Hash every "
                                            "input again at least every N runs, a share of "
                                            "them each run (those hashed longest ago): for "
                                            "filesystems whose file times cannot be trusted. "
                                            "Unset: a run hashes only new files and those "
                                            "whose size, mtime, ctime or inode changed "
                                            "(`vlbatch run --verify` hashes all once).")
    result_cache: bool = Field(default=True, description="Answers outlive the run in the cache.")
    feature_cache: bool = Field(default=True, description="Rendered pages outlive the run too: "
                                "a later run skips rendering.")
    cache_size_gib: float = Field(default=20.0, gt=0, description="Per cache (results, "
                                  "features); least recently used entries are evicted.")
    cache_namespace: str = Field(default="default", pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$",
                                 description="Tenants sharing a cache folder share nothing: "
                                 "answers, pages and the dedupe index live in "
                                 "CACHE/<namespace>/.")
    metrics_file: Path | None = Field(default=None, description="Write the run's outcome "
                                      "here in Prometheus text format (node_exporter's "
                                      "textfile collector), atomically; relative to the job "
                                      "file. --metrics-file overrides it.")
    report: bool = Field(default=True, description="Write OUTPUT/_runs/<run_id>.html at the "
                         "end of every run (`vlbatch report` writes it for any run).")
    cost_per_gpu_hour: float | None = Field(default=None, ge=0, description="What one GPU "
                                            "costs an hour (any currency): the summary, "
                                            "manifest and report add the run's cost and its "
                                            "cost per million pages.")
    executor: Literal["local", "ray"] = Field(default="local", description="ray: render and "
                                              "generate on a Ray cluster.")
    ray: RaySettings = Field(default=RaySettings(), description="Where and how executor: ray "
                             "runs.")
    base_dir: Path = Field(default=Path("."), exclude=True)  # the job file's folder

    @field_validator("tasks")
    @classmethod
    def _unique_task_names(cls, tasks: list[Task]) -> list[Task]:
        names = [t.name for t in tasks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"task names must be unique; repeated: {', '.join(dupes)}")
        return tasks

    @property
    def tenant_cache(self) -> Path:
        """This job's part of the cache folder: its namespace's answers and pages."""
        return self.cache / self.cache_namespace

    def missing_model_folder(self) -> str | None:
        """Why `model:` names neither an existing folder nor a Hugging Face id, or None. An
        id is `name` or `org/name`; anything else (a leading . / ~, more slashes) is a path."""
        model = self.model
        hub_like = re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", model) is not None
        if hub_like or (self.base_dir / model).is_dir():
            return None
        return (f"model folder {self.base_dir / model} does not exist (and '{model}' is not a "
                f"Hugging Face id, which looks like org/name)")

    def model_path(self) -> str:
        """The model as vLLM takes it: a local folder (relative to the job file); else a hub
        id's snapshot already in the local Hugging Face cache, so a nightly run on a server
        without network starts at once instead of retrying the hub; else the hub id."""
        local = self.base_dir / self.model
        if local.exists():
            return str(local.resolve())
        return _cached_snapshot(self.model) or self.model

    def gpus(self) -> int:
        """GPUs the job's engines hold: tensor_parallel_size each, one engine locally,
        `ray.workers` on Ray (their `gpus_per_worker`, rounded up, where given)."""
        if self.executor != "ray":
            return self.engine.tensor_parallel_size
        per = self.ray.gpus_per_worker
        per = self.engine.tensor_parallel_size if per is None else per
        return math.ceil(self.ray.workers * per)

    def config_hash(self) -> str:
        dumped = self.model_dump(mode="json", exclude={"base_dir"})
        return hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()[:16]


def job_json_schema() -> dict:
    """The job file's JSON Schema, as written (aliases: `schema`), without internal fields."""
    schema = Job.model_json_schema(by_alias=True, mode="validation")
    schema["properties"].pop("base_dir", None)
    task = schema["$defs"]["Task"]["properties"]
    for name in ("schema", "fields"):  # held as JSON text; written as a mapping (or a path)
        task[name]["anyOf"] = [{"type": "object"}, {"type": "string"}, {"type": "null"}]
    schema["title"] = "vlbatch job file"
    return schema


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
    return f"field '{where}': {error['msg'].removeprefix('Value error, ')}"


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
        job = Job.model_validate({**raw, "base_dir": base}, context={"base_dir": base})
    except ValidationError as e:
        problems = "; ".join(_describe(err) for err in e.errors())
        raise JobFileError(f"{path}: {problems}") from None
    updates: dict = {
        "output": Path(output).resolve() if output else (base / job.output).resolve(),
        "cache": Path(cache).resolve() if cache else (base / job.cache).resolve(),
    }
    if job.metrics_file is not None:
        updates["metrics_file"] = (base / job.metrics_file).resolve()
    if job.engine.compile_cache_dir is not None:
        updates["engine"] = job.engine.model_copy(
            update={"compile_cache_dir": (base / job.engine.compile_cache_dir).resolve()})
    return job.model_copy(update=updates)

