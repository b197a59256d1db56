"""history: what the results table's current rows say, per page x task key: finished
(nothing to do), or tried and failed (its attempt number); and which keys the tables hold.

Keys are held as 16-byte digests in sorted numpy arrays (16 bytes a key, 17 with an
attempt number), never as Python objects: the scan of 100,000 rows holds a few MB, and
reads each part in batches of BATCH rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from vlbatch.pipeline.failures import refused_under

DoneKey = tuple[str, int | None, str, str | None, str]  # source, page, task, file hash, task hash
BATCH = 20_000  # rows turned into Python objects at a time
DIGEST = "S16"
_OK, _TRANSIENT, _PERMANENT = 0, 1, 2


def key_digest(key: tuple) -> bytes:
    """16 bytes standing for a key (collision odds ~ rows^2 / 2^129)."""
    return hashlib.blake2b("\x1f".join(map(repr, key)).encode(), digest_size=16).digest()


class DigestTable:
    """Sorted unique 16-byte digests, each with an optional small number."""

    def __init__(self, digests: np.ndarray | None = None, values: np.ndarray | None = None):
        self.digests = np.empty(0, DIGEST) if digests is None else digests
        self.values = values

    @classmethod
    def of(cls, digests: Iterable[bytes]) -> DigestTable:
        return cls(np.unique(np.array(list(digests), DIGEST)))

    def __len__(self) -> int:
        return len(self.digests)

    def _at(self, digest: bytes) -> int | None:
        probe = np.array(digest, DIGEST)
        i = int(np.searchsorted(self.digests, probe))
        if i < len(self.digests) and self.digests[i:i + 1] == probe:  # compared padded
            return i
        return None

    def __contains__(self, digest: bytes) -> bool:
        return self._at(digest) is not None

    def get(self, digest: bytes, default: int = 0) -> int:
        i = self._at(digest)
        return default if i is None or self.values is None else int(self.values[i])

    def nbytes(self) -> int:
        return self.digests.nbytes + (0 if self.values is None else self.values.nbytes)


@dataclass(frozen=True)
class History:
    """Ask with the keys themselves (`DoneKey`s)."""

    done: DigestTable
    attempts: DigestTable  # keys whose newest row is an error, with its attempt number
    answered: DigestTable = field(default_factory=DigestTable)  # (source, page, task, file hash) with a row
    keys: DigestTable = field(default_factory=DigestTable)  # (source, page, task) with a current row
    pages: DigestTable = field(default_factory=DigestTable)  # (source, page) with a current row
    refused: DigestTable = field(default_factory=DigestTable)  # rejected keys: the max_model_len

    @classmethod
    def of(cls, done: Iterable[DoneKey] = ()) -> History:
        return cls(DigestTable.of(map(key_digest, done)), DigestTable())

    def is_done(self, key: DoneKey) -> bool:
        return key_digest(key) in self.done

    def attempt(self, key: DoneKey) -> int:
        """The attempt number of the key's newest row if it is an error, else 0."""
        return self.attempts.get(key_digest(key), 0)

    def was_answered(self, key: DoneKey) -> bool:
        """Whether the key's page and task has a row under any settings."""
        return key_digest(key[:4]) in self.answered

    def refused_under(self, key: DoneKey) -> int | None:
        """The engine.max_model_len (0: the model's default) a key's current row was refused
        under, if the engine refused it (failures.refused_under); else None."""
        limit = self.refused.get(key_digest(key), -1)
        return None if limit < 0 else limit

    def has_row(self, source: str, page: int | None, task: str | None = None) -> bool:
        """Whether the results table (task given) or the pages table holds a row of the key."""
        if task is None:
            return key_digest((source, page)) in self.pages
        return key_digest((source, page, task)) in self.keys

    def nbytes(self) -> int:
        return sum(t.nbytes() for t in (self.done, self.attempts, self.answered, self.keys,
                                        self.pages))


