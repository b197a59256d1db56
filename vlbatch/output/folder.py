"""folder: an output folder's paths (layout: output/__init__.py), its lock, run manifests,
and what its results table says is done."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pyarrow as pa

from vlbatch.errors import JobCannotRunError, OutputLocked
from vlbatch.output import history
from vlbatch.output.table import is_table, open_table

def _replace_durably(tmp: Path, path: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_folder(path.parent)


def fsync_folder(path: Path) -> None:
    """A folder's entries (a rename, a new file) durable."""
    folder = os.open(path, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


class OutputFolder:
    def __init__(self, root: Path, create: bool = True):
        """create=False: an existing output, read only (`vlbatch plan`); nothing is made."""
        self.root = Path(root)
        self.results = self.root / "results"
        self.pages = self.root / "pages"
        self.runs = self.root / "_runs"
        self.fields = self.root / "fields"
        if not create:
            return
        try:
            for folder in (self.root, self.results, self.pages, self.runs):
                failing = folder
                folder.mkdir(parents=True, exist_ok=True)
                probe = folder / f".write-test-{os.getpid()}"  # each: one may be read-only
                probe.write_bytes(b"")
                probe.unlink()
        except OSError as e:
            raise JobCannotRunError(f"output folder {failing} is not writable: "
                                    f"{e.strerror or e}") from None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One run at a time per output. flock is released by the kernel when its holder
        dies, so a lock left by a dead process is simply taken over."""
        path = self.root / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        held = False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                raise OutputLocked(f"another run holds {path} ({holder}); try again later") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}".encode(), 0)
            held = True
            self.remove_stale_temporaries()
            yield
        finally:
            if held:
                os.ftruncate(fd, 0)  # no holder named once the run is over
            os.close(fd)  # closing releases the flock

    def remove_stale_temporaries(self) -> int:
        """Half-written manifests of a run that died mid-write, data files a flush killed
        mid-write left under their staging name (delta-rs writes `<file>#<n>` and renames it
        into place; vacuum does not know them), and what a killed migration left beside the
        live folders (only with the lock held: no live run writes them)."""
        stale = [*self.runs.glob(".*.tmp")]
        for table in self.tables():
            stale += [p for p in table.glob("*.parquet#*") if p.is_file()]
        for path in stale:
            path.unlink(missing_ok=True)
        staging = [p for p in [*self.root.glob(".*.migrating"), *self.fields.glob(".*.migrating")]
                   if p.is_dir()]
        for path in staging:
            shutil.rmtree(path, ignore_errors=True)
        return len(stale) + len(staging)

    def tables(self) -> list[Path]:
        """The folders of its tables: results, pages and each fields/<task>."""
        fields = sorted(p for p in self.fields.glob("*")
                        if p.is_dir() and not p.name.startswith(".")) if self.fields.is_dir() else []
        return [self.results, self.pages, *fields]

    def check_tables(self) -> None:
        """Each table opens and every data file its current version names is there; else
        TableDamaged (exit 3), before the run writes anything."""
        for path in self.tables():
            open_table(path)

    def legacy_parts(self) -> list[Path]:
        """Parquet parts of the layout before tables (vlbatch before 0.x: migrate.py)."""
        return [p for folder in self.tables() for p in sorted(folder.glob("part-*.parquet"))]

    def current_results(self) -> pl.DataFrame:
        """The results table's current rows, the columns judging what is done needs
        (history.current_rows), read by polars (its reader holds a fraction of what
        pyarrow's dataset scan holds)."""
        if is_table(self.results):
            return history.current_rows([_read_columns(self.results, history.COLUMNS)])
        return history.current_rows(self.result_batches(history.COLUMNS), legacy=True)

    def table_keys(self, path: Path, key: tuple[str, ...]) -> pl.DataFrame:
        """A table's key columns (empty where there is no table yet)."""
        if open_table(path, check_files=False) is None:
            return pl.DataFrame(schema={c: pl.Int32 if c == "page" else pl.String for c in key})
        return _read_columns(path, list(key))

    def result_batches(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        """The results table's current rows (those of `columns` it has), in batches; in a
        folder not migrated yet (`vlbatch plan` does not write), its parts' rows."""
        import pyarrow.dataset as ds

        table = open_table(self.results, check_files=False)
        if table is not None:
            dataset = table.to_pyarrow_dataset()
        else:
            parts = sorted(self.results.glob("part-*.parquet"))
            if not parts:
                return iter(())
            dataset = ds.dataset([str(p) for p in parts], format="parquet")
        names = dataset.schema.names
        return dataset.to_batches(columns=[c for c in columns if c in names])

    def write_manifest(self, run_id: str, manifest: dict) -> Path:
        path = self.runs / f"{run_id}.json"
        tmp = self.runs / f".{run_id}.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2, default=str))
        _replace_durably(tmp, path)
        return path


def _read_columns(path: Path, columns: list[str]) -> pl.DataFrame:
    """Those of `columns` a Delta table has, its current version, read by polars."""
    scan = pl.scan_delta(str(path))
    names = scan.collect_schema().names()
    return scan.select([c for c in columns if c in names]).collect()
