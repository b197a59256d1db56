"""`vlbatch inspect OUTPUT`: what an output folder holds, from its tables and run
manifests: runs, the results table's versions with the run that wrote each, the current
rows by task and status, top error reasons, throughput."""

from __future__ import annotations

import json
from pathlib import Path

from vlbatch.errors import JobCannotRunError


def current_rows(root: Path):
    """The results table's current rows (one a page x task), as polars."""
    import polars as pl

    return pl.read_delta(str(Path(root) / "results"))


def versions(path: Path) -> list[dict]:
    """Each version of a table, newest first: when, what, the run that made it, its counts."""
    from vlbatch.output.table import open_table

    table = open_table(path, check_files=False)
    if table is None:
        return []
    found = []
    for commit in table.history():
        metrics = commit.get("operationMetrics") or {}
        found.append({"version": commit.get("version"),
                      "at": commit.get("timestamp"),
                      "operation": commit.get("operation"),
                      "run_id": commit.get("vlbatch.run_id"),
                      "action": commit.get("vlbatch.action"),
                      "rows": commit.get("vlbatch.rows"),
                      "added": metrics.get("num_added_rows", metrics.get("num_target_rows_inserted")),
                      "updated": metrics.get("num_target_rows_updated"),
                      "deleted": metrics.get("num_target_rows_deleted",
                                             metrics.get("num_deleted_rows"))})
    return found


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
                    "versions": [],
                    "by_task": [], "top_errors": [], "fields": _fields_tables(root)}
    from vlbatch.output.table import is_table, open_table

    if not is_table(root / "results"):
        return report
    open_table(root / "results")  # a damaged table: said, exit 3
    report["versions"] = versions(root / "results")
    report["rows_written"] = sum(int(v["rows"] or 0) for v in report["versions"]
                                 if v["action"] in ("write", "merge", "migrate"))
    current = current_rows(root)
    report["current"] = {"rows": current.height,
                         "ok": current.filter(pl.col("status") == "ok").height,
                         "error": current.filter(pl.col("status") == "error").height,
                         # the next run retries these by itself (failures.py)
                         "transient": current.filter(pl.col("error_kind") == "transient").height,
                         "sources": current["source"].n_unique(),
                         "pages": current.select("source", "page").unique().height,
                         "version": report["versions"][0]["version"] if report["versions"] else None}
    report["by_task"] = (current.group_by("task", "status", "error_kind").len("rows")
                         .sort("task", "status", "error_kind", nulls_last=True).to_dicts())
    report["top_errors"] = (current.filter(pl.col("status") == "error")
                            .group_by("error", "error_kind").len()
                            .sort("len", descending=True).head(10)
                            .rename({"len": "rows"}).to_dicts())
    return report


def _fields_tables(root: Path) -> list[dict]:
    """Each schema task's fields table: its current rows and typed columns."""
    import pyarrow as pa

    from vlbatch.answer_schema import KEY_COLUMNS
    from vlbatch.output.table import open_table

    tables = []
    for folder in sorted((root / "fields").glob("*")):
        table = open_table(folder) if folder.is_dir() else None
        if table is None:
            continue
        schema = pa.schema(table.schema().to_arrow())
        tables.append({"task": folder.name, "rows": table.to_pyarrow_dataset().count_rows(),
                       "columns": {f.name: str(f.type) for f in schema
                                   if f.name not in KEY_COLUMNS}})
    return tables