class _Columns:
    """Growing numpy columns of the rows scanned (about 50 bytes a row)."""

    def __init__(self):
        self.parts: list[tuple[np.ndarray, ...]] = []

    def add(self, *columns: np.ndarray) -> None:
        self.parts.append(columns)

    def joined(self) -> tuple[np.ndarray, ...]:
        if not self.parts:
            return (np.empty(0, DIGEST), np.empty(0, DIGEST), np.empty(0, np.uint8),
                    np.empty(0, np.uint16), np.empty(0, np.int64))
        joined = tuple(np.concatenate(c) for c in zip(*self.parts))
        self.parts = []
        return joined


COLUMNS = ["source", "page", "task", "source_sha256", "task_hash", "status", "error_kind",
           "attempt", "finished_at", "error"]


def scan(batches: Iterable[pa.RecordBatch], retry_errors: bool = False,
         max_attempts: int = 3) -> History:
    """Each key's newest row decides (the results table holds one a key; its history more):
    ok is done; a permanent error is done unless retrying errors; a transient one is done
    once it used its `max_attempts` (unless retrying errors). Rows written before `attempt`
    and `error_kind` existed count as attempt 1 of a permanent error. Newest: the latest
    `finished_at`; a row without one is newer than every row before it."""
    rows = _Columns()
    latest = np.iinfo(np.int64).min
    keys3, pages, refused, limits = [], [], [], []
    for whole in batches:
        for batch in pa.Table.from_batches([whole]).to_batches(max_chunksize=BATCH):
            columns = {name: batch.column(name) for name in COLUMNS if name in batch.schema.names}
            at_column = columns.get("finished_at")
            if at_column is not None:
                columns["finished_at"] = at_column.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
            n = batch.num_rows
            values = [columns[name].to_pylist() if name in columns else [None] * n
                      for name in COLUMNS]
            keys, answered, state, attempts, times = [], [], [], [], []
            for s, p, t, h, th, status, kind, attempt, at, error in zip(*values):
                keys.append(key_digest((s, p, t, h, th)))
                limit = refused_under(error) if status == "error" else None
                if limit is not None:
                    refused.append(keys[-1])
                    limits.append(limit)
                answered.append(key_digest((s, p, t, h)))
                keys3.append(key_digest((s, p, t)))
                pages.append(key_digest((s, p)))
                state.append(_OK if status == "ok" else _TRANSIENT if kind == "transient"
                             else _PERMANENT)
                attempts.append(min(attempt or 1, 65535))
                if at is not None:
                    latest = max(latest, at)
                times.append(latest if at is None else at)  # no time: the newest before it
            rows.add(np.array(keys, DIGEST), np.array(answered, DIGEST),
                     np.array(state, np.uint8), np.array(attempts, np.uint16),
                     np.array(times, np.int64))
    keys, answered, state, attempts, times = rows.joined()
    # newest row per key: sorted by key, then time, then row order; the last of each key
    order = np.lexsort((np.arange(len(keys)), times, keys))
    keys, state, attempts = keys[order], state[order], attempts[order]
    last = np.ones(len(keys), bool)
    last[:-1] = keys[1:] != keys[:-1]
    keys, state, attempts = keys[last], state[last], attempts[last]
    failed = state != _OK
    if retry_errors:
        done = ~failed
    else:
        done = ~failed | (state == _PERMANENT) | (attempts >= max_attempts)
    return History(DigestTable(keys[done]), DigestTable(keys[failed], attempts[failed]),
                   DigestTable(np.unique(answered)), DigestTable.of(keys3), DigestTable.of(pages),
                   _valued(refused, limits))


def _valued(digests: list[bytes], values: list[int]) -> DigestTable:
    """A DigestTable of unique digests with a value each (the last given for a digest)."""
    if not digests:
        return DigestTable()
    keys = np.array(digests, DIGEST)
    order = np.argsort(keys, kind="stable")
    keys, vals = keys[order], np.array(values, np.int64)[order]
    last = np.ones(len(keys), bool)
    last[:-1] = keys[1:] != keys[:-1]
    return DigestTable(keys[last], vals[last])
