"""Memory of the two pieces of run state that grow with the corpus, measured alone with
tracemalloc (Python allocations, numpy's included) at N pages:

- the dedupe state: a Deduper that has seen N distinct pages (its in-memory index of this
  run's pages; the feature cache's on-disk index is not in memory);
- the done-key scan: `OutputFolder.history()` over N result rows in parts of 1,000 rows,
  peak during the scan and what the History it returns keeps.

    python scripts/bench_state.py [--pages 10000 100000]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vlbatch.job import Dedupe  # noqa: E402
from vlbatch.pipeline.dedupe import Deduper  # noqa: E402
from vlbatch.pipeline.write import RESULT_SCHEMA, OutputFolder  # noqa: E402


def measure(fn):
    """(result, peak bytes during fn, bytes still held by its result, seconds)."""
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
        deduper = Deduper(Dedupe())
        for _ in range(n):
            deduper.match(f"{rng.getrandbits(256):064x}", f"{rng.getrandbits(256):064x}", image)
        return deduper

    _, peak, held, seconds = measure(fill)
    return {"part": "dedupe state", "pages": n, "seconds": round(seconds, 1),
            "peak_mib": round(peak / 2**20, 1), "held_bytes_per_page": round(held / n)}


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
        history, peak, held, seconds = measure(output.history)
        assert len(history.done) == n
    return {"part": "done-key scan", "pages": n, "seconds": round(seconds, 1),
            "peak_mib": round(peak / 2**20, 1), "held_bytes_per_page": round(held / n)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, nargs="+", default=[10000, 100000])
    args = parser.parse_args()
    for n in args.pages:
        for part in (dedupe_state, done_key_scan):
            print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), **part(n)}), flush=True)


if __name__ == "__main__":
    main()
