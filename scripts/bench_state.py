"""Memory of the two pieces of run state that grow with the corpus, measured alone with
tracemalloc (Python allocations, numpy's included) and the process's resident memory
(SQLite's and other C allocations too), each part at each N in a fresh process:

- the dedupe state: a Deduper that has seen N distinct pages (this run's index: the newest
  pages in memory, older ones spilled to SQLite; the feature cache's index is on disk);
- the done-key scan: `OutputFolder.current_results()` over N result rows in parts of 1,000
  rows, peak during the scan and what the frame it returns keeps.

    python scripts/bench_state.py [--pages 10000 100000]
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import random
import sys
import tempfile
import time
from types import SimpleNamespace
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vlbatch.job import Dedupe  # noqa: E402
from vlbatch.pipeline.dedupe import Deduper  # noqa: E402
from vlbatch.output.folder import OutputFolder  # noqa: E402
from vlbatch.output.schemas import RESULT_SCHEMA  # noqa: E402


TRACED = True


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure(fn):
    """(result, peak bytes during fn, bytes still held by its result, seconds); without
    tracemalloc (TRACED false: its own bookkeeping would swell the resident memory) the
    first two are 0 and the resident memory is the measure."""
    gc.collect()
    measure.rss_before = _rss_kib("VmRSS")
    if not TRACED:
        started = time.monotonic()
        return fn(), 0, 0, time.monotonic() - started
    tracemalloc.start()
    started = time.monotonic()
    result = fn()
    seconds = time.monotonic() - started
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, peak, held, seconds


def dedupe_state(n: int) -> dict:
    rng = random.Random(0)
    image = Image.new("RGB", (8, 8))

    def fill():
        deduper = Deduper(Dedupe(), keep_in_memory=1)
        for _ in range(n):
            deduper.match(SimpleNamespace(
                content_hash=f"{rng.getrandbits(256):064x}", phash=f"{rng.getrandbits(256):064x}",
                text_layer=None, drawings=None, thumb=rng.randbytes(4096),
                comparison=lambda: image))
        return deduper

    _, peak, held, seconds = measure(fill)
    return {"part": "dedupe state", "pages": n, "seconds": round(seconds, 1),
            "peak_mib": round(peak / 2**20, 1), "held_bytes_per_page": round(held / n),
            **_rss_growth()}


def _rss_growth() -> dict:
    """Peak resident memory over the process's before the part ran (MiB), untraced only."""
    if TRACED:
        return {}
    return {"rss_growth_mib": round((_rss_kib("VmHWM") - measure.rss_before) / 1024, 1)}


def _in_child(part, n: int, traced: bool) -> dict:
    global TRACED
    TRACED = traced
    figures = part(n)
    if not traced:  # only the resident memory and the time mean anything here
        figures = {k: figures[k] for k in ("part", "pages", "seconds", "rss_growth_mib")}
        figures["seconds_untraced"] = figures.pop("seconds")
    return figures


def results_rows(n: int, folder: Path) -> None:
    """n result rows (one task a page), 1,000 a part, as a run writes them."""
    now = datetime.now(timezone.utc)
    for start in range(0, n, 1000):
        rows = [{"source": f"/srv/incoming/2026/12/scan-{i // 4:07d}.pdf", "page": i % 4 + 1,
                 "task": "markdown", "output": "x" * 200, "status": "ok",
                 "source_sha256": f"{i // 4:064x}", "task_hash": "a" * 16,
                 "finished_at": now, "attempt": 1, "run_id": "r"}
                for i in range(start, min(n, start + 1000))]
        pq.write_table(pa.Table.from_pylist(rows, schema=RESULT_SCHEMA),
                       folder / f"part-r-{start // 1000:05d}.parquet")


def done_key_scan(n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        output = OutputFolder(Path(tmp))
        results_rows(n, output.results)
        history, peak, held, seconds = measure(output.current_results)
        assert history.height == n
    return {"part": "done-key scan", "pages": n, "seconds": round(seconds, 1),
            "peak_mib": round(peak / 2**20, 1), "held_bytes_per_page": round(held / n),
            **_rss_growth()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, nargs="+", default=[10000, 100000])
    args = parser.parse_args()
    spawn = multiprocessing.get_context("spawn")
    for n in args.pages:
        for part in (dedupe_state, done_key_scan):
            figures = {}
            for traced in (True, False):
                with spawn.Pool(1) as pool:  # a fresh process: its peak RSS is this part's
                    figures.update(pool.apply(_in_child, (part, n, traced)))
            print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), **figures}), flush=True)


if __name__ == "__main__":
    main()
