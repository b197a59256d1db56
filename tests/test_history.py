"""What is done (output/history.py: judge, in columns) against the rule written out plainly, over real
Parquet parts with every status, kind, attempt and missing times."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import polars as pl

from vlbatch.output.history import DigestTable, HeldKeys, judge, key_digest
from vlbatch.output.folder import OutputFolder
from vlbatch.output.schemas import RESULT_SCHEMA
from vlbatch.pipeline.failures import rejection_prefix


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
    """Newest row per (source, page, task): the latest time; a row without one is newer than
    all before it. A wanted identity (file hash, task hash) is done when that row has it and
    is ok, or an error that stays."""
    newest, latest = {}, datetime.min.replace(tzinfo=timezone.utc)
    for part in parts:
        for row in part:
            key = (row["source"], row["page"], row["task"])
            at = row["finished_at"]
            latest = at if at is not None and at > latest else latest
            time = latest if at is None else at
            before = newest.get(key)
            if before is None or time >= before[1]:
                newest[key] = (row, time)
    done, attempts = set(), {}
    for key, (row, _) in newest.items():
        full = (*key, row["source_sha256"], row["task_hash"])
        if row["status"] == "ok":
            done.add(full)
            continue
        attempts[full] = row["attempt"] or 1
        transient = row["error_kind"] == "transient"
        if not retry_errors and (not transient or attempts[full] >= max_attempts):
            done.add(full)
    return newest, done, attempts


@pytest.mark.parametrize("retry_errors", [False, True])
def test_judge_follows_the_rule(tmp_path, retry_errors):
    """Over legacy parts (several rows a key) and every identity a night may want."""
    rng = random.Random(7)
    output = OutputFolder(tmp_path / "out")
    parts = [_rows(rng, 300) for _ in range(4)]
    for i, part in enumerate(parts):
        pq.write_table(pa.Table.from_pylist(part, schema=RESULT_SCHEMA),
                       output.results / f"part-r-{i:05d}.parquet")
    current = output.current_results()
    newest, done, attempts = _plain_rule(parts, retry_errors, 3)
    assert current.height == len(newest)
    wanted = [(*key, sha, th) for key in newest for sha in ("f1", "f2") for th in ("h1", "h2")]
    wanted.append(("/in/other.pdf", 1, "a", "f1", "h1"))
    frame = pl.DataFrame(wanted, schema={"source": pl.String, "page": pl.Int32, "task": pl.String,
                                         "sha256": pl.String, "task_hash": pl.String}, orient="row")
    judged = judge(frame, current, retry_errors=retry_errors, max_attempts=3)
    assert judged.height == len(wanted)
    assert 0 < judged["done"].sum() < len(wanted)  # the sample holds both kinds
    for row in judged.iter_rows(named=True):
        key = (row["source"], row["page"], row["task"], row["sha256"], row["task_hash"])
        assert row["done"] == (key in done), key
        assert row["attempt"] == attempts.get(key, 0), key
        held = newest.get(key[:3])
        assert row["has_row"] == (held is not None)
        assert row["answered"] == (held is not None and held[0]["source_sha256"] == key[3])


def test_a_refused_request_is_done_only_under_the_limit_it_was_refused_under():
    current = pl.DataFrame([{"source": "s", "page": 1, "task": "t", "source_sha256": "h",
                             "task_hash": "th", "status": "error", "error_kind": "permanent",
                             "attempt": 1, "error": rejection_prefix(4096) + "too long"}],
                           schema_overrides={"page": pl.Int32})
    wanted = pl.DataFrame([{"source": "s", "page": 1, "task": "t", "sha256": "h", "task_hash": "th"}],
                          schema_overrides={"page": pl.Int32})
    assert judge(wanted, current, max_model_len=4096)["done"].to_list() == [True]
    assert judge(wanted, current, max_model_len=8192)["done"].to_list() == [False]
    assert judge(wanted, current)["done"].to_list() == [False]  # the model's default


def test_digest_table_with_trailing_zero_bytes():
    """Digests ending in zero bytes are still told apart (numpy pads S16 with zeros)."""
    a, b, c = b"\x01" * 15 + b"\x00", b"\x01" * 15 + b"\x02", b"\x01" * 14 + b"\x00\x00"
    table = DigestTable.of([a, b])
    assert a in table and b in table and c not in table
    assert key_digest(("x",)) not in table


def test_held_keys_know_their_scope_and_assume_the_rest():
    held = HeldKeys.of([("s", 1)], scope=[("s", 1), ("s", 2)])
    assert ("s", 1) in held and ("s", 2) not in held
    assert ("other", 1) in held  # outside what was asked: a merge, never a duplicate append
