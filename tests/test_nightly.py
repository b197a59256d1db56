"""Nightly semantics: kill and resume a real run, incremental runs, the README's queries,
the error-budget exit code and `vlbatch inspect`."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import polars as pl

import make_pages
import oddfiles
from conftest import ROOT, job_fields, run_cli
from fakes import FakeEngine, fake_prompts
from vlbatch.job import load_job
from vlbatch.run import run_job

KEY = ["source", "page", "task"]


def one_request_at_a_time(tiny_model, write_job, tmp_path, pages: int, part_rows: int):
    """A job over generated PDFs that the real engine answers one request at a time: a
    window to stop it in."""
    make_pages.main(tmp_path / "docs", pages, per_pdf=8)
    fields = job_fields(tiny_model, ["docs/*.pdf"], part_rows=part_rows, part_seconds=600)
    fields["engine"]["max_in_flight"] = 1
    for task in fields["tasks"]:
        task["max_tokens"] = 24
    return write_job(fields)


def test_kill_and_resume_exactly_once(tiny_model, write_job, tmp_path):
    job = one_request_at_a_time(tiny_model, write_job, tmp_path, 40, part_rows=4)
    results = tmp_path / "out" / "results"
    proc = subprocess.Popen([sys.executable, "-m", "vlbatch", "run", str(job)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while len(list(results.glob("part-*.parquet"))) < 3 and proc.poll() is None:
        assert time.monotonic() < deadline, "no results part appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    first = pl.read_delta(str(results))
    assert 0 < first.height < 80 and (tmp_path / "out" / ".lock").exists()
    pages = pl.read_delta(str(tmp_path / "out" / "pages"))
    assert first.join(pages, on=["source", "page"], how="anti").height == 0  # pages go first
    # what a death between writing a flush's data file and its commit leaves: a data file
    # no version names (and a commit never renamed into place); a half-written manifest
    orphan = results / "part-00099-dead-c000.snappy.parquet"
    for path in (orphan, results / "_delta_log" / "_commit_dead.json.tmp"):
        path.write_bytes(b"PAR1 half")
    half_manifest = tmp_path / "out" / "_runs" / ".dead.json.tmp"
    half_manifest.write_text("{")

    resumed = run_cli("run", str(job))  # the dead run's lock is taken over
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not half_manifest.exists()
    df = pl.read_delta(str(results))
    assert df.height == 80 and not df.select(KEY).is_duplicated().any()  # each key once
    assert (df["status"] == "ok").all()
    second = df.filter(pl.col("run_id") != first["run_id"][0])
    assert second.join(first, on=KEY).height == 0  # finished rows not done again
    manifest = json.loads((tmp_path / "out" / "_runs" / f"{second['run_id'][0]}.json").read_text())
    summary = manifest["summary"]
    assert summary["pages_already_done"] >= first.height // 2 - 1
    # answers finished but not yet written when killed come from the result cache
    assert summary["generated"] + summary["cache_hits"] + summary["copied"] == second.height
    # compaction vacuums the data file no commit names; the rows stay the same
    compacted = run_cli("compact", str(tmp_path / "out"), "--retain-days", "0")
    assert compacted.returncode == 0, compacted.stderr[-2000:]
    assert not orphan.exists() and pl.read_delta(str(results)).sort(KEY).equals(df.sort(KEY))


def test_sigterm_writes_the_finished_rows_and_the_next_run_completes(tiny_model, write_job,
                                                                    tmp_path):
    """A real SIGTERM mid-run: exit 143, every answer finished so far written (though no
    part was due), manifest 'interrupted'; the next run does only the rest, each key once."""
    import diskcache

    job = one_request_at_a_time(tiny_model, write_job, tmp_path, 24, part_rows=10_000)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "vlbatch", "run", str(job)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    answers = tmp_path / "cache" / "default" / "results"
    deadline = time.monotonic() + 300
    seen = 0
    while seen < 6 and proc.poll() is None:  # answers reach the result cache as they finish
        assert time.monotonic() < deadline, "no answers appeared"
        time.sleep(0.1)
        if answers.exists():
            with diskcache.Cache(str(answers)) as cache:
                seen = len(cache)
    assert not list((out / "results").glob("part-*.parquet")), "a part was written early"
    proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        exited = proc.poll()  # None: vlbatch itself still runs; else a child holds stderr
        proc.kill()
        try:
            stderr = proc.communicate(timeout=10)[1]
        except subprocess.TimeoutExpired:
            stderr = "(still held open by a child process)"
        raise AssertionError(f"no end 120 s after SIGTERM (exit code then: {exited}); "
                             f"stderr: {stderr[-3000:]}") from None
    assert proc.returncode == 143, stderr[-2000:]
    assert "interrupted by SIGTERM" in stderr and "Traceback" not in stderr
    # closing the engine with a request in it is the shutdown, not a death: no second engine
    assert "starting a new one" not in stderr and "engine failed" not in stderr, stderr[-2000:]
    first = pl.read_delta(str(out / "results"))
    assert seen <= first.height < 48 and (first["status"] == "ok").all()
    manifest = json.loads(next((out / "_runs").glob("*.json")).read_text())
    assert manifest["status"] == "interrupted" and manifest["summary"]["engine_restarts"] == 0

    resumed = run_cli("run", str(job))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    df = pl.read_delta(str(out / "results"))
    assert df.height == 48 and not df.select(KEY).is_duplicated().any()
    assert (df["status"] == "ok").all()


def test_an_output_whose_results_folder_cannot_be_written_is_exit_3(samples, write_job,
                                                                   tmp_path):
    job = write_job(job_fields("no-model-needed", [f"{samples}/chart.jpg"]))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results").write_text("a file where the folder goes")
    result = run_cli("run", str(job))
    assert result.returncode == 3 and "not writable" in result.stderr, result.stderr[-1000:]
    assert "internal error" not in result.stderr


def test_incremental_run_generates_only_new_and_changed(write_job, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("a", "b", "c"):
        oddfiles.pdf(docs / f"{name}.pdf", pages=2, text=f"file {name}")
    job = write_job(job_fields("fake-model", ["docs/*.pdf"]))

    def run() -> FakeEngine:
        engine = FakeEngine()
        run_job(load_job(job), engine_factory=lambda j, p: engine, prompts_factory=fake_prompts)
        return engine

    assert len(run().requests) == 12
    oddfiles.pdf(docs / "b.pdf", pages=2, text="file b, second edition")  # changed
    oddfiles.pdf(docs / "d.pdf", pages=1, text="file d")  # new
    engine = run()
    assert sorted({r.text for r in engine.requests}) and len(engine.requests) == 6
    current = pl.read_delta(str(tmp_path / "out" / "results"))
    assert current.select(KEY).unique().height == current.height == 14
    changed = current.filter(pl.col("source").str.ends_with("b.pdf"))
    assert changed["run_id"].n_unique() == 1 and changed["run_id"][0] != current["run_id"].min()
    # the first edition's rows stay in the table's history
    first = pl.read_delta(str(tmp_path / "out" / "results"), version=0)
    assert first.height == 12 and first.filter(pl.col("source").str.ends_with("b.pdf")).height == 4


def readme_block(language: str, containing: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return next(b for b in blocks if containing in b)


def test_readme_queries_as_written(samples, write_job, tmp_path, monkeypatch):
    job = write_job(job_fields("fake-model", [f"{samples}/*"], output="out/demo"))
    for prompt in ("first", "second"):  # two answers for every key: the newest is current
        fields = job_fields("fake-model", [f"{samples}/*"], output="out/demo")
        fields["tasks"][0]["prompt"] = prompt
        job = write_job(fields)
        run_job(load_job(job), engine_factory=lambda j, p: FakeEngine(),
                prompts_factory=fake_prompts)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(readme_block("python", "pl.scan_delta(\"out/demo/results\")"), scope)
    current = scope["current"]
    # the table as it is: one row a key, the second prompt's answers (no newest-row step)
    assert current.height == 14 and not current.select(KEY).is_duplicated().any()
    assert current["task_hash"].n_unique() == 2 and current["run_id"].n_unique() == 2
    second_run = sorted(current["run_id"].unique())[1]
    assert (current.filter(pl.col("task") == "describe")["run_id"] == second_run).all()
    assert scope["ok_by_task"]["len"].sum() == 14

    exec(readme_block("python", "import duckdb"), scope)
    from_duckdb = scope["current"]
    expected = current.group_by("task", "status").len("rows")
    assert from_duckdb.sort("task").select("task", "status", pl.col("rows").cast(pl.UInt32)).equals(
        expected.sort("task"))


def test_error_budget_exit_4_and_inspect(write_job, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    oddfiles.random_bytes(docs / "x.pdf")
    oddfiles.truncated_png(docs / "y.png")
    job = write_job(job_fields("no-model-needed", ["docs/*"], max_error_rate=0.5))
    result = run_cli("run", str(job))
    assert result.returncode == 4 and "over max_error_rate" in result.stderr
    assert "rows error" in result.stdout  # the summary, though the run failed its budget
    manifest = json.loads(next((tmp_path / "out" / "_runs").glob("*.json")).read_text())
    assert manifest["status"] == "error_budget_exceeded" and "over max_error_rate" in manifest["reason"]
    report = json.loads(run_cli("inspect", str(tmp_path / "out"), "--json").stdout)
    assert report["current"] == {"rows": 4, "ok": 0, "error": 4, "transient": 0, "sources": 2,
                                 "pages": 2, "version": 0}
    assert len(report["runs"]) == 1 and report["runs"][0]["rows_error"] == 4
    assert sum(e["rows"] for e in report["top_errors"]) == 4
    assert "pages" not in report and all(set(r) == {"task", "status", "error_kind", "rows"}
                                         for r in report["by_task"])
    assert (tmp_path / "out" / ".lock").read_text() == ""  # the run is over: no holder named
    table = run_cli("inspect", str(tmp_path / "out"))
    assert table.returncode == 0 and "top error reasons" in table.stdout
    assert run_cli("cache", "stats", "--cache-dir", str(tmp_path / "nowhere")).returncode == 3


def test_without_a_terminal_progress_never_goes_quiet_longer_than_its_interval(caplog):
    """No row for a while (the engine starting): a line comes every interval all the same."""
    import io

    from rich.console import Console

    from vlbatch.pipeline.sink import RunStats
    from vlbatch.report import ProgressReporter

    with caplog.at_level("INFO", logger="vlbatch"):
        with ProgressReporter(Console(file=io.StringIO()), interval_s=0.3) as progress:
            progress.watch(RunStats(run_id="r", pages_todo=5))
            time.sleep(1.6)  # no row at all
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pages 0/5")]
    assert 3 <= len(lines) <= 6
