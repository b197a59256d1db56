"""The dedupe on an archive of one template: N one-page PDF statements (dedupe_set.statement:
one layout, every number different, none duplicates) plus 2% re-renders of earlier pages
(half the PDF scaled onto a 1.5x larger page box, half PNG rasters of it at 100 dpi), through
the whole pipeline (`run.run_job`, what `vlbatch run` calls) with a stand-in engine that
answers at once. Prints pages/s over each tenth of the run (from the manifest's timeline),
peak RSS of the process tree, and how many re-renders were found (rows reused from their
original's page).

    python scripts/bench_template.py [--pages 20000] [--max-pixels 262144] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import polars as pl
import pymupdf
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dedupe_set  # noqa: E402
from bench_ingest import PeakRss  # noqa: E402
from stand_ins import InstantEngine, WordCount  # noqa: E402

from vlbatch.job import load_job  # noqa: E402
from vlbatch.run import run_job  # noqa: E402


def make_archive(folder: Path, n: int, rerender_share: float = 0.02, seed: int = 0) -> dict[str, str]:
    """The statements and their re-renders; returns re-render name -> original name. A
    re-render of statement j is named after a later statement k, so it comes later in the
    run, at a random distance from its original."""
    made = folder / f"_copies-{n}-{seed}.json"  # an archive made before is reused
    if made.exists():
        return json.loads(made.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = random.Random(seed)
    copies: dict[str, str] = {}
    for k in range(n):
        dedupe_set.statement(k).save(folder / f"doc-{k:06d}.pdf")
        if k > 0 and rng.random() < rerender_share:
            j = rng.randrange(k)
            original = folder / f"doc-{j:06d}.pdf"
            if len(copies) % 2 == 0:
                name = f"doc-{k:06d}-copy.pdf"
                dedupe_set.on_larger_box(pymupdf.open(original)).save(folder / name)
            else:
                name = f"doc-{k:06d}-copy.png"
                with pymupdf.open(original) as doc:
                    doc[0].get_pixmap(dpi=100).save(folder / name)
            copies[name] = original.name
    made.write_text(json.dumps(copies))
    return copies


def tenths(timeline: dict) -> list[float]:
    """Pages/s over each tenth of the pages, from the manifest's timeline."""
    rows = [(t, pages) for t, pages, *_ in timeline["rows"]]
    total = rows[-1][1]
    rates, start = [], (0.0, 0)
    for tenth in range(1, 11):
        end = next((r for r in rows if r[1] >= total * tenth / 10), rows[-1])
        if end[0] > start[0]:
            rates.append(round((end[1] - start[1]) / (end[0] - start[0]), 1))
        start = end
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=20000)
    parser.add_argument("--max-pixels", type=int, default=256 * 32 * 32)
    parser.add_argument("--work", type=Path, default=Path("/tmp/vlbatch-template"))
    parser.add_argument("--near-duplicates", choices=("on", "off"), default="on")
    args = parser.parse_args()
    work = args.work.resolve()
    shutil.rmtree(work / "out", ignore_errors=True)
    shutil.rmtree(work / "cache", ignore_errors=True)
    started = time.monotonic()
    copies = make_archive(work / "docs", args.pages)
    made_s = time.monotonic() - started
    job = {"name": "template", "inputs": ["docs/*.pdf", "docs/*.png"], "output": "out", "cache": "cache",
           "model": "stand-in", "tasks": [{"name": "a", "prompt": "Read this page."}],
           "render": {"dpi": 150, "max_pixels": args.max_pixels},
           "dedupe": {"near_duplicates": args.near_duplicates == "on"}}
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    with PeakRss() as rss:
        started = time.monotonic()
        stats = run_job(load_job(work / "job.yaml"), engine_factory=lambda j, p: InstantEngine(),
                        prompts_factory=lambda j: WordCount())
        seconds = time.monotonic() - started
    manifest = json.loads(next((work / "out" / "_runs").glob("*.json")).read_text())
    rows = pl.read_delta(str(work / "out" / "results"))
    reused = dict(zip(rows["source"].map_elements(lambda s: Path(s).name, return_dtype=pl.String),
                      rows["reused_from"]))
    found = sum(1 for copy, original in copies.items()
                if (reused.get(copy) or "").split("#")[0].endswith(original))
    wrong = sum(1 for name, origin in reused.items()
                if origin and copies.get(name) != Path(origin.split("#")[0]).name)
    rates = tenths(manifest["timeline"])
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M"), "pages": len(rows),
        "statements": args.pages, "rerenders": len(copies), "rerenders_found": found,
        "wrong_merges": wrong, "near_copies": stats.near_copies,
        "pixel_checks": stats.pixel_checks, "comparisons_made": stats.comparisons_made,
        "comparisons_failed": stats.comparisons_failed, "max_pixels": args.max_pixels,
        "near_duplicates": args.near_duplicates, "seconds": round(seconds, 1),
        "pages_per_s": round(len(rows) / seconds, 1), "pages_per_s_by_tenth": rates,
        "last_over_second_tenth": round(rates[-1] / rates[1], 2) if len(rates) > 1 else None,
        "peak_rss_mib": round(rss.peak / 2**20), "archive_made_s": round(made_s, 1)}, indent=1))


if __name__ == "__main__":
    main()
