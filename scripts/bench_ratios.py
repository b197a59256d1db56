"""Ratios between bench_gpu.py results (JSON files written side by side in one session):
vlbatch end to end over raw vLLM: generation windows, and whole processes where recorded.

    python scripts/bench_ratios.py OUT_DIR [OUT_DIR ...]

Warm-up runs (files named warmup-*) are left out: they compile, and are not compared.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(folders: list[Path]) -> None:
    runs = {p.stem: json.loads(p.read_text()) for folder in folders
            for p in sorted(folder.glob("*.json")) if not p.stem.startswith("warmup-")}
    raws = {k: v for k, v in runs.items() if v["mode"].startswith("raw")}
    for name, run in runs.items():
        if run["mode"].startswith("raw"):
            print(f"{name}: {run['pages_per_s']} pages/s, {run['requests_per_s']} requests/s "
                  f"(generation), engine start {run['engine_start_s']} s")
            continue
        print(f"{name}: {run['pages_per_s']} pages/s, {run['requests_per_s']} requests/s "
              f"(generation), whole run {run['wall_s']} s, engine start {run['engine_start_s']} s")
        for raw_name, raw in raws.items():
            print(f"  vs {raw_name}: pages/s {run['pages_per_s'] / raw['pages_per_s']:.3f}x, "
                  f"requests/s {run['requests_per_s'] / raw['requests_per_s']:.3f}x "
                  f"(generation windows; engine start not counted)")
            if "process_s" in run and "process_s" in raw:
                print(f"    whole processes (engine start and raw's in-memory rendering counted): "
                      f"{raw['process_s'] / run['process_s']:.3f}x")


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])
