"""retire: the rows no input stands behind any more, deleted by the run that notices.

A row is current only while its (source, page) is one of the pages this night's inputs
have: a file that vanished (or moved: its new path is another source) retires all its
rows, a file now shorter its pages past the new end, a file now unreadable its page rows
(its error rows have page null), a file readable again its page-null error rows. Each
table gets one commit; the rows stay in its history.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from vlbatch.output.table import open_table, retire

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
