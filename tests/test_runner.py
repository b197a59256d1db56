"""The run around the engine, with a fake engine that counts requests: re-runs, new and
changed tasks, duplicates, the result cache, failures and the error budget."""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import pytest

import oddfiles
from conftest import job_fields
from fakes import FakeEngine, fake_prompts
from vlbatch.errors import ErrorBudgetExceeded, JobCannotRunError
from vlbatch.job import load_job
from vlbatch.run import run_job


def run(job_path, engine=None, **kwargs):
    engine = engine or FakeEngine()
    stats = run_job(load_job(job_path, **{k: kwargs.pop(k) for k in ("output", "cache") if k in kwargs}),
                    engine_factory=lambda job, prompts: engine, prompts_factory=fake_prompts,
                    **kwargs)
    return stats, engine


def results(job_path, output="out"):
    return pl.read_delta(str(job_path.parent / output / "results"))


def test_rerun_new_task_changed_prompt_and_cache(samples, write_job, tmp_path):
    fields = job_fields("fake-model", [f"{samples}/*"])
    job = write_job(fields)
    stats, engine = run(job)
    # 7 pages (3 PDF pages, 4 images of which one is an exact copy) x 2 tasks
    assert stats.pages_total == 7 and stats.rows_ok == 14
    assert len(engine.requests) == 12 and stats.copied == 2 and stats.exact_copies == 1
    first = results(job)
    copy_rows = first.filter(pl.col("source").str.ends_with("receipt.png"))
    assert copy_rows["cached"].all() and copy_rows["reused_from"].str.ends_with("receipt-copy.png#1").all()

    stats, engine = run(job)  # identical re-run: nothing generated, no rows written
    assert len(engine.requests) == 0 and stats.pages_already_done == 7
    assert results(job).height == 14

    fields["tasks"].append({"name": "third", "prompt": "A third question."})
    stats, engine = run(write_job(fields))  # a new task: only that task
    assert {r.task.name for r in engine.requests} == {"third"} and len(engine.requests) == 6
    fields["tasks"][0]["prompt"] = "Describe this page differently."
    stats, engine = run(write_job(fields))  # a changed prompt: only that task again
    assert {r.task.name for r in engine.requests} == {"describe"}
    current = results(job).sort("finished_at").group_by("source", "page", "task").last()
    assert current.height == 21 and (current["status"] == "ok").all()

    # a new output folder with the same cache: everything served from the cache
    stats, engine = run(job, output=str(tmp_path / "out2"))
    assert len(engine.requests) == 0 and stats.cache_hits > 0
    fresh = pl.read_delta(str(tmp_path / "out2" / "results"))
    assert fresh.height == 21 and fresh["cached"].all()
    joined = fresh.join(current, on=["source", "page", "task"])
    assert (joined["output"] == joined["output_right"]).all()


def test_result_cache_keys_hold_the_model_and_its_numerics(samples, tmp_path):
    """A dummy-weights run never serves a real one, a dtype change regenerates, and two job
    folders whose `models/x` differ never share answers (the same files do)."""
    import json
    import yaml

    def folder_job(name: str, config: dict, **engine) -> Path:
        folder = tmp_path / name
        (folder / "models" / "x").mkdir(parents=True)
        (folder / "models" / "x" / "config.json").write_text(json.dumps(config))
        fields = job_fields("models/x", [f"{samples}/*.pdf"], output="out",
                            cache=str(tmp_path / "shared-cache"))
        fields["engine"].update(engine)
        (folder / "job.yaml").write_text(yaml.safe_dump(fields))
        return folder / "job.yaml"

    real = folder_job("a", {"hidden_size": 8})
    stats, engine = run(folder_job("a-dummy", {"hidden_size": 8}, load_format="dummy"))
    generated = len(engine.requests)
    assert generated > 0
    stats, engine = run(real)  # same files, real weights: nothing from the dummy run
    assert stats.cache_hits == 0 and len(engine.requests) == generated
    stats, engine = run(folder_job("a-copy", {"hidden_size": 8}))  # same files elsewhere
    assert stats.cache_hits == generated and len(engine.requests) == 0
    stats, engine = run(folder_job("a-half", {"hidden_size": 8}, dtype="float16"))
    assert stats.cache_hits == 0 and len(engine.requests) == generated
    stats, engine = run(folder_job("b", {"hidden_size": 16}))  # another models/x
    assert stats.cache_hits == 0 and len(engine.requests) == generated


