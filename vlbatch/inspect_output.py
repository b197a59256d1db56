"""`vlbatch inspect OUTPUT`: what an output folder holds, from its Parquet parts and run
manifests: runs, the current rows by task and status, top error reasons, throughput."""

from __future__ import annotations

import json
from pathlib import Path

from vlbatch.errors import JobCannotRunError


def scan_results(results_glob: str):
    """The results parts as one polars LazyFrame, in the current schema: parts written
    before a column existed (`attempt`, `error_kind`) read it as null."""
    import polars as pl

    from vlbatch.pipeline.write import RESULT_SCHEMA

    schema = pl.from_arrow(RESULT_SCHEMA.empty_table()).schema
    return pl.scan_parquet(results_glob, schema=schema, missing_columns="insert")


def current_rows(results_glob: str):
    """The current answer for every page x task: its newest row (the README's query)."""
    return (scan_results(results_glob).sort("finished_at")
            .group_by("source", "page", "task").last().collect())


def inspect_output(root: Path) -> dict:
    import polars as pl

    root = Path(root)
    if not (root / "results").is_dir() and not (root / "_runs").is_dir():
        raise JobCannotRunError(f"{root} is not a vlbatch output folder (no results/ or _runs/)")
    runs = []
    for path in sorted((root / "_runs").glob("*.json")):
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            runs.append({"run_id": path.stem, "status": f"unreadable manifest: {e}"})
            continue
        s = manifest.get("summary", {})
        runs.append({"run_id": manifest.get("run_id"), "status": manifest.get("status"),
                     "finished_at": manifest.get("finished_at"), "pages": s.get("pages_finished"),
                     "generated": s.get("generated"), "cache_hits": s.get("cache_hits"),
                     "copied": s.get("copied"), "rows_ok": s.get("rows_ok"),
                     "rows_error": s.get("rows_error"),
                     "rows_transient": s.get("rows_transient"), "seconds": s.get("seconds"),
                     "pages_per_s": s.get("pages_per_s")})
    report: dict = {"output": str(root), "runs": runs, "rows_written": 0, "current": {},
                    "by_task": [], "top_errors": [], "fields": _fields_tables(root)}
    if not list((root / "results").glob("part-*.parquet")):
        return report
    glob = str(root / "results" / "part-*.parquet")
    report["rows_written"] = scan_results(glob).select(pl.len()).collect().item()
    current = current_rows(glob)
    report["current"] = {"rows": current.height,
                         "ok": current.filter(pl.col("status") == "ok").height,
                         "error": current.filter(pl.col("status") == "error").height,
                         # the next run retries these by itself (failures.py)
                         "transient": current.filter(pl.col("error_kind") == "transient").height,
                         "sources": current["source"].n_unique(),
                         "pages": current.select("source", "page").unique().height}
    report["by_task"] = (current.group_by("task", "status", "error_kind").len("rows")
                         .sort("task", "status", "error_kind", nulls_last=True).to_dicts())
    report["top_errors"] = (current.filter(pl.col("status") == "error")
                            .group_by("error", "error_kind").len()
                            .sort("len", descending=True).head(10)
                            .rename({"len": "rows"}).to_dicts())
    return report


def _fields_tables(root: Path) -> list[dict]:
    """Each schema task's fields table: rows written and its typed columns."""
    import pyarrow.parquet as pq

    from vlbatch.answer_schema import KEY_COLUMNS

    tables = []
    for folder in sorted((root / "fields").glob("*")):
        parts = sorted(folder.glob("part-*.parquet"))
        if not parts:
            continue
        schema = pq.read_schema(parts[-1])
        tables.append({"task": folder.name, "rows": sum(pq.ParquetFile(p).metadata.num_rows
                                                        for p in parts),
                       "columns": {f.name: str(f.type) for f in schema
                                   if f.name not in KEY_COLUMNS}})
    return tables
