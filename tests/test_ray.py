"""`executor: ray` on a local Ray cluster on CPU: the same job gives the same rows as a local
run (real vLLM CPU build and the tiny model in one long-lived actor), and a vLLM actor that
dies mid-run loses and duplicates nothing."""

from __future__ import annotations

import json
import time

import polars as pl
import pytest
from PIL import Image

import fakes
import oddfiles
from conftest import job_fields, run_cli
from vlbatch.job import load_job
from vlbatch.run import run_job

ray = pytest.importorskip("ray")

SAME = ["source", "page", "task", "status", "error", "output", "content_hash", "phash",
        "cached", "reused_from", "prompt_tokens", "output_tokens", "source_sha256", "task_hash",
        "finish_reason", "attempt", "error_output"]


ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def corpus(samples):
    """The samples (an exact copy among them) plus a JPEG re-encoding of one page (a near
    copy), a broken file and a PDF page box of zero size."""
    with Image.open(samples / "receipt.png") as image:
        image.convert("RGB").save(samples / "receipt-reencoded.jpg", quality=92)
    oddfiles.truncated_pdf(samples / "broken.pdf")
    oddfiles.degenerate_box_pdf(samples / "degenerate.pdf")
    return samples


def rows(output):
    return pl.read_delta(str(output / "results")).select(SAME).sort("source", "page", "task")


def differences(local, on_ray):
    """The columns that differ, with the rows where they do (nulls compare equal)."""
    both = local.join(on_ray, on=["source", "page", "task"], suffix="_ray", nulls_equal=True)
    lines = []
    for column in SAME[3:]:
        differ = both.filter(pl.col(column).ne_missing(pl.col(f"{column}_ray")))
        if differ.height:
            lines.append(f"{column}: {differ.height} rows differ, e.g.\n"
                         f"{differ.select('source', 'page', 'task', column, f'{column}_ray').head(4)}")
    return "\n".join(lines) or "no value differs: the rows differ in number or order"


