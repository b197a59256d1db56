"""What the model behind a job is, for the result cache's keys.

Two jobs share an answer only when the same weights, tokenizer, chat template and processor
would produce it with the same numerics. The model string as written says neither where a
relative folder points nor which revision a hub id is, and `load_format: dummy` (random
weights) or another dtype changes every answer under the same name. So the key holds:

- a local folder: the contents of every file in it but the weights (config,
  generation config, weight index, tokenizer, chat template, processor configs), and each
  weight file's name, size and modification time (hashing gigabytes at every start is too
  slow; a copied folder costs one regeneration, never a wrong answer);
- a hub id: the id (a revision pushed upstream under the same id is not noticed: point
  `model:` at a local folder to have its files checked);
- the engine settings that change numerics: load_format, dtype, quantization, kv_cache_dtype;
  and the pixel budget the processor is given.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from vlbatch.job import Job

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")


def model_identity(job: Job) -> str:
    """A hex digest naming the model and the settings that change its answers."""
    e, r = job.engine, job.render
    local = job.base_dir / job.model
    # a hub id stays its id (its snapshot appears only once vLLM has downloaded it: keying
    # by the snapshot would make the second night regenerate everything the first did)
    files = folder_digest(str(local.resolve()), _signature(local)) if local.is_dir() \
        else f"hub:{job.model}"
    parts = [files, f"load_format={e.load_format}", f"dtype={e.dtype}",
             f"quantization={e.quantization}", f"pixels={r.min_pixels}-{r.max_pixels}"]
    if e.kv_cache_dtype is not None:  # unset: the keys answers already have stay as they were
        parts.append(f"kv_cache_dtype={e.kv_cache_dtype}")
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def _signature(folder: str) -> tuple:
    """Names, sizes and modification times: a changed file gives a new cache entry below."""
    found = []
    for entry in sorted(Path(folder).rglob("*")):
        if entry.is_file():
            stat = entry.stat()
            found.append((str(entry.relative_to(folder)), stat.st_size, stat.st_mtime_ns))
    return tuple(found)


@lru_cache(maxsize=16)
def folder_digest(folder: str, signature: tuple) -> str:
    """Every file's content but the weights', whose name, size and time stand in for it."""
    digest = hashlib.sha256()
    for name, size, mtime_ns in signature:
        digest.update(f"{name}\x1f{size}\x1f".encode())
        if name.lower().endswith(WEIGHT_SUFFIXES):
            digest.update(f"{mtime_ns}\x1e".encode())
            continue
        with open(Path(folder) / name, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return "files:" + digest.hexdigest()


def task_hashes(job: Job) -> dict[str, str]:
    """Per task: what makes a row current across runs besides its page (done keys, the
    `task_hash` column): the prompt and sampling, the model's identity and the render
    settings. Change any of them and the next run regenerates the row."""
    r = job.render
    settings = "\x1f".join([model_identity(job), f"dpi={r.dpi}",
                            f"pixels={r.min_pixels}-{r.max_pixels}"])
    return {t.name: hashlib.sha256(f"{t.fingerprint()}\x1f{settings}".encode()).hexdigest()[:16]
            for t in job.tasks}
