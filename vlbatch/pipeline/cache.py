"""The result cache: answers that outlive a run, in the job's `cache:` folder (diskcache).

Keyed by the page's pixels (content hash), the model, the prompt as sent and the sampling
settings, within a namespace. Values are JSON bytes, never pickle, so a cache folder can
be shared; an entry that does not decode is dropped, counted and recomputed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from vlbatch.errors import JobCannotRunError
from vlbatch.job import Task


def request_key(namespace: str, content_hash: str, model: str, prompt: str, task: Task) -> str:
    """What makes two requests the same: pixels, model, prompt as sent, sampling settings."""
    parts = [namespace, content_hash, model, prompt, task.fingerprint()]
    return "result:" + hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


class ResultCache:
    def __init__(self, folder: Path, namespace: str = "default", size_limit_gib: float = 20.0):
        import diskcache

        self.namespace = namespace
        self.corrupt = 0
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self._cache = diskcache.Cache(str(Path(folder) / "results"),
                                          size_limit=int(size_limit_gib * 2**30),
                                          eviction_policy="least-recently-used")
        except Exception as e:
            raise JobCannotRunError(f"cache folder {folder} is not usable: {e}") from None

    def get(self, key: str) -> dict | None:
        raw = self._cache.get(key)
        if raw is None:
            return None
        try:
            value = json.loads(raw)
            if not isinstance(value, dict) or not isinstance(value.get("output"), str):
                raise ValueError("not a result entry")
            return value
        except (ValueError, TypeError, UnicodeDecodeError):
            self.corrupt += 1
            self._cache.delete(key)
            return None

    def put(self, key: str, value: dict) -> None:
        self._cache.set(key, json.dumps(value).encode())

    def close(self) -> None:
        self._cache.close()