def test_local_and_ray_give_the_same_rows(tiny_model, samples, write_job, tmp_path):
    """The same rows, counters and decisions, error rows included: broken files, a task
    whose requests vLLM refuses (over max_model_len) with an exact copy sharing the
    original's error, and a PDF whose file time budget runs out after its first page."""
    fields = job_fields(tiny_model, [f"{corpus(samples)}/*"])
    fields["engine"]["max_num_seqs"] = 1  # one request at a time in both: batch-invariant
    fields["engine"]["dtype"] = "float32"  # rounding noise far below bf16's
    fields["tasks"].append({"name": "too_long", "prompt": "word " * 2500, "max_tokens": 4})
    fields["tasks"].append({"name": "flags", "prompt": "Paid?", "max_tokens": 40,  # typed
                            "fields": {"paid": "boolean", "kind": ["invoice", "other"]}})
    fields["render"]["file_timeout_s"] = 0.000001  # a file's first rendered page uses it up
    local_job = write_job({**fields, "output": "out-local", "cache": "cache-local"}, "local.yaml")
    ray_job = write_job({**fields, "output": "out-ray", "cache": "cache-ray", "executor": "ray",
                         "ray": {"workers": 1, "render_workers": 1, "pages_per_batch": 2}},
                        "ray.yaml")
    for job in (local_job, ray_job):
        # one OpenMP thread in both (Ray gives its 1-CPU actors one anyway): vLLM's CPU
        # numerics depend on the thread count on some CPUs, and random weights have near-ties
        result = run_cli("run", str(job), env=ONE_THREAD)
        assert result.returncode == 0, result.stderr[-3000:]
    local, on_ray = rows(tmp_path / "out-local"), rows(tmp_path / "out-ray")
    # 7 sample pages, a JPEG copy, a broken file, the 2 pages of the degenerate PDF: 4 tasks each
    assert local.height == on_ray.height == 4 * 11
    assert on_ray.select("source", "page", "task").unique().height == on_ray.height
    assert local.equals(on_ray), differences(local, on_ray)
    # the dedupe decisions were made: an exact copy and a near copy reused, errors kept
    asked = on_ray.filter(pl.col("task") != "too_long")
    reused = asked.filter(pl.col("reused_from").is_not_null())["source"].to_list()
    assert any(s.endswith("receipt.png") for s in reused)
    assert any(s.endswith("receipt-reencoded.jpg") for s in reused)
    assert asked.filter(pl.col("status") == "error")["source"].str.ends_with(".pdf").all()
    assert (asked.filter(pl.col("status") == "ok")["output"].str.len_chars() > 0).all()
    typed = [pl.read_delta(str(tmp_path / o / "fields" / "flags"))
             .drop("run_id", "finished_at").sort("source", "page") for o in ("out-local", "out-ray")]
    assert typed[0].height == asked.filter(pl.col("task") == "flags", pl.col("status") == "ok").height
    assert typed[0].height > 0 and typed[0].equals(typed[1])
    # refused requests are error rows; the exact copy shares its original's error
    too_long = on_ray.filter(pl.col("task") == "too_long")
    chart = too_long.filter(pl.col("source").str.ends_with("/chart.jpg"))
    assert chart["error"][0].startswith("request rejected") and chart["reused_from"][0] is None
    copy = too_long.filter(pl.col("source").str.ends_with("/receipt.png"))
    assert copy["error"][0].startswith("request rejected")
    assert copy["reused_from"][0].endswith("receipt-copy.png#1") and copy["cached"][0]
    # the 3-page PDF: its first page within the file's time budget, the others not
    report = on_ray.filter(pl.col("source").str.ends_with("report.pdf") & (pl.col("task") == "describe"))
    assert report.sort("page")["error"].to_list()[0] is None
    assert all(e.startswith("timeout: the file used up") for e in report.sort("page")["error"][1:])
    # the same manifest: the same summary counts, and the engine that answered
    summaries = [json.loads(next((tmp_path / o / "_runs").glob("*.json")).read_text())
                 for o in ("out-local", "out-ray")]
    for key in ("pages_total", "pages_finished", "generated", "rejected", "failed", "cache_hits",
                "copied", "exact_copies", "near_copies", "rows_ok", "rows_error",
                "prompt_tokens", "output_tokens", "error_reasons", "fields_rows", "retried"):
        assert summaries[0]["summary"][key] == summaries[1]["summary"][key], key
    assert summaries[1]["summary"]["rejected"] >= 5 and summaries[1]["summary"]["exact_copies"] == 1
    assert summaries[1]["config"]["executor"] == "ray" and summaries[1]["versions"]["vllm"]
    assert summaries[1]["status"] == "finished"

    # a re-run on Ray is served by what is on disk, but for the pages stopped by the file's
    # time limit (a transient error): tried again as attempt 2, the first of them within
    # this run's budget, the next one stopped again
    result = run_cli("run", str(ray_job), env=ONE_THREAD)
    assert result.returncode == 0, result.stderr[-3000:]
    again = pl.read_delta(str(tmp_path / "out-ray" / "results")).filter(
        pl.col("attempt") == 2).sort("page", "task")
    assert again.height == 8 and again["source"].str.ends_with("report.pdf").all()
    assert again.filter(pl.col("page") == 2)["status"].to_list() == ["ok", "ok", "ok", "error"]
    third = again.filter(pl.col("page") == 3)
    assert third["error"].str.starts_with("timeout: the file").all()
    assert (third["error_kind"] == "transient").all()


@pytest.fixture
def local_ray():
    ray.cloudpickle.register_pickle_by_value(fakes)  # the fake engine travels to the actor
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_vllm_actor_dying_mid_run_loses_and_duplicates_nothing(local_ray, samples, write_job,
                                                                  tmp_path):
    job = write_job({**job_fields("fake-model", [f"{samples}/*"]), "executor": "ray",
                     "ray": {"workers": 1, "pages_per_batch": 1, "batches_per_worker": 1}})
    marker = tmp_path / "died"
    stats = run_job(load_job(job), prompts_factory=fakes.fake_prompts,
                    engine_factory=lambda job, prompts: fakes.DiesOnce(marker))
    assert marker.exists()  # the actor did die, and was restarted
    df = pl.read_delta(str(tmp_path / "out" / "results"))
    assert df.height == 14 and df.select("source", "page", "task").unique().height == 14
    assert (df["status"] == "ok").all() and stats.rows_ok == 14 and stats.generated == 12