def test_changed_model_files_or_render_settings_regenerate_in_the_same_output(samples, tmp_path):
    import json
    import os
    import yaml

    model = tmp_path / "models" / "x"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (model / "model.safetensors").write_bytes(b"weights v1")
    fields = job_fields("models/x", [f"{samples}/chart.jpg"])
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(fields))
    stats, engine = run(job)
    assert len(engine.requests) == 2 and stats.rows_stale == 0
    stats, engine = run(job)
    assert stats.pages_todo == 0  # nothing changed
    (model / "model.safetensors").write_bytes(b"weights v2")  # weights replaced in place
    os.utime(model / "model.safetensors", ns=(1, 1))
    stats, engine = run(job)
    assert len(engine.requests) == 2 and stats.rows_stale == 2 and stats.cache_hits == 0
    fields["render"]["dpi"] = 96
    job.write_text(yaml.safe_dump(fields))
    stats, engine = run(job)
    assert stats.pages_todo == 1 and stats.rows_stale == 2
    current = results(job).sort("finished_at").group_by("source", "page", "task").last()
    assert current.height == 2


def test_changed_source_file_is_generated_again(samples, write_job):
    job = write_job(job_fields("fake-model", [f"{samples}/*.png"], result_cache=False))
    run(job)
    shutil.copyfile(samples / "chart.jpg", samples / "receipt.png")  # same name, new content
    stats, engine = run(job)
    assert {r.request_id for r in engine.requests} and len(engine.requests) == 2
    assert stats.pages_already_done == 1


def test_corrupt_cache_entry_is_recomputed(samples, write_job, tmp_path):
    import diskcache

    job = write_job(job_fields("fake-model", [f"{samples}/chart.jpg"]))
    run(job)
    with diskcache.Cache(str(tmp_path / "cache" / "default" / "results")) as cache:
        keys = list(cache.iterkeys())
        assert len(keys) == 2
        cache.set(keys[0], b"\xff not json")
    stats, engine = run(job, output=str(tmp_path / "out2"))
    assert len(engine.requests) == 1 and stats.cache_corrupt == 1 and stats.cache_hits == 1


