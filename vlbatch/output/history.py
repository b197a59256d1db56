"""history: what the results table's current rows say about the rows a night wants, decided
in columns (polars), never a Python object per row of the table.

A wanted row is (source, page, task, sha256, task_hash): the file's bytes and the task's
identity now (identity.py). Joined with the current row of its (source, page, task):

- done: the current row has the same identity and is ok; or is an error that stays
  (permanent, or transient with its `max_attempts` used), unless retrying errors; but not a
  request refused under another engine.max_model_len than the job's now;
- attempt: the current row's attempt number where it is an error of the same identity;
- answered: the current row was written for the same file bytes (under other settings:
  a row to do again because its settings changed is 'stale');
- has_row: the table holds a row of the key (the flush merges instead of appending).

What the sink asks while the run goes on (`History`, `HeldKeys`) is kept for the rows to do
only, as 16-byte digests in sorted numpy arrays.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import polars as pl
import pyarrow as pa

from vlbatch.pipeline.failures import REJECTED

DoneKey = tuple[str, int | None, str, str | None, str]  # source, page, task, file hash, task hash
DIGEST = "S16"
COLUMNS = ["source", "page", "task", "source_sha256", "task_hash", "status", "error_kind",
           "attempt", "finished_at", "error"]
KEY = ["source", "page", "task"]


def key_digest(key: tuple) -> bytes:
    """16 bytes standing for a key (collision odds ~ rows^2 / 2^129)."""
    return hashlib.blake2b("\x1f".join(map(repr, key)).encode(), digest_size=16).digest()


class DigestTable:
    """Sorted unique 16-byte digests, each with an optional small number."""

    def __init__(self, digests: np.ndarray | None = None, values: np.ndarray | None = None):
        self.digests = np.empty(0, DIGEST) if digests is None else digests
        self.values = values

    @classmethod
    def of(cls, digests: Iterable[bytes], values: Iterable[int] | None = None) -> DigestTable:
        keys = np.array(list(digests), DIGEST)
        if values is None:
            return cls(np.unique(keys))
        order = np.argsort(keys, kind="stable")
        return cls(keys[order], np.array(list(values), np.int64)[order])

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
class HeldKeys:
    """Whether a table may hold a row of a key: known for the keys in `scope` (the rows to
    do), assumed for any other (a merge is always right; an append only saves work)."""

    held: DigestTable = field(default_factory=DigestTable)
    scope: DigestTable | None = None  # None: `held` knows every key

    def __contains__(self, key: tuple) -> bool:
        digest = key_digest(key)
        if self.scope is not None and digest not in self.scope:
            return True
        return digest in self.held

    @classmethod
    def of(cls, held: Iterable[tuple], scope: Iterable[tuple] | None = None) -> HeldKeys:
        return cls(DigestTable.of(map(key_digest, held)),
                   None if scope is None else DigestTable.of(map(key_digest, scope)))


@dataclass(frozen=True)
class History:
    """The rows to do, as the sink asks about them: each one's attempt number so far, and
    whether the results table holds a row of its key."""

    attempts: DigestTable = field(default_factory=DigestTable)  # done keys -> attempt
    rows: HeldKeys = field(default_factory=HeldKeys)

    def attempt(self, key: DoneKey) -> int:
        """The attempt number of the key's current row if it is an error, else 0."""
        return self.attempts.get(key_digest(key), 0)

    def has_row(self, source: str, page: int | None, task: str) -> bool:
        return (source, page, task) in self.rows

    @classmethod
    def of_todo(cls, todo: pl.DataFrame) -> History:
        """From judged rows to do (`judge`'s columns)."""
        failed = todo.filter(pl.col("attempt") > 0)
        keys = list(failed.select("source", "page", "task", "sha256", "task_hash").iter_rows())
        held = todo.filter(pl.col("has_row")).select(KEY).iter_rows()
        return cls(DigestTable.of(map(key_digest, keys), failed["attempt"].to_list()),
                   HeldKeys.of(held, todo.select(KEY).iter_rows()))