def test_vllm_actor_that_cannot_start_is_exit_3(local_ray, samples, write_job):
    from vlbatch.errors import JobCannotRunError

    job = write_job({**job_fields("fake-model", [f"{samples}/*"]), "executor": "ray"})
    with pytest.raises(JobCannotRunError, match="out of memory"):
        run_job(load_job(job), prompts_factory=fakes.fake_prompts,
                engine_factory=fakes.engine_that_cannot_start)


def test_a_vllm_actor_works_on_several_blocks_at_once(local_ray, samples, write_job, tmp_path):
    """The engine gets the next block's requests while one block's are still in it: never
    drained between blocks (here: an engine that answers only once two pages are in it)."""
    job = write_job({**job_fields("fake-model", [f"{samples}/*"]), "executor": "ray",
                     "ray": {"workers": 1, "pages_per_batch": 1, "batches_per_worker": 2}})
    run_job(load_job(job), prompts_factory=fakes.fake_prompts,
            engine_factory=lambda job, prompts: fakes.AnswersPagesTogether())
    df = pl.read_delta(str(tmp_path / "out" / "results"))
    generated = df.filter(~pl.col("cached"))
    assert generated.height == 12
    together = generated["output"].value_counts().sort("output")
    assert generated.filter(pl.col("output") == "pages together: 2").height >= 10, together


def test_an_engine_that_dies_is_started_again_once_and_then_the_run_stops_with_exit_5(
        local_ray, samples, write_job, tmp_path):
    """As locally: the vLLM actor starts its engine again once (it gets what the dead one
    held); when the new one dies too, the run stops (EngineStayedDown, exit 5) and every
    page not answered has a transient error row, which the next run retries."""
    from vlbatch.errors import EngineStayedDown

    job = write_job({**job_fields("fake-model", [f"{samples}/*"]), "executor": "ray",
                     "ray": {"workers": 1, "pages_per_batch": 1, "batches_per_worker": 1}})
    starts = tmp_path / "starts"
    starts.mkdir()

    def dies_after_four(job, prompts):  # each engine answers 4 requests, then dies
        (starts / str(len(list(starts.iterdir())))).touch()
        return fakes.FakeEngine(fail_after=4)

    with pytest.raises(EngineStayedDown, match="after one restart"):
        run_job(load_job(job), prompts_factory=fakes.fake_prompts, engine_factory=dies_after_four)
    assert len(list(starts.iterdir())) == 2  # the first engine and the one started for it
    df = pl.read_delta(str(tmp_path / "out" / "results"))
    assert df.height == 14 and df.select("source", "page", "task").unique().height == 14
    failed = df.filter(pl.col("status") == "error")
    assert (failed["error_kind"] == "transient").all() and failed.height >= 4
    assert df.filter(pl.col("status") == "ok").height >= 8  # both engines' answers kept
    manifest = json.loads(next((tmp_path / "out" / "_runs").glob("*.json")).read_text())
    assert manifest["summary"]["engine_restarts"] == 1

    stats = run_job(load_job(job), prompts_factory=fakes.fake_prompts,  # the next night
                    engine_factory=lambda job, prompts: fakes.FakeEngine())
    assert stats.pages_todo > 0
    assert (pl.read_delta(str(tmp_path / "out" / "results"))["status"] == "ok").all()


