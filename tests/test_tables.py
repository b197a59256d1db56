"""The output tables over several nights: exactly the current row per key (vanished, moved,
shortened and broken files retired; A -> B -> A back to A from the cache; fields never ahead
of results), history by version, readers during commits and compaction, a damaged table
(exit 3, nothing written), and the migration of a folder of the earlier parts layout."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import polars as pl
import pytest
from deltalake import DeltaTable

import oddfiles
from conftest import ROOT, job_fields, run_cli
from fakes import ScriptedEngine, fake_prompts
from vlbatch.job import load_job
from vlbatch.run import run_job

KEY = ["source", "page", "task"]


def night(job_path: Path, answer=None):
    """One night's run with a scripted engine (the engine is not the subject here)."""
    engine = ScriptedEngine(answer or (lambda r: (
        json.dumps({"paid": r.image.width % 2 == 0}) if r.task.name == "flags"
        else f"{r.text} / {r.image.width}x{r.image.height}", "stop")))
    stats = run_job(load_job(job_path), engine_factory=lambda j, p: engine,
                    prompts_factory=fake_prompts)
    return stats, engine


def tables(out: Path) -> dict[str, pl.DataFrame]:
    found = {"results": pl.read_delta(str(out / "results")),
             "pages": pl.read_delta(str(out / "pages"))}
    if (out / "fields" / "flags").exists():
        found["flags"] = pl.read_delta(str(out / "fields" / "flags"))
    return found


def assert_consistent(t: dict[str, pl.DataFrame]) -> None:
    """One row a key in every table; every result row has its page row; every typed row is
    the results table's current ok answer of its key."""
    results = t["results"]
    assert not results.select(KEY).is_duplicated().any()
    assert not t["pages"].select("source", "page").is_duplicated().any()
    assert results.join(t["pages"], on=["source", "page"], how="anti", nulls_equal=True).height == 0
    if "flags" in t:
        ok = results.filter(pl.col("task") == "flags", pl.col("status") == "ok")
        assert t["flags"].join(ok, on=KEY, how="anti", nulls_equal=True).height == 0
        assert not t["flags"].select(KEY).is_duplicated().any()


@pytest.fixture
def archive(tmp_path, write_job):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    oddfiles.pdf(docs / "a.pdf", pages=2, text="file a")
    oddfiles.pdf(docs / "b.pdf", pages=3, text="file b")
    oddfiles.pdf(docs / "c.pdf", pages=1, text="file c")
    shutil.copy(ROOT / "data" / "samples" / "chart.jpg", docs / "d.jpg")
    fields = job_fields("fake-model", ["docs/*", "docs/sub/*"])
    fields["tasks"].append({"name": "flags", "prompt": "Paid?", "max_tokens": 20,
                            "fields": {"paid": "boolean"}})
    return docs, write_job(fields), tmp_path / "out"