def current_rows(batches: Iterable[pa.RecordBatch | pl.DataFrame],
                 legacy: bool = False) -> pl.DataFrame:
    """The results table's current rows (the columns judging needs). Parts of the layout
    before tables (legacy) may hold several rows a key: the newest decides (the latest
    `finished_at`; a row without one is newer than every row before it)."""
    schema = {"source": pl.String, "page": pl.Int32, "task": pl.String,
              "source_sha256": pl.String, "task_hash": pl.String, "status": pl.String,
              "error_kind": pl.String, "attempt": pl.Int64, "error": pl.String}
    frames = []
    for batch in batches:
        frame = batch if isinstance(batch, pl.DataFrame) else pl.from_arrow(batch)
        if not isinstance(frame, pl.DataFrame):
            continue
        frames.append(frame.with_columns(
            [pl.lit(None, dtype).alias(name) for name, dtype in schema.items()
             if name not in frame.columns]
            + ([] if "finished_at" in frame.columns else
               [pl.lit(None, pl.Datetime("us", "UTC")).alias("finished_at")])))
    if not frames:
        return pl.DataFrame(schema=schema)
    rows = pl.concat([f.select(*schema, pl.col("finished_at").cast(pl.Datetime("us", "UTC")))
                      .cast(schema) for f in frames])
    if legacy:
        rows = (rows.with_row_index("_n")
                .with_columns(_at=pl.col("finished_at").cum_max().forward_fill())
                .with_columns(_at=pl.coalesce("finished_at", "_at"))
                .sort(["_at", "_n"], nulls_last=False)
                .unique(KEY, keep="last", maintain_order=True).drop("_n", "_at"))
    return rows.drop("finished_at")


def judge(wanted: pl.DataFrame, current: pl.DataFrame, *, retry_errors: bool = False,
          max_attempts: int = 3, max_model_len: int | None = None) -> pl.DataFrame:
    """`wanted` (source, page, task, sha256, task_hash, ...) with done, attempt, answered
    and has_row (see the module's docstring), in `wanted`'s order."""
    cur = current.rename({c: f"cur_{c}" for c in current.columns if c not in KEY})
    joined = wanted.join(cur, on=KEY, how="left", nulls_equal=True, maintain_order="left")
    has_row = pl.col("cur_status").is_not_null()
    same = has_row & (pl.col("cur_source_sha256") == pl.col("sha256")).fill_null(False) \
        & (pl.col("cur_task_hash") == pl.col("task_hash")).fill_null(False)
    ok = pl.col("cur_status") == "ok"
    attempts = pl.col("cur_attempt").fill_null(1).clip(1, 65535)
    transient = (pl.col("cur_error_kind") == "transient").fill_null(False)
    stays = (~transient | (attempts >= max_attempts)) if not retry_errors else pl.lit(False)
    refused = pl.col("cur_error").str.extract(
        r"^" + re.escape(REJECTED) + r" \(engine\.max_model_len (\d+|default)\)", 1)
    refused_under = pl.when(refused == "default").then(0).otherwise(
        refused.cast(pl.Int64, strict=False))
    refused_elsewhere = (~ok & refused.is_not_null()
                         & (refused_under != (max_model_len or 0))).fill_null(False)
    return joined.with_columns(
        done=(same & (ok | stays) & ~refused_elsewhere).fill_null(False),
        attempt=pl.when(same & ~ok).then(attempts).otherwise(0),
        answered=(has_row & (pl.col("cur_source_sha256") == pl.col("sha256"))).fill_null(False),
        has_row=has_row,
    ).drop([c for c in joined.columns if c.startswith("cur_")])


def held_among(table_keys: pl.DataFrame, wanted: pl.DataFrame, key: list[str]) -> HeldKeys:
    """Which of `wanted`'s keys a table (its key columns) holds: a HeldKeys scoped to them."""
    wanted = wanted.select(key).unique()
    held = wanted.join(table_keys.select(key), on=key, how="semi", nulls_equal=True)
    return HeldKeys.of(held.iter_rows(), wanted.iter_rows())
