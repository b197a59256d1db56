"""The done-key scan (pipeline/history.py) against the rule written out plainly, over real
Parquet parts with every status, kind, attempt and missing times."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlbatch.output.history import DigestTable, History, key_digest
from vlbatch.output.folder import OutputFolder
from vlbatch.output.schemas import RESULT_SCHEMA


def _rows(rng: random.Random, n: int) -> list[dict]:
    start = datetime(2026, 12, 1, tzinfo=timezone.utc)
    rows = []
    for i in range(n):
        status = rng.choice(["ok", "error", "error"])
        rows.append({"source": f"/in/doc-{rng.randrange(40)}.pdf", "page": rng.choice([None, 1, 2]),
                     "task": rng.choice(["a", "b"]), "source_sha256": rng.choice(["f1", "f2"]),
                     "task_hash": rng.choice(["h1", "h2"]), "status": status,
                     "error_kind": None if status == "ok" else rng.choice(["transient", "permanent", None]),
                     "attempt": rng.choice([None, 1, 2, 3, 4]),
                     "finished_at": None if rng.random() < 0.1 else start + timedelta(seconds=rng.randrange(50)),
                     "output": "x", "run_id": "r"})
    return rows


def _plain_rule(parts: list[list[dict]], retry_errors: bool, max_attempts: int):
    """Newest row per key: the latest time; a row without one is newer than all before it."""
    newest, latest = {}, datetime.min.replace(tzinfo=timezone.utc)
    for part in parts:
        for row in part:
            key = (row["source"], row["page"], row["task"], row["source_sha256"], row["task_hash"])
            at = row["finished_at"]
            latest = at if at is not None and at > latest else latest
            time = latest if at is None else at
            before = newest.get(key)
            if before is None or time >= before[1]:
                newest[key] = (row, time)
    done, attempts = set(), {}
    for key, (row, _) in newest.items():
        if row["status"] == "ok":
            done.add(key)
            continue
        attempts[key] = row["attempt"] or 1
        transient = row["error_kind"] == "transient"
        if not retry_errors and (not transient or attempts[key] >= max_attempts):
            done.add(key)
    return newest, done, attempts


@pytest.mark.parametrize("retry_errors", [False, True])
def test_scan_follows_the_rule(tmp_path, retry_errors):
    rng = random.Random(7)
    output = OutputFolder(tmp_path / "out")
    parts = [_rows(rng, 300) for _ in range(4)]
    for i, part in enumerate(parts):
        pq.write_table(pa.Table.from_pylist(part, schema=RESULT_SCHEMA),
                       output.results / f"part-r-{i:05d}.parquet")
    history = output.history(retry_errors=retry_errors, max_attempts=3)
    newest, done, attempts = _plain_rule(parts, retry_errors, 3)
    assert 0 < len(done) < len(newest)  # the sample holds both kinds
    for key in newest:
        assert history.is_done(key) == (key in done), key
        assert history.attempt(key) == attempts.get(key, 0), key
        assert history.was_answered(key)
    unknown = ("/in/other.pdf", 1, "a", "f1", "h1")
    assert not history.is_done(unknown) and history.attempt(unknown) == 0
    assert not history.was_answered(unknown)
    assert history.nbytes() <= 17 * 3 * len(newest)  # numpy digests, no Python objects


def test_digest_table_with_trailing_zero_bytes():
    """Digests ending in zero bytes are still told apart (numpy pads S16 with zeros)."""
    a, b, c = b"\x01" * 15 + b"\x00", b"\x01" * 15 + b"\x02", b"\x01" * 14 + b"\x00\x00"
    table = DigestTable.of([a, b])
    assert a in table and b in table and c not in table
    assert key_digest(("x",)) not in table
    assert not History.of().is_done(("s", 1, "t", "h", "th"))
    assert History.of([("s", 1, "t", "h", "th")]).is_done(("s", 1, "t", "h", "th"))
