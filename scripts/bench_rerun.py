"""First run vs second run of one job over N generated pages (default 1,000): the second run
writes into a new output folder with the same cache, so every answer comes from the result
cache and every page from the feature cache. Runs `vlbatch run` as a user does.

    python scripts/bench_rerun.py --model models/tiny-qwen3-vl [--pages 1000] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_pages  # noqa: E402


def vlbatch_run(job: Path, output: Path) -> dict:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "vlbatch", "run", str(job), "--output", str(output)],
                            capture_output=True, text=True)
    wall = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(result.stderr[-2000:])
    manifest = json.loads(next((output / "_runs").glob("*.json")).read_text())
    s = manifest["summary"]
    return {"wall_s": round(wall, 1), "run_s": s["seconds"], "generated": s["generated"],
            "cache_hits": s["cache_hits"], "pages_from_feature_cache": s["pages_from_feature_cache"],
            "engine_start_s": s["engine_start_s"], "rows_ok": s["rows_ok"], "timings": s["timings"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--pages", type=int, default=1000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlbatch-rerun"))
    parser.add_argument("--max-pixels", type=int, default=256 * 32 * 32)
    args = parser.parse_args()
    work = args.work.resolve()
    make_pages.main(work / "docs", args.pages, per_pdf=20)
    job = {"name": "rerun", "inputs": [str(work / "docs" / "*.pdf")], "output": str(work / "out1"),
           "cache": str(work / "cache"), "model": str(Path(args.model).resolve()),
           "tasks": [{"name": "read", "prompt": "Read this page.", "max_tokens": 8}],
           "render": {"dpi": 150, "max_pixels": args.max_pixels},
           "engine": {"max_model_len": 4096, "enforce_eager": True}}
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    first = vlbatch_run(work / "job.yaml", work / "out1")
    second = vlbatch_run(work / "job.yaml", work / "out2")
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "pages": args.pages,
              "max_pixels": args.max_pixels, "first": first, "second": second,
              "speed-up": round(first["wall_s"] / second["wall_s"], 1)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
