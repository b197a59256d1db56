"""Shared fixtures: the tiny random Qwen3-VL (built once per session), generated sample
documents, and a helper that writes job files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

# the CPU build of vLLM, in-process, with a small KV cache (see README, "Tests")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SMALL_PIXELS = 128 * 32 * 32  # 128 image tokens at most: quick on 2 cores


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from vlbatch.models.tiny import build_tiny_model

    shared = os.environ.get("VLBATCH_TEST_MODEL_DIR")  # reuse across sessions when set
    return build_tiny_model(Path(shared) if shared else tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def samples(tmp_path) -> Path:
    import make_samples

    out = tmp_path / "samples"
    make_samples.main(out)
    return out


@pytest.fixture
def write_job(tmp_path):
    def write(fields: dict, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(fields, sort_keys=False))
        return path

    return write


def job_fields(model: Path | str, inputs: list[str], **overrides) -> dict:
    fields = {
        "name": "test",
        "inputs": inputs,
        "output": "out",
        "cache": "cache",
        "model": str(model),
        "tasks": [{"name": "describe", "prompt": "Describe this page.", "max_tokens": 8},
                  {"name": "json", "prompt": 'Reply as {"title": ...}. Text: {text_layer}',
                   "max_tokens": 6}],
        "render": {"dpi": 72, "max_pixels": SMALL_PIXELS, "workers": 2},
        "engine": {"max_model_len": 2048, "enforce_eager": True},
    }
    fields.update(overrides)
    return fields


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`vlbatch ...` as a user runs it: a real subprocess (`env`: extra variables)."""
    return subprocess.run([sys.executable, "-m", "vlbatch", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
