"""table: one table of the output folder, a Delta Lake table (delta-rs) that holds exactly
the current row per key.

Each flush is one commit: rows of keys the table may hold already replace them, keys given
up are deleted (a schema task's answer that now fails), new keys are added, all in one
merge; a flush of keys the table cannot hold yet is a plain append, which reads nothing of
the table. The commit's metadata names the run and its counts (`vlbatch inspect` lists them).

A run killed at any point leaves the last committed version whole: delta-rs writes the data
files first and commits by creating the next log entry; data files no commit names are
never read, and `vlbatch compact` vacuums them. Every earlier row stays in the table's
history (`DeltaTable(path, version=N)`, `pl.scan_delta(path, version=N)`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import unquote, urlparse

import pyarrow as pa

from vlbatch.errors import JobCannotRunError

log = logging.getLogger("vlbatch")
OP = "_vlbatch_op"  # a merge source's column: 'upsert' or 'delete'


class TableDamaged(JobCannotRunError):
    """A table whose log or data files cannot be read: nothing is written to it."""


def is_table(path: Path) -> bool:
    return (Path(path) / "_delta_log").is_dir()


def _local(uri: str) -> str:
    return unquote(urlparse(uri).path) if uri.startswith("file:") else uri


def open_table(path: Path, check_files: bool = True):
    """The table's DeltaTable at its newest version; None where there is no table yet.
    Raises TableDamaged (exit 3) for a log that does not read or data files it names that
    are gone, before anything is written."""
    from deltalake import DeltaTable

    path = Path(path)
    if not is_table(path):
        return None
    try:
        table = DeltaTable(str(path))
        files = table.file_uris() if check_files else []
    except Exception as e:  # noqa: BLE001 - delta-rs raises several kinds; each is damage here
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TableDamaged(f"the output table {path} cannot be read ({reason}); it was left as "
                           f"it is: restore it from a backup or move it away") from None
    missing = [f for f in files if not os.path.exists(_local(f))]
    if missing:
        raise TableDamaged(f"the output table {path} is damaged: {len(missing)} data file(s) "
                           f"its log names are gone (e.g. {os.path.basename(_local(missing[0]))}); "
                           f"it was left as it is: restore it from a backup or move it away")
    return table


def commit_properties(run_id: str, action: str, **counts: int):
    from deltalake import CommitProperties

    metadata = {"vlbatch.run_id": run_id, "vlbatch.action": action}
    metadata.update({f"vlbatch.{name}": str(value) for name, value in counts.items()})
    return CommitProperties(custom_metadata=metadata)


def key_predicate(key: Iterable[str]) -> str:
    """Rows of the same key (nulls equal: a file's error row has page null)."""
    return " AND ".join(f"(t.{c} IS NOT DISTINCT FROM s.{c})" for c in key)


def last_per_key(table: pa.Table, key: tuple[str, ...]) -> pa.Table:
    """One row a key, the last given (a merge refuses two source rows for one target row)."""
    import polars as pl

    frame = pl.from_arrow(table).with_row_index("_row")
    kept = frame.unique(subset=list(key), keep="last", maintain_order=True).drop("_row")
    return kept.to_arrow().cast(table.schema)


class TableWriter:
    """Buffers a run's rows for one table and commits them every `max_rows` rows or
    `max_seconds`. `known(row)`: whether the table may already hold the row's key (then the
    flush is a merge); None: always merge."""

    def __init__(self, path: Path, run_id: str, schema: pa.Schema, key: tuple[str, ...],
                 max_rows: int = 1000, max_seconds: float = 30.0, before_flush=None,
                 known: Callable[[dict], bool] | None = None):
        self.path, self.run_id, self.schema, self.key = Path(path), run_id, schema, key
        self.before_flush = before_flush  # called first at every flush (another writer's)
        self.max_rows, self.max_seconds = max_rows, max_seconds
        self.known = known
        self.rows: list[dict] = []
        self.deletes: list[dict] = []  # keys whose row goes (no row replaces it)
        self.merge_needed = False
        self.commits = 0
        self.table = None  # the DeltaTable, once opened
        self.last_flush = time.monotonic()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.merge_needed = self.merge_needed or self.known is None or self.known(row)
        self._maybe_flush()

    def remove(self, key_values: dict) -> None:
        """The key's row goes at the next flush (if the table holds one)."""
        self.deletes.append({c: key_values[c] for c in self.key})
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if (len(self.rows) + len(self.deletes) >= self.max_rows
                or time.monotonic() - self.last_flush >= self.max_seconds):
            self.flush()

    def flush(self) -> None:
        """One commit with the rows and deletions so far, durable once this returns."""
        if self.before_flush is not None:
            self.before_flush()
        self.last_flush = time.monotonic()
        if not self.rows and not self.deletes:
            return
        rows = pa.Table.from_pylist(self.rows, schema=self.schema)
        table = self._table()
        if table is None or (not self.merge_needed and not self.deletes):
            self._append(rows)
        else:
            self._merge(table, rows)
        self.commits += 1
        self.rows, self.deletes, self.merge_needed = [], [], False

    def _table(self):
        """The table at its newest version (None before its first commit); the first time,
        a table of other columns is replaced (`_replace_schema`)."""
        if self.table is not None:
            self.table.update_incremental()
            return self.table
        table = open_table(self.path, check_files=False)
        if table is not None and not _same_columns(table, self.schema):
            self._replace_schema()
            table = None
        self.table = table
        return table

    def _append(self, rows: pa.Table) -> None:
        from deltalake import write_deltalake

        write_deltalake(str(self.path), rows, mode="append", schema_mode="merge",
                        commit_properties=commit_properties(self.run_id, "write",
                                                            rows=rows.num_rows))
        if self.table is None:
            self.table = open_table(self.path, check_files=False)

    def _merge(self, table, rows: pa.Table) -> None:
        marked = rows.append_column(OP, pa.array(["upsert"] * rows.num_rows, pa.string()))
        if self.deletes:
            gone = pa.Table.from_pylist(self.deletes, schema=pa.schema(
                [self.schema.field(c) for c in self.key]))
            gone = gone.append_column(OP, pa.array(["delete"] * gone.num_rows, pa.string()))
            marked = pa.concat_tables([marked, gone], promote_options="default")
        marked = last_per_key(marked, self.key)
        columns = {c: f"s.{c}" for c in self.schema.names}
        (table.merge(marked, key_predicate(self.key), source_alias="s", target_alias="t",
                     merge_schema=True,
                     commit_properties=commit_properties(self.run_id, "merge",
                                                         rows=rows.num_rows,
                                                         deletes=len(self.deletes)))
         .when_matched_delete(predicate=f"s.{OP} = 'delete'")
         .when_matched_update(updates=columns, predicate=f"s.{OP} = 'upsert'")
         .when_not_matched_insert(updates=columns, predicate=f"s.{OP} = 'upsert'")
         .execute())

    def _replace_schema(self) -> None:
        """A table whose columns are not this writer's (a schema task's fields changed):
        its rows are of another task definition, so none is current; a new version without
        them (the old ones stay in its history)."""
        from deltalake import write_deltalake

        log.info("%s: its columns changed; the rows of the earlier columns are retired", self.path)
        write_deltalake(str(self.path), self.schema.empty_table(), mode="overwrite",
                        schema_mode="overwrite",
                        commit_properties=commit_properties(self.run_id, "new columns"))
        self.merge_needed = False
        self.deletes = []


def _same_columns(table, schema: pa.Schema) -> bool:
    """The table's columns are the schema's, or a subset an append can merge into (a table
    written before a column existed)."""
    have = {f.name: f.type for f in pa.schema(table.schema().to_arrow())}
    for field in schema:
        if field.name in have and not _compatible(have[field.name], field.type):
            return False
    return all(name in schema.names for name in have)


def _compatible(have: pa.DataType, want: pa.DataType) -> bool:
    if have == want:
        return True
    # delta stores strings as large strings and timestamps in microseconds
    if pa.types.is_string(want) or pa.types.is_large_string(want):
        return pa.types.is_string(have) or pa.types.is_large_string(have) or pa.types.is_string_view(have)
    if pa.types.is_timestamp(want):
        return pa.types.is_timestamp(have)
    if pa.types.is_list(want) or pa.types.is_large_list(want):
        return pa.types.is_list(have) or pa.types.is_large_list(have) or pa.types.is_list_view(have)
    return False


def retire(path: Path, run_id: str, keys: pa.Table, reason: str) -> int:
    """Deletes the rows whose (source, page) is in `keys` (page null: the file's own error
    row), one commit; how many went."""
    table = open_table(path, check_files=False)
    if table is None or keys.num_rows == 0:
        return 0
    metrics = (table.merge(keys, key_predicate(keys.column_names), source_alias="s",
                           target_alias="t",
                           commit_properties=commit_properties(run_id, "retire", keys=keys.num_rows,
                                                               reason=reason))
               .when_matched_delete().execute())
    return int(metrics.get("num_target_rows_deleted", 0))


def files_of_run(path: Path, run_id: str) -> list[Path] | None:
    """The data files of the table's current version that commits of `run_id` added: where
    the run's current rows are, when its commits are the newest (a run's report, written
    as it ends). Read from the newest log entries back to the run's first commit, so it
    costs what the run wrote, not the table. None where the log cannot say (a later run or
    a compaction committed after it, or the entries are gone): scan the table instead."""
    import json
    from datetime import datetime, timezone

    table = open_table(path, check_files=False)
    if table is None:
        return []
    try:
        started = datetime.strptime(run_id[:16], "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    started_ms = started.timestamp() * 1000 - 1000
    root = os.path.abspath(path)
    current = {os.path.relpath(_local(f), root) for f in table.file_uris()}
    added: set[str] = set()
    seen_ours = False
    for version in range(table.version(), -1, -1):
        entry = Path(path) / "_delta_log" / f"{version:020d}.json"
        try:
            lines = entry.read_text().splitlines()
        except OSError:
            return None
        actions = [json.loads(line) for line in lines if line.strip()]
        commit = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        if commit.get("vlbatch.run_id") == run_id:
            seen_ours = True
            added.update(unquote(a["add"]["path"]) for a in actions if "add" in a)
        elif commit.get("timestamp", 0) < started_ms:
            break
        elif not seen_ours:
            return None  # committed after the run: its rows may have moved
    return [Path(path) / f for f in sorted(added & current)]