def test_file_time_limit_under_ray_keeps_finished_pages(local_ray, write_job, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    oddfiles.pdf(docs / "long.pdf", pages=12)
    oddfiles.pdf(docs / "short.pdf", pages=1, text="other file")
    fields = job_fields("fake-model", ["docs/*"], executor="ray",
                        ray={"workers": 1, "render_workers": 1, "pages_per_batch": 4})
    fields["render"].update(file_timeout_s=0.000001)
    run_job(load_job(write_job(fields)), prompts_factory=fakes.fake_prompts,
            engine_factory=lambda job, prompts: fakes.FakeEngine())
    df = pl.read_delta(str(tmp_path / "out" / "results"))
    long = df.filter(pl.col("matched_path") == "docs/long.pdf")
    assert long.height == 24 and set(long["page"].to_list()) == set(range(1, 13))
    ok, timed_out = long.filter(pl.col("status") == "ok"), long.filter(pl.col("status") == "error")
    # decided in plan order (same-size pages: input order): the first page used the budget up
    assert set(ok["page"].to_list()) == {1} and timed_out.height == 22
    assert timed_out["error"].str.starts_with("timeout: the file used up its time limit").all()
    assert (df.filter(pl.col("matched_path") == "docs/short.pdf")["status"] == "ok").all()


def test_address_null_starts_its_own_cluster(monkeypatch):
    """`ray.address: null` never joins whatever cluster the environment points at."""
    from vlbatch.executor.ray_cluster import connect

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # nothing listens there: joining it
    started, connected_here = connect(None)  # would fail (after Ray's ~10-minute retries)
    try:
        assert connected_here and started.cluster_resources().get("CPU", 0) >= 1
    finally:
        started.shutdown()


def test_an_address_where_nothing_listens_fails_in_seconds(tiny_model, samples, write_job):
    import socket

    from vlbatch.errors import JobCannotRunError
    from vlbatch.executor.ray_cluster import check_listening, connect

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens on this port now
    started = time.monotonic()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(JobCannotRunError, match=f"nothing answers at 127.0.0.1:{port}"):
            connect(address)
    assert time.monotonic() - started < 30  # Ray alone retries for minutes
    job = write_job({**job_fields(tiny_model, [f"{samples}/*"]), "executor": "ray",
                     "ray": {"address": f"127.0.0.1:{port}"}})
    result = run_cli("run", str(job), timeout=120)  # as cron runs it: exit 3, the reason
    assert result.returncode == 3, result.stderr[-2000:]
    assert f"nothing answers at 127.0.0.1:{port}" in " ".join(result.stderr.split())  # unwrapped
    with socket.socket() as listening:  # a port that answers passes the check
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        check_listening(f"127.0.0.1:{listening.getsockname()[1]}")
    check_listening("auto")  # no cluster found: left to Ray, whose error is quick and clear


def test_auto_where_the_last_cluster_has_stopped_fails_in_seconds(tmp_path, monkeypatch):
    """`ray.address: auto` follows Ray's record of the last `ray start` on this machine,
    which stays behind when that cluster stops: the run ends in seconds with the reason."""
    import socket

    from vlbatch.errors import JobCannotRunError
    from vlbatch.executor.ray_cluster import bootstrap_address, connect

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # Ray's temp folder, with a stale record
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")
    assert bootstrap_address("auto").endswith(f":{port}")
    started = time.monotonic()
    with pytest.raises(JobCannotRunError, match=f"where 'auto' leads.*nothing answers at .*:{port}"):
        connect("auto")
    assert time.monotonic() - started < 30
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")  # RAY_ADDRESS, as Ray reads it
    with pytest.raises(JobCannotRunError, match=f"nothing answers at .*:{port}"):
        connect("auto")


def test_an_answer_crosses_rays_blocks_whole():
    """What a vLLM actor hands back (every field of the completion, the prefix-cache count
    included) is what the writer side reads: Ray's blocks carry it as JSON."""
    import dataclasses

    from vlbatch.engine.base import Completion
    from vlbatch.executor.ray_stages import answer_json, answer_of

    done = Completion("k", "text", None, 300, 7, False, "length", 2, None, 256)
    back = answer_of("k", json.loads(json.dumps(answer_json(done))))
    assert dataclasses.asdict(back) == dataclasses.asdict(done)