def test_deleted_moved_shortened_and_broken_files_leave_no_current_rows(archive):
    docs, job, out = archive
    night(job)
    first = tables(out)
    assert first["results"].height == 7 * 3 and first["flags"].height == 7
    assert_consistent(first)

    (docs / "c.pdf").unlink()  # deleted
    shutil.move(docs / "d.jpg", docs / "sub" / "d.jpg")  # moved: same bytes, new path
    oddfiles.pdf(docs / "b.pdf", pages=1, text="file b")  # shortened (and changed)
    oddfiles.random_bytes(docs / "a.pdf")  # unreadable now
    stats, engine = night(job)
    now = tables(out)
    assert_consistent(now)
    results = now["results"]
    by_file = {Path(s).name: sorted(g["page"].to_list(), key=lambda p: p or 0)
               for (s,), g in results.group_by("source")}
    assert set(by_file) == {"a.pdf", "b.pdf", "d.jpg"}
    assert by_file["a.pdf"] == [None] * 3  # its page-null error rows, nothing else
    assert (results.filter(pl.col("source").str.ends_with("a.pdf"))["status"] == "error").all()
    assert by_file["b.pdf"] == [1] * 3
    moved = results.filter(pl.col("source").str.ends_with("d.jpg"))
    assert moved["matched_path"].unique().to_list() == ["docs/sub/d.jpg"]
    assert moved["cached"].all()  # from the result cache, not generated again
    # b's one page is its old first page: nothing new to generate this night
    assert not engine.requests and stats.cache_hits == 6
    assert stats.rows_retired == (2 + 1 + 2 + 1) * 3  # a's pages, c, b's pages 2-3, old d
    # the typed rows follow: none for the broken file, b's one page, the moved file's
    assert sorted(Path(s).name for s in now["flags"]["source"]) == ["b.pdf", "d.jpg"]
    assert now["results"]["status"].value_counts().filter(pl.col("status") == "ok")["count"][0] == 6
    # every earlier row is still in the history: version 0 is the first night
    v0 = pl.read_delta(str(out / "results"), version=0)
    assert v0.sort(KEY).equals(first["results"].sort(KEY))

    # the broken file mended: its error rows retired, its pages back
    oddfiles.pdf(docs / "a.pdf", pages=2, text="file a")
    night(job)
    again = tables(out)
    assert_consistent(again)
    a = again["results"].filter(pl.col("source").str.ends_with("a.pdf"))
    assert sorted(a["page"].to_list()) == [1, 1, 1, 2, 2, 2] and (a["status"] == "ok").all()


def test_a_prompt_changed_and_changed_back_gives_the_first_answers_from_the_cache(
        archive, write_job):
    docs, job, out = archive
    fields = job_fields("fake-model", ["docs/*"])

    def with_prompt(prompt: str) -> Path:
        fields["tasks"][0]["prompt"] = prompt
        return write_job(fields)

    night(with_prompt("A"))
    a_rows = tables(out)["results"].filter(pl.col("task") == "describe")
    night(with_prompt("B"))
    b_rows = tables(out)["results"].filter(pl.col("task") == "describe")
    assert (b_rows["output"].str.starts_with("B")).all()
    stats, engine = night(with_prompt("A"))
    back = tables(out)["results"].filter(pl.col("task") == "describe")
    assert_consistent(tables(out))
    assert back.height == a_rows.height
    assert back.sort(KEY)["output"].to_list() == a_rows.sort(KEY)["output"].to_list()
    assert back["cached"].all() and not any(r.task.name == "describe" for r in engine.requests)
    assert stats.cache_hits == back.height


def test_an_answer_that_now_fails_takes_its_typed_row_away(archive):
    docs, job, out = archive
    night(job)
    assert tables(out)["flags"].height == 7
    oddfiles.pdf(docs / "c.pdf", pages=1, text="file c, second edition")  # changed
    night(job, lambda r: ("not json", "stop") if r.task.name == "flags" else ("text", "stop"))
    now = tables(out)
    assert_consistent(now)
    c = now["results"].filter(pl.col("source").str.ends_with("c.pdf"), pl.col("task") == "flags")
    assert c["status"].to_list() == ["error"]
    assert now["flags"].height == 6 and not now["flags"]["source"].str.ends_with("c.pdf").any()