class _Planted:
    """Unpickling it leaves a file behind: what a hostile entry in a shared cache could do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_pickled_cache_entries_are_never_loaded(samples, write_job, tmp_path):
    import diskcache

    job = write_job(job_fields("fake-model", [f"{samples}/chart.jpg"]))
    run(job)
    marker = tmp_path / "unpickled"
    for name in ("results", "features"):  # what diskcache's own Disk writes for an object
        with diskcache.Cache(str(tmp_path / "cache" / "default" / name)) as cache:
            for key in list(cache.iterkeys()):
                cache.set(key, _Planted(str(marker)))
    stats, engine = run(job, output=str(tmp_path / "out2"))
    assert not marker.exists()
    assert len(engine.requests) == 2 and stats.cache_hits == 0 and stats.cache_corrupt >= 2
    assert (results(job, "out2")["status"] == "ok").all()
    stats, engine = run(job, output=str(tmp_path / "out3"))  # recomputed entries serve again
    assert stats.cache_hits == 2 and len(engine.requests) == 0


def test_a_failing_index_writer_ends_the_run_with_one_clear_reason(samples, write_job, monkeypatch,
                                                                 tmp_path):
    import json
    import sqlite3

    from vlbatch.pipeline.cache import FeatureCache

    def full_disk(self, pages):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(FeatureCache, "_write_index", full_disk)
    job = write_job(job_fields("fake-model", [f"{samples}/*"]))
    with pytest.raises(JobCannotRunError, match="dedupe index .* could not be written: "
                                                "OperationalError: database or disk is full"):
        run(job)
    manifest = json.loads(next((tmp_path / "out" / "_runs").glob("*.json")).read_text())
    assert manifest["status"] == "failed"


def test_bad_files_become_error_rows_and_the_run_goes_on(write_job, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    oddfiles.pdf(docs / "good.pdf", pages=2)
    oddfiles.random_bytes(docs / "noise.pdf")
    oddfiles.zero_page_pdf(docs / "empty.pdf")
    oddfiles.pdf(docs / "locked.pdf", encrypt_password="pw")
    oddfiles.bomb_png(docs / "bomb.png")
    oddfiles.multi_tiff(docs / "frames.tiff", frames=2)
    (docs / "notes.txt").write_text("not a document")
    stats, _ = run(write_job(job_fields("fake-model", ["docs/*"])))
    df = results(write_job(job_fields("fake-model", ["docs/*"])))
    by_source = df.group_by("matched_path").agg(pl.col("status"), pl.col("page"),
                                                pl.col("error").first())
    statuses = {row["matched_path"]: set(row["status"]) for row in by_source.to_dicts()}
    assert statuses == {"docs/good.pdf": {"ok"}, "docs/frames.tiff": {"ok"}, "docs/noise.pdf": {"error"},
                        "docs/empty.pdf": {"error"}, "docs/locked.pdf": {"error"},
                        "docs/bomb.png": {"error"}, "docs/notes.txt": {"error"}}
    errors = df.filter(pl.col("status") == "error")
    assert errors["page"].is_null().all() and errors["error"].is_not_null().all()
    assert errors["output"].is_null().all()
    assert df.height == 2 * (2 + 2 + 5)  # 2 tasks x (4 pages + 5 files that failed)
    locked = errors.filter(pl.col("matched_path") == "docs/locked.pdf")["error"][0]
    assert "encrypted" in locked


def test_a_dead_engine_is_restarted_once_and_goes_on_with_what_it_held(samples, write_job):
    job = write_job(job_fields("fake-model", [f"{samples}/*"], result_cache=False))
    engines = [FakeEngine(fail_after=4), FakeEngine()]
    stats = run_job(load_job(job), engine_factory=lambda job, prompts: engines.pop(0),
                    prompts_factory=fake_prompts)
    df = results(job)
    assert df.height == 14 and (df["status"] == "ok").all() and stats.engine_restarts == 1
    assert not df.select("source", "page", "task").is_duplicated().any()


def test_an_engine_that_dies_again_stops_the_run_exit_5(samples, write_job, tmp_path):
    import json

    from vlbatch.errors import EngineStayedDown

    job = write_job(job_fields("fake-model", [f"{samples}/*"], result_cache=False))
    with pytest.raises(EngineStayedDown, match="engine failed: engine core died") as raised:
        run_job(load_job(job), engine_factory=lambda job, prompts: FakeEngine(fail_after=2),
                prompts_factory=fake_prompts)
    assert raised.value.exit_code == 5
    df = results(job)
    assert df.height == 14 and not df.select("source", "page", "task").is_duplicated().any()
    failed = df.filter(pl.col("status") == "error")
    assert failed.height > 0 and (failed["error_kind"] == "transient").all()
    manifest = json.loads(next((tmp_path / "out" / "_runs").glob("*.json")).read_text())
    assert manifest["status"] == "failed" and manifest["summary"]["engine_restarts"] == 1
    stats, engine = run(job)  # the next run retries them by itself
    assert stats.rows_ok == failed.height and stats.rows_error == 0


def test_transient_errors_are_retried_by_the_next_runs_up_to_max_attempts(samples, write_job):
    from vlbatch.errors import EngineStayedDown

    def dies(job, output=None, fail_after=4):  # the engine and its restart both die
        with pytest.raises(EngineStayedDown):
            run(job, engine=FakeEngine(fail_after=fail_after), **({"output": output} if output else {}))

    job = write_job(job_fields("fake-model", [f"{samples}/*"], result_cache=False, max_attempts=3))
    dies(job)
    failed = results(job).filter(pl.col("status") == "error")
    assert failed.height > 0
    assert (failed["error_kind"] == "transient").all() and (failed["attempt"] == 1).all()
    stats, engine = run(job)  # no --retry-errors: the engine's death was not the pages' fault
    assert len(engine.requests) == failed.height - stats.copied and stats.rows_error == 0
    current = results(job).sort("finished_at").group_by("source", "page", "task").last()
    assert (current["status"] == "ok").all() and current.height == 14
    retried = current.join(failed.select("source", "page", "task"), on=["source", "page", "task"])
    assert (retried["attempt"] == 2).all() and retried.height == failed.height

    out2 = str(job.parent / "out2")
    for attempt in (1, 2, 3):  # an engine that never answers
        dies(job, out2, fail_after=0)
        assert results(job, "out2").filter(pl.col("attempt") == attempt).height == 14
    stats, engine = run(job, engine=FakeEngine(fail_after=0), output=out2)
    assert stats.pages_todo == 0  # max_attempts used up: only --retry-errors goes on
    stats, engine = run(job, output=out2, retry_errors=True)
    assert stats.rows_ok == 14 and (results(job, "out2")["attempt"].max() == 4)


def test_requests_too_long_for_the_model_are_said_before_generating(samples, write_job, caplog):
    fields = job_fields("fake-model", [f"{samples}/chart.jpg", f"{samples}/scan.jpg"])
    fields["tasks"][1]["prompt"] = "word " * 3000  # max_model_len is 2048
    with caplog.at_level("WARNING", logger="vlbatch"):
        run(write_job(fields), engine=FakeEngine(reject="word word"))
    said = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("2 pages have a request of at least 3")


def test_rejected_request_is_a_permanent_error_row(samples, write_job):
    fields = job_fields("fake-model", [f"{samples}/chart.jpg"])
    fields["tasks"][1]["prompt"] = "LONG " * 5
    job = write_job(fields)
    stats, engine = run(job, engine=FakeEngine(reject="LONG"))
    df = results(job).sort("task")
    assert df["status"].to_list() == ["ok", "error"] and df["error_kind"].to_list() == [None, "permanent"]
    stats, engine = run(job, engine=FakeEngine(reject="LONG"))
    assert stats.pages_todo == 0  # the same prompt is as long tomorrow
    stats, engine = run(job, engine=FakeEngine(reject="LONG"), retry_errors=True)
    assert len(engine.requests) == 1 and results(job)["attempt"].max() == 2


def test_error_budget_and_retry_errors(write_job, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    oddfiles.pdf(docs / "good.pdf", pages=1)
    oddfiles.random_bytes(docs / "bad.pdf")
    job = write_job(job_fields("fake-model", ["docs/*"], max_error_rate=0.25))
    with pytest.raises(ErrorBudgetExceeded, match="1 of 2 pages failed"):
        run(job)
    stats, engine = run(job)  # error rows count as done...
    assert stats.pages_todo == 0
    with pytest.raises(ErrorBudgetExceeded):  # ...unless a retry is asked (still broken)
        run(job, retry_errors=True)
    oddfiles.pdf(docs / "bad.pdf", pages=1, text="Mended")  # ...or the file changes
    stats, engine = run(job)
    assert stats.pages_todo == 1 and len(engine.requests) == 2 and stats.rows_ok == 2
    bad = results(job).filter(pl.col("matched_path") == "docs/bad.pdf")
    # the mended file's page rows are current; its page-null error rows were retired...
    assert bad["status"].to_list() == ["ok", "ok"] and bad["page"].to_list() == [1, 1]
    # ...and stay in the table's history, from its first version
    first = pl.read_delta(str(tmp_path / "out" / "results"), version=0)
    assert first.filter(pl.col("matched_path") == "docs/bad.pdf")["status"].to_list() == ["error"] * 2


def test_moving_the_job_file_changes_nothing(samples, tmp_path):
    """Rows are keyed by the input's absolute path: the same job moved one folder down,
    its relative globs rewritten to the same files, finds everything done."""
    import yaml

    docs = tmp_path / "docs"
    shutil.copytree(samples, docs)
    first = tmp_path / "jobs" / "job.yaml"
    moved = tmp_path / "jobs" / "nightly" / "job.yaml"
    moved.parent.mkdir(parents=True)
    for job, up in ((first, "../"), (moved, "../../")):
        job.write_text(yaml.safe_dump(job_fields("fake-model", [f"{up}docs/*"],
                                                 output=str(tmp_path / "out"),
                                                 cache=str(tmp_path / "cache"))))
    stats, engine = run(first)
    assert len(engine.requests) == 12
    stats, engine = run(moved)
    assert stats.pages_todo == 0 and len(engine.requests) == 0
    df = pl.read_delta(str(tmp_path / "out" / "results"))
    assert df["source"].str.starts_with(str(docs) + "/").all()
    assert df["matched_path"].str.starts_with("../docs/").all()


def test_limit_counts_pages_in_input_order(samples, write_job):
    job = write_job(job_fields("fake-model", [f"{samples}/*"]))
    stats, engine = run(job, limit=2)
    df = results(job)
    # sorted paths: chart.jpg, receipt-copy.png, ...
    assert sorted(set(df["source"].to_list())) == [f"{samples}/chart.jpg", f"{samples}/receipt-copy.png"]
    stats, engine = run(job, limit=4)  # the first two count as done
    assert stats.pages_already_done == 2 and stats.pages_todo == 2


def test_a_symlinked_input_gets_rows_of_its_own_copied_not_generated(samples, write_job, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(samples / "report.pdf", docs / "report.pdf")
    (docs / "latest.pdf").symlink_to(docs / "report.pdf")
    job = write_job(job_fields("fake-model", [f"{docs}/*.pdf", f"{docs}/report.pdf"]))
    stats, engine = run(job)
    df = results(job)
    by_source = df.group_by("source").len().sort("source")
    assert by_source["source"].to_list() == [f"{docs}/latest.pdf", f"{docs}/report.pdf"]
    assert by_source["len"][0] == by_source["len"][1] > 0  # each path once, two globs or not
    assert (df["status"] == "ok").all()
    copies = df.filter(pl.col("reused_from").is_not_null())
    assert copies.height == df.height // 2 and len(engine.requests) == df.height // 2


def test_transformers_is_imported_before_the_processor_loads_beside_the_engine(samples, write_job):
    """In a fresh interpreter: by the time the processor starts loading on its own thread
    (while the engine starts on the main one), transformers is fully imported."""
    import subprocess
    import sys

    job = write_job(job_fields("fake-model", [f"{samples}/chart.jpg"]))
    script = f"""
