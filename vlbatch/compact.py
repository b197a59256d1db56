"""`vlbatch compact OUTPUT`: the many small parts nightly runs leave (one every part_seconds)
merged into a few large ones, for results, pages and each fields/<task>.

Under the output's lock (no run writes meanwhile). Each table's parts are streamed, one
part in memory at a time, into a new folder beside the live one (`.results.compact-*`:
readers skip names starting with a dot), synced, and then the two folders are exchanged in
one step (Linux renameat2 RENAME_EXCHANGE): a reader listing `results/*.parquet` sees the
old parts or the new ones, never both or neither. The old parts are deleted after. Every
row is kept, or with `--current` only each key's current row (the newest: results and
fields by source, page, task and `finished_at`; pages by source, page and the order runs
wrote them), so the README's current-row query gives the same answer after as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from vlbatch.errors import JobCannotRunError
from vlbatch.pipeline.write import PAGE_SCHEMA, RESULT_SCHEMA, OutputFolder, fsync_folder

AT_FDCWD = -100
RENAME_EXCHANGE = 2
ROWS_PER_PART = 500_000



@dataclass
class Compacted:
    table: str  # results, pages, fields/<task>
    parts_before: int
    parts_after: int
    rows_before: int
    rows_after: int


def compact_output(root: Path, current: bool = False,
                   rows_per_part: int = ROWS_PER_PART) -> list[Compacted]:
    root = Path(root)
    if not (root / "results").is_dir():
        raise JobCannotRunError(f"{root} is not a vlbatch output folder (no results/)")
    output = OutputFolder(root)
    stamp = "compact" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    done = []
    with output.lock():
        tables = [("pages", output.pages, ("source", "page"), None, PAGE_SCHEMA),
                  *((f"fields/{f.name}", f, ("source", "page", "task"), "finished_at", None)
                    for f in sorted(output.fields.glob("*")) if f.is_dir()),
                  ("results", output.results, ("source", "page", "task"), "finished_at",
                   RESULT_SCHEMA)]  # results last: a page's row is never later than its results
        for name, folder, key, newest_by, schema in tables:
            done.append(compact_table(name, folder, key, newest_by, schema, current,
                                      rows_per_part, stamp))
    return done


def compact_table(name: str, folder: Path, key: tuple[str, ...], newest_by: str | None,
                  schema: pa.Schema | None, current: bool, rows_per_part: int,
                  stamp: str) -> Compacted:
    parts = sorted(folder.glob("part-*.parquet"))  # the order runs wrote them
    rows_before = sum(pq.ParquetFile(p).metadata.num_rows for p in parts)
    if not parts or (len(parts) == 1 and not current):
        return Compacted(name, len(parts), len(parts), rows_before, rows_before)
    unified = _unified_schema(parts, schema, name)
    keep = _current_rows(parts, key, newest_by) if current else None
    staging = folder.parent / f".{folder.name}.{stamp}"
    staging.mkdir()
    written = _write_parts(parts, unified, keep, staging, rows_per_part, stamp)
    fsync_folder(staging)
    _exchange(staging, folder)  # staging now holds the old parts
    fsync_folder(folder.parent)
    shutil.rmtree(staging)
    rows_after = sum(written)
    return Compacted(name, len(parts), len(written), rows_before, rows_after)


def _unified_schema(parts: list[Path], schema: pa.Schema | None, name: str) -> pa.Schema:
    """One schema for every part: the table's own (older parts lack newer columns: nulls),
    or for a fields table the union of its parts' (a schema that changed adds columns)."""
    schemas = [pq.read_schema(p) for p in parts]
    try:
        return pa.unify_schemas(([schema] if schema is not None else []) + schemas,
                                promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise JobCannotRunError(f"{name}: its parts' columns do not agree ({e}); nothing "
                                f"compacted") from None


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    columns = [table.column(f.name).cast(f.type) if f.name in table.column_names
               else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def _current_rows(parts: list[Path], key: tuple[str, ...],
                  newest_by: str | None) -> dict[int, list[int]]:
    """(part number, row number) of each key's newest row: the latest `newest_by`, ties
    and a table without it going to the later part (as OutputFolder.history decides)."""
    import polars as pl

    frames = []
    for number, path in enumerate(parts):
        columns = [*key, *([newest_by] if newest_by else [])]
        present = set(pq.read_schema(path).names)
        table = pq.read_table(path, columns=[c for c in columns if c in present])
        frame = pl.from_arrow(table)
        if newest_by and newest_by in frame.columns:
            frame = frame.with_columns(pl.col(newest_by).cast(pl.Int64).alias("_at"))
        else:
            frame = frame.with_columns(pl.lit(None, pl.Int64).alias("_at"))
        frames.append(frame.select(
            *(pl.col(k).cast(pl.String) for k in key), "_at",
            pl.lit(number, pl.Int64).alias("_part"), pl.int_range(pl.len(), dtype=pl.Int64).alias("_row")))
    rows = pl.concat(frames)
    order = ["_at", "_part", "_row"] if newest_by else ["_part", "_row"]
    winners = (rows.sort(order, nulls_last=False).group_by(list(key), maintain_order=True)
               .agg(pl.col("_part").last(), pl.col("_row").last()))
    keep: dict[int, list[int]] = {}
    for part, row in zip(winners["_part"].to_list(), winners["_row"].to_list()):
        keep.setdefault(part, []).append(row)
    return {part: sorted(rows) for part, rows in keep.items()}


def _write_parts(parts: list[Path], schema: pa.Schema, keep: dict | None, staging: Path,
                 rows_per_part: int, stamp: str) -> list[int]:
    """Every part's rows (those in `keep`), in order, into parts of rows_per_part rows."""
    written: list[int] = []
    writer, rows_in_part = None, 0

    def close() -> None:
        nonlocal writer
        if writer is not None:
            writer.close()
            _fsync_file(staging / f"part-{stamp}-{len(written) - 1:05d}.parquet")
            writer = None

    for number, path in enumerate(parts):
        table = _conform(pq.read_table(path), schema)
        if keep is not None:
            table = table.take(pa.array(keep.get(number, []), pa.int64()))
        offset = 0
        while offset < table.num_rows:
            if writer is None:
                written.append(0)
                writer = pq.ParquetWriter(staging / f"part-{stamp}-{len(written) - 1:05d}.parquet",
                                          schema, compression="zstd")
                rows_in_part = 0
            piece = table.slice(offset, rows_per_part - rows_in_part)
            writer.write_table(piece)
            offset += piece.num_rows
            rows_in_part += piece.num_rows
            written[-1] += piece.num_rows
            if rows_in_part >= rows_per_part:
                close()
    close()
    return written


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _exchange(a: Path, b: Path) -> None:
    """Swap two folders in one step (renameat2 RENAME_EXCHANGE, Linux 3.15+)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        shutil.rmtree(a)
        raise JobCannotRunError("compaction needs renameat2 (Linux, glibc 2.28+) to swap "
                                "folders atomically; nothing compacted")
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        shutil.rmtree(a)
        why = ("this file system cannot exchange folders atomically"
               if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) else os.strerror(code))
        raise JobCannotRunError(f"cannot swap {b} for its compacted parts: {why}; nothing "
                                f"compacted")
