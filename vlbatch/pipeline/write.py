"""write: result and page rows -> Parquet parts that appear whole or not at all, the run
manifest, the output folder's lock, and the index of what earlier runs already finished.

Layout (DESIGN.md):
    OUTPUT/results/part-<run_id>-<seq>.parquet
    OUTPUT/pages/part-<run_id>-<seq>.parquet
    OUTPUT/fields/<task>/part-<run_id>-<seq>.parquet   (schema tasks: typed columns)
    OUTPUT/_runs/<run_id>.json
    OUTPUT/.lock
"""

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

import pyarrow as pa
import pyarrow.parquet as pq

from vlbatch.errors import JobCannotRunError, OutputLocked
from vlbatch.pipeline import history
from vlbatch.pipeline.history import History

RESULT_SCHEMA = pa.schema([
    ("source", pa.string()),
    ("page", pa.int32()),
    ("task", pa.string()),
    ("output", pa.string()),
    ("status", pa.string()),
    ("error", pa.string()),
    ("content_hash", pa.string()),
    ("phash", pa.string()),
    ("cached", pa.bool_()),
    ("reused_from", pa.string()),
    ("model", pa.string()),
    ("run_id", pa.string()),
    # beyond DESIGN.md's contract: what makes a row current, and its cost
    ("source_sha256", pa.string()),
    ("task_hash", pa.string()),
    ("prompt_tokens", pa.int32()),
    ("output_tokens", pa.int32()),
    ("finished_at", pa.timestamp("ms", tz="UTC")),
    ("attempt", pa.int32()),  # this row's try at its key: 1, 2, ... (failures.py)
    ("error_kind", pa.string()),  # 'transient' (retried by the next run) or 'permanent'
    ("matched_path", pa.string()),  # the input as the job's glob matched it (`source`: absolute)
    ("finish_reason", pa.string()),  # vLLM's: 'stop', 'length' (max_tokens); null: none generated
    ("error_output", pa.string()),  # an answer kept as an error (schema:, degenerate output): its text
])

PAGE_SCHEMA = pa.schema([
    ("source", pa.string()),
    ("page", pa.int32()),
    ("width", pa.int32()),  # as the model sees it
    ("height", pa.int32()),
    ("text_layer", pa.string()),
    ("content_hash", pa.string()),
    ("phash", pa.string()),
    ("source_sha256", pa.string()),
    ("error", pa.string()),
    ("run_id", pa.string()),
    ("matched_path", pa.string()),
])

class PartWriter:
    """Buffers rows and writes them as a new part every `max_rows` rows or `max_seconds`."""

    def __init__(self, folder: Path, run_id: str, schema: pa.Schema,
                 max_rows: int = 1000, max_seconds: float = 30.0, before_flush=None):
        self.folder, self.run_id, self.schema = folder, run_id, schema
        self.before_flush = before_flush  # called first at every flush (another writer's)
        self.max_rows, self.max_seconds = max_rows, max_seconds
        self.rows: list[dict] = []
        self.seq = 0
        self.last_flush = time.monotonic()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.max_rows or time.monotonic() - self.last_flush >= self.max_seconds:
            self.flush()

    def flush(self) -> None:
        """A new part with the rows so far, durable once this returns: the file synced before
        its rename, and its folder after (else a power cut can lose the rename)."""
        if self.before_flush is not None:
            self.before_flush()
        self.last_flush = time.monotonic()
        if not self.rows:
            return
        table = pa.Table.from_pylist(self.rows, schema=self.schema)
        name = f"part-{self.run_id}-{self.seq:05d}.parquet"
        tmp = self.folder / f".{name}.tmp"  # a leading dot: readers skip it
        pq.write_table(table, tmp, compression="zstd")
        _replace_durably(tmp, self.folder / name)
        self.seq += 1
        self.rows = []


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
        """Half-written parts and manifests of a run that died mid-write, and what a killed
        `vlbatch compact` left beside the live folders (only with the lock held: no live
        run is writing them)."""
        stale = [*self.results.glob(".part-*.tmp"), *self.pages.glob(".part-*.tmp"),
                 *self.fields.glob("*/.part-*.tmp"), *self.runs.glob(".*.tmp")]
        for path in stale:
            path.unlink(missing_ok=True)
        compactions = [*self.root.glob(".*.compact*"), *self.fields.glob(".*.compact*")]
        for path in compactions:
            shutil.rmtree(path, ignore_errors=True)
        return len(stale) + len(compactions)

    def fields_of(self, task: str) -> Path:
        """A schema task's fields folder, made when first asked for."""
        folder = self.fields / task
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def part_files(self, kind: str = "results") -> list[Path]:
        return sorted((self.root / kind).glob("part-*.parquet"))

    def history(self, retry_errors: bool = False, max_attempts: int = 3) -> History:
        """What earlier runs left in this folder (history.scan over the result parts)."""
        return history.scan(self.part_files(), RESULT_SCHEMA, retry_errors, max_attempts)

    def write_manifest(self, run_id: str, manifest: dict) -> Path:
        path = self.runs / f"{run_id}.json"
        tmp = self.runs / f".{run_id}.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=2, default=str))
        _replace_durably(tmp, path)
        return path
