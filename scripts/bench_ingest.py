"""Ingest benchmark: pages/s and peak RSS (this process + its workers) of probing and
rendering generated A4 PDFs at 150 dpi, capped at max_pixels, with 1, 2 and N workers.
No GPU needed.

    python scripts/bench_ingest.py [--small 300] [--large 5000] [--workers N] [--dpi 150]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import make_pages  # noqa: E402

from vlbatch.pipeline import ingest  # noqa: E402
from vlbatch.pipeline.workers import WorkerPool, default_workers  # noqa: E402


def tree_rss_bytes(root: int) -> int:
    """RSS of `root` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


class PeakRss:
    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self):
        def sample():
            while not self._stop.wait(0.1):
                self.peak = max(self.peak, tree_rss_bytes(os.getpid()))
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run(paths: list[Path], workers: int, dpi: int, max_pixels: int, limit_pages: int) -> dict:
    min_pixels = 64 * 32 * 32
    with PeakRss() as rss, WorkerPool(workers, timeout_s=120) as pool:
        started = time.monotonic()
        probes = [r for _, r in pool.imap(ingest.probe, paths, lambda p: (str(p), dpi, None))]
        units = [(str(p), pr.kind, s.page) for p, pr in zip(paths, probes) for s in pr.pages][:limit_pages]
        rendered = errors = 0
        for _, page in pool.imap(ingest.render_page, units,
                                 lambda u: (u[0], u[1], u[2], dpi, min_pixels, max_pixels, None)):
            if isinstance(page, Exception):
                errors += 1
            else:
                rendered += 1
        seconds = time.monotonic() - started
    return {"workers": workers, "pages": rendered, "errors": errors, "seconds": round(seconds, 2),
            "pages_per_s": round(rendered / seconds, 1), "peak_rss_mib": round(rss.peak / 2**20)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", type=int, default=300)
    parser.add_argument("--large", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--dpi", type=int, default=150)
    parser.add_argument("--max-pixels", type=int, default=1280 * 32 * 32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    n = default_workers(args.workers)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.monotonic()
        paths = make_pages.main(Path(tmp), args.large, per_pdf=10)
        print(f"generated {args.large} pages in {time.monotonic() - t:.1f} s", flush=True)
        results = []
        for workers, pages in [(1, args.small), (2, args.small), (n, args.small), (n, args.large)]:
            result = run(paths, workers, args.dpi, args.max_pixels, pages)
            print(json.dumps(result), flush=True)
            results.append(result)
    report = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "dpi": args.dpi,
              "max_pixels": args.max_pixels, "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