def test_readers_see_one_version_or_the_next_during_commits_and_compaction(archive):
    """A reader in a loop while a night commits flush after flush, and while compaction
    rewrites the files: every read is exactly one version's rows."""
    docs, job, out = archive
    for i in range(12):
        oddfiles.pdf(docs / f"more-{i:02d}.pdf", pages=1, text=f"more {i}")
    fields = job_fields("fake-model", ["docs/*", "docs/sub/*"], part_rows=2)
    job = job.parent / "small-flushes.yaml"
    job.write_text(json.dumps(fields))
    night(job)  # the table exists
    seen, stop, failures = [], threading.Event(), []

    def digest(frame: pl.DataFrame) -> tuple[int, int]:
        """Which rows a read holds: their number and an order-free sum of their hashes."""
        return frame.height, int(frame.select(*KEY, "run_id", "output").hash_rows(seed=1).sum())

    def read() -> None:
        while not stop.is_set():
            try:
                table = DeltaTable(str(out / "results"))
                frame = pl.from_arrow(table.to_pyarrow_table())
                seen.append((table.version(), digest(frame), frame.select(KEY).is_duplicated().any()))
            except Exception as e:  # noqa: BLE001 - a failed read is the finding
                failures.append(repr(e))

    def reading_while(work) -> None:
        stop.clear()
        reader = threading.Thread(target=read)
        reader.start()
        try:
            work()
        finally:
            stop.set()
            reader.join()

    def edited_night() -> None:  # changed files: its flushes replace rows
        for i in range(12):
            oddfiles.pdf(docs / f"more-{i:02d}.pdf", pages=1, text=f"more {i}, edited")
        night(job)

    def compact() -> None:  # the default retention: no file a recent version reads goes
        result = run_cli("compact", str(out))
        assert result.returncode == 0, result.stderr[-2000:]

    reading_while(edited_night)
    latest = DeltaTable(str(out / "results")).version()
    versions = {v: digest(pl.read_delta(str(out / "results"), version=v)) for v in range(latest + 1)}
    during_night = len(seen)
    reading_while(compact)
    assert not failures, failures[:3]
    assert during_night > 3 and len(seen) > during_night and not any(d for _, _, d in seen)
    final = digest(pl.read_delta(str(out / "results")))
    for version, rows, _ in seen:  # each read: exactly the rows of the version it read
        assert rows == versions.get(version, final), (version, rows)
    assert len({v for v, _, _ in seen}) > 2  # reads fell on several versions
    final = tables(out)
    assert_consistent(final)
    assert final["results"].height == (7 + 12) * 2  # the flags task is not in this job


@pytest.mark.parametrize("damage", ["data file deleted", "log truncated"])
def test_a_damaged_table_is_exit_3_naming_it_and_nothing_is_written(archive, damage):
    docs, job, out = archive
    night(job)
    results = out / "results"
    if damage == "data file deleted":
        next(results.glob("*.parquet")).unlink()
    else:
        log = sorted((results / "_delta_log").glob("*.json"))[-1]
        log.write_text(log.read_text()[:40])
    before = sorted((p.name, p.stat().st_size) for p in results.rglob("*"))
    manifests = list((out / "_runs").glob("*.json"))
    result = run_cli("run", str(job))
    assert result.returncode == 3, result.stderr[-2000:]
    assert str(results) in result.stderr and "Traceback" not in result.stderr
    assert sorted((p.name, p.stat().st_size) for p in results.rglob("*")) == before
    assert list((out / "_runs").glob("*.json")) == manifests
    assert run_cli("inspect", str(out)).returncode == 3