import sys, threading
sys.path.insert(0, {str(Path(__file__).parent)!r})
from fakes import FakeEngine, fake_prompts
from vlbatch.job import load_job
from vlbatch.run import run_job
seen = []
def prompts(job):
    seen.append(threading.current_thread() is not threading.main_thread()
                and "transformers.configuration_utils" in sys.modules
                and "transformers.processing_utils" in sys.modules)
    return fake_prompts(job)
run_job(load_job({str(job)!r}), engine_factory=lambda job, p: FakeEngine(), prompts_factory=prompts)
print("SEEN", seen)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SEEN [True]" in done.stdout, done.stdout[-500:]


def test_no_inputs_is_exit_3(write_job):
    with pytest.raises(JobCannotRunError, match="no inputs matched"):
        run(write_job(job_fields("fake-model", ["nothing/*.pdf"])))


def test_file_time_limit_keeps_finished_pages(write_job, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    oddfiles.pdf(docs / "long.pdf", pages=30)
    oddfiles.pdf(docs / "short.pdf", pages=1, text="other file")
    fields = job_fields("fake-model", ["docs/*"])
    fields["render"].update(workers=1, file_timeout_s=0.000001)
    job = write_job(fields)
    stats, _ = run(job)
    df = results(job)
    long = df.filter(pl.col("matched_path") == "docs/long.pdf")
    assert long.height == 60 and set(long["page"].to_list()) == set(range(1, 31))  # all accounted for
    ok, timed_out = long.filter(pl.col("status") == "ok"), long.filter(pl.col("status") == "error")
    # decided in plan order (same-size pages: input order): the first page used the budget up
    assert set(ok["page"].to_list()) == {1} and timed_out.height == 58
    assert timed_out["error"].str.starts_with("timeout: the file used up its time limit").all()
    assert (df.filter(pl.col("matched_path") == "docs/short.pdf")["status"] == "ok").all()


def test_degenerate_page_box_is_an_error_row_other_pages_go_on(write_job, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    oddfiles.degenerate_box_pdf(docs / "sliver.pdf")
    job = write_job(job_fields("fake-model", ["docs/*"]))
    run(job)
    df = results(job).sort("page")
    assert df["page"].to_list() == [1, 1, 2, 2]
    assert df["status"].to_list() == ["error", "error", "ok", "ok"]
    assert df["error"][0].startswith(("render failed: aspect ratio", "degenerate page box"))


def test_render_pool_failure_mid_run_accounts_for_every_page(samples, write_job, monkeypatch):
    from vlbatch.pipeline import render
    from vlbatch.pipeline.workers import WorkerPool

    real_imap = WorkerPool.imap

    def failing_imap(self, fn, items, args_of):
        for i, result in enumerate(real_imap(self, fn, items, args_of)):
            if fn is render.render_page and i == 2:
                raise RuntimeError("pool broke")
            yield result

    monkeypatch.setattr(WorkerPool, "imap", failing_imap)
    job = write_job(job_fields("fake-model", [f"{samples}/*"], result_cache=False))
    run(job)
    df = results(job)
    assert df.height == 14 and not df.select("source", "page", "task").is_duplicated().any()
    failed = df.filter(pl.col("status") == "error")
    assert failed.height >= 8 and (failed["error"] == "render pool failed").all()


def test_engine_starts_early_only_when_new_pages_need_it(samples, write_job, tmp_path):
    """A first run starts the engine while planning and rendering (before any page is
    rendered); a re-run into a new output folder served from the caches never starts it."""
    job = write_job(job_fields("fake-model", [f"{samples}/*"]))
    starts = []

    def factory(job, prompts):
        starts.append(job.name)
        return FakeEngine()

    def go(output):
        return run_job(load_job(job, output=str(tmp_path / output), cache=str(tmp_path / "cache")),
                       engine_factory=factory, prompts_factory=fake_prompts)

    first = go("out1")
    assert len(starts) == 1 and first.generated == 12
    assert "to_first_request_s" not in first.timings  # started before the first request
    again = go("out2")
    assert len(starts) == 1 and again.generated == 0 and again.cache_hits == 14


def test_ray_is_optional(samples, write_job, monkeypatch):
    """A local run never imports Ray; `executor: ray` without Ray installed is exit 3 with
    the command that installs it."""
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: import fails
    stats, _ = run(write_job(job_fields("fake-model", [f"{samples}/*"])))
    assert stats.rows_ok == 14
    ray_job = write_job({**job_fields("fake-model", [f"{samples}/*"]), "output": "out-ray",
                         "executor": "ray"}, "ray.yaml")
    with pytest.raises(JobCannotRunError, match=r"pip install 'vlbatch\[ray\]'"):
        run_job(load_job(ray_job), prompts_factory=fake_prompts)
    assert not list((ray_job.parent / "out-ray" / "results").glob("*.parquet"))  # nothing run
