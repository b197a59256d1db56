"""Host memory of a whole run as the number of pages grows: the real pipeline (discover,
probe, plan, render in workers, dedupe, caches, Parquet) with a stand-in engine that answers
at once, over N small distinct generated images. Peak RSS of the process and its workers.

    python scripts/bench_memory.py [--pages 2000 10000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_ingest import PeakRss  # noqa: E402

from stand_ins import InstantEngine, WordCount  # noqa: E402
from vlbatch.job import load_job  # noqa: E402
from vlbatch.run import run_job  # noqa: E402


def make_images(folder: Path, n: int) -> None:
    folder.mkdir(parents=True)
    rng = np.random.RandomState(0)
    for i in range(n):
        pixels = rng.randint(0, 255, (280, 200, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"page-{i:06d}.png", compress_level=1)


def run(n: int, work: Path) -> dict:
    make_images(work / "docs", n)
    job = {"name": "memory", "inputs": ["docs/*.png"], "output": "out", "cache": "cache",
           "model": "stand-in", "tasks": [{"name": "a", "prompt": "Read this page."}],
           "render": {"max_pixels": 256 * 32 * 32}}
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    def once():
        with PeakRss() as rss:
            started = time.monotonic()
            stats = run_job(load_job(work / "job.yaml"),
                            engine_factory=lambda j, p: InstantEngine(),
                            prompts_factory=lambda j: WordCount())
            return stats, time.monotonic() - started, rss

    stats, seconds, rss = once()
    again, again_seconds, again_rss = once()  # all done: the done-key scan of n rows
    return {"pages": n, "rows_ok": stats.rows_ok, "seconds": round(seconds, 1),
            "pages_per_s": round(n / seconds, 1), "peak_rss_mib": round(rss.peak / 2**20),
            "rerun_pages_todo": again.pages_todo, "rerun_seconds": round(again_seconds, 1),
            "rerun_peak_rss_mib": round(again_rss.peak / 2**20)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, nargs="+", default=[2000, 10000])
    args = parser.parse_args()
    for n in args.pages:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), **run(n, Path(tmp))}),
                  flush=True)


if __name__ == "__main__":
    main()
