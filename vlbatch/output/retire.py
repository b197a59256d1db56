"""retire: the rows no input stands behind any more, deleted by the run that notices.

A row is current only while its (source, page) is one of the pages this night's inputs
have: a file that vanished (or moved: its new path is another source) retires all its
rows, a file now shorter its pages past the new end, a file now unreadable its page rows
(its error rows have page null), a file readable again its page-null error rows. Each
table gets one commit; the rows stay in its history.

Likewise a row is current only while the job asks its task: a task taken out of the job
retires its results rows, and a fields table whose task is gone or no longer has fields
retires its rows (`retire_dropped_tasks`). Put the task back and its answers come back from
the result cache, as a prompt changed and changed back does.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from vlbatch.output.table import commit_properties, open_table, retire

KEY = pa.schema([("source", pa.string()), ("page", pa.int32())])


def stale_pages(tables: Iterable[Path], expected: pa.Table) -> pa.Table:
    """The (source, page) keys some table holds that are not among `expected`."""
    import polars as pl

    want = pl.from_arrow(expected)
    held = []
    for path in tables:
        table = open_table(path, check_files=False)
        if table is None:
            continue
        held.append(pl.scan_delta(str(path)).select("source", "page").unique().collect())
    if not held:
        return KEY.empty_table()
    found = (pl.concat([h.cast({"source": pl.String, "page": pl.Int32}) for h in held]).unique()
             .join(want, on=["source", "page"], how="anti", nulls_equal=True))
    return found.to_arrow().cast(KEY)


def retire_stale(tables: list[Path], run_id: str, pages: pa.Table) -> dict:
    """Retires, in each table in the order given (fields, results, then pages: a reader
    never sees a result row without its page row), the rows of pages not in `pages` (this
    night's inputs: a (source, page) table); {table folder: rows retired}."""
    stale = stale_pages(tables, pages.select(["source", "page"]).cast(KEY))
    retired = {}
    if stale.num_rows == 0:
        return retired
    for path in tables:
        gone = retire(path, run_id, stale, "no input has this page now")
        if gone:
            retired[str(path)] = gone
    return retired


def retire_dropped_tasks(results: Path, fields: Path, run_id: str, tasks: Iterable[str],
                         typed: Iterable[str]) -> dict:
    """Retires the results rows of tasks not in `tasks` (the job's) and every row of a
    fields table (under `fields`) whose task is not in `typed` (the job's schema tasks):
    fields first, so a reader never sees a typed row without its results row; {table
    folder: rows retired}."""
    import polars as pl

    retired = {}
    typed = set(typed)
    for folder in sorted(fields.iterdir()) if fields.is_dir() else []:
        if folder.name in typed or folder.name.startswith("."):
            continue
        table = open_table(folder, check_files=False)
        if table is not None and pl.scan_delta(str(folder)).select(pl.len()).collect().item():
            gone = _deleted(table.delete(commit_properties=commit_properties(
                run_id, "retire", reason="the job has no such schema task now")))
            if gone:
                retired[str(folder)] = gone
    table = open_table(results, check_files=False)
    if table is None:
        return retired
    held = pl.scan_delta(str(results)).select("task").unique().collect()["task"].to_list()
    asked = set(tasks)
    dropped = sorted(t for t in held if t is not None and t not in asked)
    if dropped:  # task names are [A-Za-z0-9_.-] (job.py): safe inside quotes
        predicate = "task IN (" + ", ".join(f"'{t}'" for t in dropped) + ")"
        gone = _deleted(table.delete(predicate, commit_properties=commit_properties(
            run_id, "retire", reason="the job asks no such task now")))
        if gone:
            retired[str(results)] = gone
    return retired


def _deleted(metrics: dict) -> int:
    return int(metrics.get("num_deleted_rows", 0) or 0)
