"""source_index: what the output folder's last run learned about each input file, so that a
night stats the files the globs match and hashes and probes only the new and changed ones.

`OUTPUT/_sources/index-v1.parquet` (the format's version in its name), one row per input file (absolute path): its stat signature
(size, mtime_ns, ctime_ns, inode, device), its SHA-256, when that hash was taken, and its
probe (kind, page sizes, or the error that stopped it) under the probe settings named in
the row. The file is replaced whole and atomically (written beside, fsynced, renamed), so a
run killed at any point leaves the previous index or the new one. It is a cache: an index
that cannot be read is said in the log and rebuilt (every file hashed once more), never a
reason to fail a night.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pyarrow as pa

log = logging.getLogger("vlbatch")

PAGE = pa.struct([("page", pa.int32()), ("width", pa.int32()), ("height", pa.int32()),
                  ("error", pa.string())])
INDEX_SCHEMA = pa.schema([
    ("path", pa.string()),  # absolute, as the run opens it
    ("size", pa.int64()),
    ("mtime_ns", pa.int64()),
    ("ctime_ns", pa.int64()),
    ("inode", pa.int64()),
    ("device", pa.int64()),
    ("sha256", pa.string()),
    ("hashed_at_ns", pa.int64()),  # wall clock when the hash was taken (time.time_ns)
    ("probe_settings", pa.string()),  # what the probe depended on (survey.probe_settings)
    ("kind", pa.string()),
    ("probe_error", pa.string()),  # the whole file failed to probe (a permanent reason)
    ("pages", pa.list_(PAGE)),
])


def index_polars_schema() -> dict:
    """INDEX_SCHEMA in polars' types, written out: turning an Arrow schema into a frame
    (`empty_table`, `pa.array`) imports pandas (47 MiB of a night's memory) to check its
    input; tests/test_sources.py checks the two schemas agree."""
    import polars as pl

    page = pl.Struct({"page": pl.Int32, "width": pl.Int32, "height": pl.Int32,
                      "error": pl.String})
    return {"path": pl.String, "size": pl.Int64, "mtime_ns": pl.Int64, "ctime_ns": pl.Int64,
            "inode": pl.Int64, "device": pl.Int64, "sha256": pl.String,
            "hashed_at_ns": pl.Int64, "probe_settings": pl.String, "kind": pl.String,
            "probe_error": pl.String, "pages": pl.List(page)}


def index_path(output_root: Path) -> Path:
    return Path(output_root) / "_sources" / "index-v1.parquet"


def read_index_frame(output_root: Path):
    """The index as a polars frame (read by polars: a fraction of pyarrow's reader's
    memory), or an empty one where there is none or it cannot be read (said)."""
    import polars as pl

    empty = pl.DataFrame(schema=index_polars_schema())
    path = index_path(output_root)
    if not path.exists():
        return empty
    try:
        frame = pl.read_parquet(path, columns=INDEX_SCHEMA.names)
        return frame.cast(dict(empty.schema))
    except Exception as e:  # noqa: BLE001 - a cache: rebuilt, whatever broke it
        log.warning("the source index %s cannot be read (%s): every input is hashed again",
                    path, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return empty


def read_index(output_root: Path) -> pa.Table:
    return read_index_frame(output_root).to_arrow().cast(INDEX_SCHEMA)


def write_index(output_root: Path, table) -> Path:
    """Replaces the index (a polars frame or an Arrow table) whole, atomically and
    durably."""
    import polars as pl

    from vlbatch.output.folder import fsync_folder

    path = index_path(output_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    frame = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    frame.select(INDEX_SCHEMA.names).write_parquet(tmp, compression="zstd")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_folder(path.parent)
    return path
