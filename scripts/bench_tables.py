"""What a flush costs as the results table grows: the table holds N current rows (10,000 and
100,000 by default, written as a few large files, as after `vlbatch compact`, then also as
after a night of 1,000-row flushes), and each measure is the median of REPEAT flushes of
`--rows` rows through vlbatch's own TableWriter:

    append      new keys only (a plain append: nothing of the table is read)
    merge-all   every row replaces a current one (a night that regenerates)
    merge-few   1% of the rows replace current ones, the rest are new
    retire      100 (source, page) keys retired (one merge that deletes)
    history     the run's start: the key and identity columns of the current rows

    python scripts/bench_tables.py [--sizes 10000 100000] [--rows 1000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vlbatch.output.folder import OutputFolder  # noqa: E402
from vlbatch.output.schemas import RESULT_KEY, RESULT_SCHEMA  # noqa: E402
from vlbatch.output.table import TableWriter, retire  # noqa: E402

TASKS = ("describe", "json", "flags", "text")


def rows(start: int, n: int, run: str) -> list[dict]:
    now = datetime.now(timezone.utc)
    out = []
    for i in range(start, start + n):
        doc, rest = divmod(i, 40)
        page, task = divmod(rest, 4)
        out.append(dict(source=f"/archive/2026/doc-{doc:07d}.pdf", page=page + 1, task=TASKS[task],
                        output=f"answer {i} of run {run} " + "x" * 200, status="ok",
                        content_hash=f"{i:064x}", phash=f"{i:016x}", cached=False, model="m",
                        run_id=run, source_sha256=f"{doc:064x}", task_hash="t" * 16,
                        prompt_tokens=1276, output_tokens=64, finished_at=now, attempt=1,
                        matched_path=f"2026/doc-{doc:07d}.pdf", finish_reason="stop"))
    return out


def writer(path: Path, run: str, rows_per_flush: int, known) -> TableWriter:
    return TableWriter(path, run, RESULT_SCHEMA, RESULT_KEY, max_rows=10**9, max_seconds=1e9,
                       known=known)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def fill(path: Path, size: int, flush_rows: int | None) -> None:
    """A table of `size` rows: in 50,000-row commits, or in `flush_rows`-row flushes."""
    step = flush_rows or 50_000
    for start in range(0, size, step):
        w = writer(path, "fill", step, lambda row: False)
        for row in rows(start, min(step, size - start), "fill"):
            w.add(row)
        w.flush()


def measure(size: int, flush: int, repeat: int, layout: str) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = OutputFolder(Path(tmp) / "out")
        path = out.results
        fill(path, size, flush if layout == "flushes" else None)
        next_new = size
        samples: dict[str, list[float]] = {k: [] for k in ("append", "merge-all", "merge-few",
                                                            "retire", "history")}
        for r in range(repeat):
            w = writer(path, f"a{r}", flush, lambda row: False)
            for row in rows(next_new, flush, f"a{r}"):
                w.add(row)
            next_new += flush
            samples["append"].append(timed(w.flush))

            w = writer(path, f"m{r}", flush, lambda row: True)
            start = (r * flush) % (size - flush)
            for row in rows(start, flush, f"m{r}"):
                w.add(row)
            samples["merge-all"].append(timed(w.flush))

            w = writer(path, f"f{r}", flush, lambda row: True)
            few = flush // 100
            for row in rows((r * 7919) % (size - few), few, f"f{r}") + rows(next_new, flush - few, f"f{r}"):
                w.add(row)
            next_new += flush - few
            samples["merge-few"].append(timed(w.flush))

            keys = pa.Table.from_pylist(
                [{"source": f"/archive/2026/doc-{d:07d}.pdf", "page": p}
                 for d in range(r * 10, r * 10 + 10) for p in range(1, 11)],
                schema=pa.schema([("source", pa.string()), ("page", pa.int32())]))
            samples["retire"].append(timed(lambda: retire(path, f"r{r}", keys, "bench")))
            samples["history"].append(timed(lambda: out.current_results()))
        for name, values in samples.items():
            results[name] = round(statistics.median(values) * 1000, 1)
        results["files"] = len(list(path.glob("*.parquet")))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--rows", type=int, default=1000, help="rows a flush")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"{'table rows':>10} {'layout':>9} {'append':>8} {'merge-all':>10} {'merge-few':>10} "
          f"{'retire':>8} {'history':>8}  (ms, median of {args.repeat}; {args.rows}-row flushes)")
    for size in args.sizes:
        for layout in ("compacted", "flushes"):
            m = measure(size, args.rows, args.repeat, layout)
            print(f"{size:>10,} {layout:>9} {m['append']:>8} {m['merge-all']:>10} "
                  f"{m['merge-few']:>10} {m['retire']:>8} {m['history']:>8}", flush=True)


if __name__ == "__main__":
    main()
