"""CPU time vlbatch's own process spends per page: everything but rendering (worker
processes) and the engine (a stand-in that answers at once). On the GPU this process also
runs vLLM's front end (input processing, detokenising), so every millisecond here is one
the engine's feeder does not get.

W1-like pages (A4 PDFs, 150 dpi capped at 1280*32*32 pixels, one task). Two runs over the
same pages: the first renders them (feature cache filled), the second reads them back from
the feature cache into a fresh output folder (result cache off, so every page is fed).

    python scripts/bench_feed.py [--pages 200] [--profile first|cached]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_memory import InstantEngine, WordCount  # noqa: E402

from vlbatch.job import load_job  # noqa: E402
from vlbatch.runner import JobRun  # noqa: E402


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(work: Path, output: str, profile: bool) -> dict:
    job = {"name": "feed", "inputs": ["docs/*.pdf"], "output": output, "cache": "cache",
           "model": "stand-in", "result_cache": False,
           "tasks": [{"name": "markdown", "prompt": "Convert this page to markdown.",
                      "max_tokens": 256}],
           "render": {"dpi": 150, "max_pixels": 1280 * 32 * 32}}
    (work / f"{output}.yaml").write_text(yaml.safe_dump(job))
    run = JobRun(load_job(work / f"{output}.yaml"), engine_factory=lambda j, p: InstantEngine(),
                 prompts_factory=lambda j: WordCount())
    profiler = cProfile.Profile() if profile else None
    cpu, feed_cpu, started = self_cpu_s(), time.thread_time(), time.monotonic()
    if profiler:
        profiler.enable()
    stats = run.execute()
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    seconds, cpu = time.monotonic() - started, self_cpu_s() - cpu
    feed_cpu = time.thread_time() - feed_cpu  # this thread feeds the engine
    pages = stats.rows_ok
    return {"output": output, "pages": pages, "seconds": round(seconds, 2),
            "pages_per_s": round(pages / seconds, 1),
            "main_process_cpu_ms_per_page": round(1000 * cpu / max(pages, 1), 1),
            "feed_thread_cpu_ms_per_page": round(1000 * feed_cpu / max(pages, 1), 1),
            "feature_cache_hits": stats.feature_cache_hits}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=200)
    parser.add_argument("--profile", choices=["first", "cached"], help="cProfile this run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, str(Path(__file__).parent / "make_pages.py"),
                        str(work / "docs"), str(args.pages), "10"], check=True,
                       capture_output=True)
        for output in ("first", "cached"):
            print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"),
                              **run(work, output, args.profile == output)}), flush=True)


if __name__ == "__main__":
    main()
