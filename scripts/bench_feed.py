"""CPU time vlbatch's own process spends per page: everything but rendering (worker
processes) and the engine (a stand-in that answers at once), and what of it falls on the
thread that feeds the engine. On the GPU that thread also runs vLLM's front end (input
processing), so every millisecond of vlbatch's own on it is one the engine does not get.

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

from stand_ins import InstantEngine, WordCount  # noqa: E402

from vlbatch.job import load_job  # noqa: E402
from vlbatch.engine.loop import EngineLoop  # noqa: E402
from vlbatch.run import run_job  # noqa: E402


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
    job = load_job(work / f"{output}.yaml")
    feed_cpu = []  # the engine thread's CPU seconds, taken as it ends
    run_loop = EngineLoop._run

    def timed_run(loop) -> None:
        run_loop(loop)
        feed_cpu.append(time.thread_time())

    EngineLoop._run = timed_run
    profiler = cProfile.Profile() if profile else None
    cpu, started = self_cpu_s(), time.monotonic()
    if profiler:
        profiler.enable()
    stats = run_job(job, engine_factory=lambda j, p: InstantEngine(),
                    prompts_factory=lambda j: WordCount())
    EngineLoop._run = run_loop
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    seconds, cpu = time.monotonic() - started, self_cpu_s() - cpu
    feed_cpu = sum(feed_cpu)
    pages = stats.rows_ok
    return {"output": output, "pages": pages, "seconds": round(seconds, 2),
            "pages_per_s": round(pages / seconds, 1),
            "main_process_cpu_ms_per_page": round(1000 * cpu / max(pages, 1), 1),
            "feed_thread_cpu_ms_per_page": round(1000 * feed_cpu / max(pages, 1), 1),
            "pages_from_feature_cache": stats.pages_from_feature_cache}


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
