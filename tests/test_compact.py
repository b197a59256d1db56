"""`vlbatch compact`: small parts merged, every row kept (or the current ones), the
current-row query unchanged, readers never see a mix, the lock respected."""

from __future__ import annotations

import json
import threading

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from conftest import job_fields, run_cli
from fakes import ScriptedEngine, fake_prompts
from vlbatch.compact import compact_output
from vlbatch.errors import OutputLocked
from vlbatch.job import load_job
from vlbatch.output.folder import OutputFolder
from vlbatch.run import run_job

CURRENT = """SELECT source, page, task, status, output FROM (
  SELECT *, row_number() OVER (PARTITION BY source, page, task ORDER BY finished_at DESC) AS n
  FROM read_parquet('{glob}')) WHERE n = 1 ORDER BY source, page, task"""


@pytest.fixture
def nightly_output(samples, write_job, tmp_path):
    """Three runs into one output, a part every 3 rows: a first night whose invoice answers
    break their schema (error rows), a second with a changed notes prompt that retries the
    errors, a third with nothing to do: every key has two rows, the newest current."""
    tasks = [{"name": "invoice", "prompt": "Extract.", "fields": {"total": "number",
                                                                  "paid": "boolean"}},
             {"name": "notes", "prompt": "Notes."}]
    fields = job_fields("fake-model", [f"{samples}/*"], tasks=tasks, part_rows=3)
    night = {"n": 0}

    def answer(request):
        if request.task.name == "invoice":
            total = "lots" if night["n"] == 0 else 10.0 * night["n"]
            return json.dumps({"total": total, "paid": night["n"] % 2 == 0}), "stop"
        return f"night {night['n']}", "stop"

    for n, prompt in enumerate(["Notes.", "Notes, again.", "Notes, again."]):
        night["n"] = n
        fields["tasks"][1]["prompt"] = prompt
        job = write_job(fields)
        run_job(load_job(job), engine_factory=lambda job, prompts: ScriptedEngine(answer),
                prompts_factory=fake_prompts, retry_errors=n >= 1)
    return tmp_path / "out"


def _snapshot(out):
    glob = str(out / "results" / "*.parquet")
    return {
        "rows": {kind: pl.read_parquet(out / kind / "*.parquet").height
                 for kind in ("results", "pages", "fields/invoice")},
        "current": duckdb.sql(CURRENT.format(glob=glob)).fetchall(),
        "current_polars": (pl.read_parquet(glob).sort("finished_at")
                           .group_by("source", "page", "task").last()
                           .select("source", "page", "task", "output").sort("source", "page", "task")),
    }


def test_compaction_keeps_every_row_and_the_current_answers(nightly_output):
    out = nightly_output
    before = _snapshot(out)
    parts_before = len(list((out / "results").glob("*.parquet")))
    assert parts_before > 4 and before["rows"]["results"] == 28
    assert {row[3] for row in before["current"]} == {"ok"}
    all_rows = pl.read_parquet(out / "results" / "*.parquet").sort("finished_at", "source", "page", "task")

    tables = {t.table: t for t in compact_output(out)}
    assert tables["results"].parts_after == 1 and tables["results"].parts_before == parts_before
    assert {t.rows_before == t.rows_after for t in tables.values()} == {True}
    after = _snapshot(out)
    assert after["rows"] == before["rows"] and after["current"] == before["current"]
    assert after["current_polars"].equals(before["current_polars"])
    again = pl.read_parquet(out / "results" / "*.parquet").sort("finished_at", "source", "page", "task")
    assert again.equals(all_rows)  # every column of every row, types included
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != ".lock"]

    tables = {t.table: t for t in compact_output(out, current=True)}
    current = _snapshot(out)
    assert current["current"] == before["current"]
    assert current["rows"]["results"] == len(before["current"]) == 14
    assert current["rows"]["pages"] == 7 and current["rows"]["fields/invoice"] == 7
    fields = pl.read_parquet(out / "fields" / "invoice" / "*.parquet")
    assert fields.schema["total"] == pl.Float64 and fields.schema["paid"] == pl.Boolean


def test_a_run_after_compaction_resumes_from_the_compacted_parts(nightly_output, samples):
    out = nightly_output
    compact_output(out, current=True)
    job = load_job(out.parent / "job.yaml")
    engine = ScriptedEngine(lambda r: ("x", "stop"))
    stats = run_job(job, engine_factory=lambda job, prompts: engine, prompts_factory=fake_prompts)
    assert stats.requests_total == 0 and not engine.requests


def test_readers_during_compaction_see_the_old_parts_or_the_new_never_both(nightly_output):
    out = nightly_output
    old = {p.name for p in (out / "results").glob("*.parquet")}
    rows = pl.read_parquet(out / "results" / "*.parquet").height
    seen, problems, stop = [], [], threading.Event()

    def read() -> None:
        while not stop.is_set():
            names = {p.name for p in (out / "results").glob("*.parquet")}
            if names != old and not (len(names) == 1 and not names & old):
                problems.append(sorted(names))
            try:  # a listing then an open may meet the swap: then read again
                total = sum(pq.ParquetFile(out / "results" / n).metadata.num_rows for n in names)
            except FileNotFoundError:
                continue
            seen.append(names == old)
            if total != rows:
                problems.append(total)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(3):
            compact_output(out, rows_per_part=1_000)
    finally:
        stop.set()
        reader.join()
    assert not problems and seen and not seen[-1]


def test_compaction_waits_for_no_run_and_leaves_nothing_half_done(nightly_output):
    out = nightly_output
    folder = OutputFolder(out)
    with folder.lock():
        with pytest.raises(OutputLocked):
            compact_output(out)
        result = run_cli("compact", str(out))
        assert result.returncode == 75 and "another run holds" in result.stderr
    stale = out / ".results.compact20260101T000000Z"  # what a killed compaction leaves
    stale.mkdir()
    (stale / "part-x-00000.parquet").write_bytes(b"half")
    result = run_cli("compact", str(out))
    assert result.returncode == 0, result.stderr
    assert "results" in result.stdout and not stale.exists()
    assert run_cli("compact", str(out.parent / "nothing")).returncode == 3