def test_a_folder_of_the_earlier_parts_layout_is_migrated_every_row_kept(tmp_path, write_job):
    """tests/data/legacy-output was written by the parts layout (two runs: the second with
    another prompt for one task; a schema task): converted once, history first."""
    out = tmp_path / "out"
    shutil.copytree(ROOT / "tests" / "data" / "legacy-output", out)
    old = pl.read_parquet(out / "results" / "part-*.parquet")
    newest = old.sort("finished_at").group_by(KEY).last()
    result = run_cli("migrate", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert not list((out / "results").glob("part-2026*.parquet"))
    current = pl.read_delta(str(out / "results"))
    assert current.select(sorted(old.columns)).sort(KEY).equals(
        newest.select(sorted(old.columns)).sort(KEY).with_columns(
            pl.col("finished_at").cast(pl.Datetime("us", "UTC"))))
    # every row ever written is in the history: one version a run
    table = DeltaTable(str(out / "results"))
    assert table.version() == 1
    v0 = pl.read_delta(str(out / "results"), version=0)
    assert v0.height + (current.height - v0.join(current, on=["run_id", *KEY]).height) \
        == old.height
    flags = pl.read_delta(str(out / "fields" / "flags"))
    assert flags.height == 3 and flags["paid"].all()
    report = json.loads(run_cli("inspect", str(out), "--json").stdout)
    assert [v["action"] for v in report["versions"]] == ["migrate", "migrate"]
    assert report["current"]["rows"] == current.height == 6
    assert run_cli("migrate", str(out)).stdout.startswith(str(out))  # nothing left to do

    # a run into it: its inputs are elsewhere now, so the migrated rows are retired
    docs = tmp_path / "docs"
    docs.mkdir()
    oddfiles.pdf(docs / "new.pdf", pages=1)
    job = write_job(job_fields("fake-model", ["docs/*"]))
    night(job)
    assert set(pl.read_delta(str(out / "results"))["source"]) == {str(docs / "new.pdf")}


def test_a_run_migrates_by_itself_and_resumes_from_the_migrated_rows(tmp_path, write_job):
    out = tmp_path / "out"
    shutil.copytree(ROOT / "tests" / "data" / "legacy-output", out)
    (out / ".results.migrating").mkdir()  # what a killed migration left: removed
    docs = tmp_path / "docs"
    docs.mkdir()
    oddfiles.pdf(docs / "x.pdf", pages=1)
    night(write_job(job_fields("fake-model", ["docs/*"])))
    assert DeltaTable(str(out / "results")).history()[-1]["vlbatch.action"] == "migrate"
    assert not (out / ".results.migrating").exists()


WRITER = """
import sys
from datetime import datetime, timezone
from vlbatch.output.schemas import RESULT_KEY, RESULT_SCHEMA
from vlbatch.output.table import TableWriter

writer = TableWriter(sys.argv[1], "big-flush", RESULT_SCHEMA, RESULT_KEY, max_rows=10**9,
                     known=lambda row: False)
now = datetime.now(timezone.utc)
for i in range(int(sys.argv[2])):
    writer.add(dict(source=f"/big/{i}.pdf", page=1, task="describe", output="x" * 300,
                    status="ok", run_id="big-flush", finished_at=now))
print("flushing", flush=True)
writer.flush()
"""


DIES_AT_FIRST_REQUEST = """
import os, sys
sys.path.insert(0, "tests")
from fakes import ScriptedEngine, fake_prompts
from vlbatch.job import load_job
from vlbatch.run import run_job
run_job(load_job(sys.argv[1]), engine_factory=lambda j, p: ScriptedEngine(lambda r: os._exit(9)),
        prompts_factory=fake_prompts)
"""


def test_a_night_killed_before_its_first_answer_shows_no_row_of_a_gone_file_or_page(archive):
    """What no input stands behind any more is retired before the night generates: a night
    killed (SIGKILL, power loss) before it ends leaves no row of a deleted file or of a
    shortened file's lost pages in the current view, only rows still to do."""
    import subprocess
    import sys

    docs, job, out = archive
    night(job)
    (docs / "c.pdf").unlink()
    oddfiles.pdf(docs / "b.pdf", pages=1, text="file b")  # its first page only
    oddfiles.pdf(docs / "e.pdf", pages=1, text="file e")  # new: to generate
    died = subprocess.run([sys.executable, "-c", DIES_AT_FIRST_REQUEST, str(job)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert died.returncode == 9, died.stderr[-2000:]
    now = tables(out)
    assert_consistent(now)
    pages = {(Path(s).name, p) for s, p in now["results"].select("source", "page").rows()}
    assert pages == {("a.pdf", 1), ("a.pdf", 2), ("b.pdf", 1), ("d.jpg", 1)}
    assert {(Path(s).name, p) for s, p in now["pages"].select("source", "page").rows()} == pages
    night(job)  # the next night does the rest
    done = tables(out)
    assert_consistent(done)
    assert {Path(s).name for s in done["results"]["source"]} == {"a.pdf", "b.pdf", "d.jpg", "e.pdf"}


def test_sigkill_between_a_flushs_data_files_and_its_commit_leaves_the_last_version(
        archive, tmp_path):
    """A real SIGKILL of a process in the middle of a large flush, once its data files are
    on disk and before its commit: readers and the next run see the last version, whole,
    and compaction vacuums what the dead flush left."""
    import signal
    import subprocess
    import sys
    import time

    docs, job, out = archive
    night(job)
    results = out / "results"
    before = pl.read_delta(str(results))
    version = DeltaTable(str(results)).version()
    files = set(results.glob("*.parquet"))
    log_entries = set((results / "_delta_log").glob("*.json"))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(results), "1500000"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "flushing"
    deadline = time.monotonic() + 120
    while not (set(results.iterdir()) - files - {results / "_delta_log"}):
        assert proc.poll() is None, "the flush ended before it wrote a data file"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert set((results / "_delta_log").glob("*.json")) == log_entries, "it committed first"
    assert set(results.iterdir()) - files - {results / "_delta_log"}  # the dead flush's files
    assert DeltaTable(str(results)).version() == version
    assert pl.read_delta(str(results)).sort(KEY).equals(before.sort(KEY))

    stats, _ = night(job)  # the next run: nothing to do, nothing lost
    assert stats.pages_todo == 0
    assert pl.read_delta(str(results)).sort(KEY).equals(before.sort(KEY))
    result = run_cli("compact", str(out), "--retain-days", "0")
    assert result.returncode == 0, result.stderr[-2000:]
    assert {p.name for p in results.iterdir() if p.name != "_delta_log"} == \
        {Path(u).name for u in DeltaTable(str(results)).file_uris()}


def test_a_run_killed_between_the_pages_commit_and_the_results_commit_leaves_one_row_a_key(
        archive):
    """Pages and typed rows are committed before their results (a reader never sees a result
    without its page): a run killed between the two leaves page and fields rows whose results
    never landed. The next run does those pages again and replaces them, never adds a second."""
    docs, job, out = archive
    night(job)
    c = str(docs / "c.pdf")
    DeltaTable(str(out / "results")).delete(f"source = '{c}'")  # what the kill left
    stats, engine = night(job)
    assert stats.pages_todo == 1 and len(engine.requests) == 0  # from the result cache
    now = tables(out)
    assert_consistent(now)
    assert now["pages"].filter(pl.col("source") == c).height == 1
    assert now["flags"].filter(pl.col("source") == c).height == 1


def test_a_task_taken_out_of_the_job_retires_its_rows_and_put_back_comes_from_the_cache(
        archive, write_job):
    """The current view is what the current job asks: a task taken out retires its results
    rows (and its typed rows), a schema task that loses its fields empties its fields table,
    and a task put back gets its answers from the result cache."""
    docs, job, out = archive
    fields = job_fields("fake-model", ["docs/*", "docs/sub/*"])
    fields["tasks"].append({"name": "flags", "prompt": "Paid?", "max_tokens": 20,
                            "fields": {"paid": "boolean"}})
    night(write_job(fields))
    first = tables(out)
    assert set(first["results"]["task"]) == {"describe", "json", "flags"}
    assert first["flags"].height == 7

    fewer = dict(fields, tasks=[fields["tasks"][0]])  # only "describe" now
    stats, engine = night(write_job(fewer))
    now = tables(out)
    assert_consistent(now)
    assert set(now["results"]["task"]) == {"describe"} and now["results"].height == 7
    assert now["flags"].height == 0  # no typed row of a task the job does not ask
    assert stats.rows_retired == 2 * 7 and not engine.requests
    v0 = pl.read_delta(str(out / "results"), version=0)  # the history keeps every row
    assert v0.sort(KEY).equals(first["results"].sort(KEY))

    stats, engine = night(write_job(fields))  # put back: from the result cache
    back = tables(out)
    assert_consistent(back)
    assert back["results"].sort(KEY).drop("cached", "run_id", "finished_at").equals(
        first["results"].sort(KEY).drop("cached", "run_id", "finished_at"))
    assert back["flags"].height == 7 and not engine.requests

    plain = json.loads(json.dumps(fields))  # "flags" loses its fields: a plain task now
    del plain["tasks"][2]["fields"]
    night(write_job(plain))
    assert tables(out)["flags"].height == 0
    assert_consistent(tables(out))
