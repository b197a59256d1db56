"""End to end through the real vLLM CPU engine and the tiny random Qwen3-VL: the demo job as
a user runs it (a subprocess), Parquet read back with polars, exit codes; and the prompt
token count checked against what vLLM reports."""

from __future__ import annotations

import json
import logging
import re

import polars as pl
import pymupdf
import pytest

import oddfiles
from conftest import ROOT, job_fields, run_cli
from vlbatch.errors import OutputLocked
from vlbatch.job import load_job
from vlbatch.output.folder import OutputFolder

DESIGN_COLUMNS = {  # DESIGN.md's results table
    "source": pl.String, "page": pl.Int32, "task": pl.String, "output": pl.String,
    "status": pl.String, "error": pl.String, "content_hash": pl.String, "phash": pl.String,
    "cached": pl.Boolean, "reused_from": pl.String, "model": pl.String, "run_id": pl.String,
}


@pytest.fixture(scope="module")
def demo_model():
    """jobs/demo.yaml points at models/tiny-qwen3-vl, which the README's set-up builds."""
    from vlbatch.models.tiny import build_tiny_model

    return build_tiny_model(ROOT / "models" / "tiny-qwen3-vl")


def prometheus_samples(path) -> dict:
    """The textfile as Prometheus parses it: (name, labels other than job alone) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples[(sample.name, () if len(labels) == 1 else labels)] = sample.value
    return samples


def expected_pages(folder) -> int:
    pages = 0
    for path in folder.iterdir():
        pages += pymupdf.open(path).page_count if path.suffix == ".pdf" else 1
    return pages


def test_demo_job_end_to_end(demo_model, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    result = run_cli("run", str(ROOT / "jobs" / "demo.yaml"), "--output", str(out),
                     "--cache-dir", str(cache), "--metrics-file", str(tmp_path / "demo.prom"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pages/s" in result.stdout and "Traceback" not in result.stderr
    # no terminal (cron): stderr is vlbatch's one-line, ISO-dated log lines and nothing else
    # (no torch warnings, no weight-loading bars); stdout is the summary
    log_line = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4} (INFO|WARNING|ERROR) \S")
    assert all(log_line.match(line) for line in result.stderr.splitlines()), result.stderr
    assert result.stdout.startswith("run ") and "\r" not in result.stdout + result.stderr
    df = pl.read_delta(str(out / "results"))
    job = load_job(ROOT / "jobs" / "demo.yaml")
    pages = expected_pages(ROOT / "data" / "samples")
    assert df.height == pages * len(job.tasks) and pages == 7
    # the demo shows every row ok: a schema task random weights can finish, a short text
    ok = df.filter(pl.col("status") == "ok")
    assert ok.height == df.height and ok["output"].is_not_null().all(), \
        df.filter(pl.col("status") == "error").select("task", "error", "error_output")
    typed = pl.read_delta(str(out / "fields" / "page_kind"))
    assert typed.height == pages and typed.schema["paid"] == pl.Boolean
    assert set(typed["kind"]) <= {"invoice", "receipt", "report", "chart", "scan", "other"}
    # the run says where the answers, the typed table and the report are
    assert f"answers: {out / 'results'}" in result.stdout
    assert f"typed fields of page_kind: {out / 'fields' / 'page_kind'}" in result.stdout
    [report_html] = (out / "_runs").glob("*.html")
    assert f"report: {report_html}" in result.stdout.replace("\n", "")
    assert df["finish_reason"].is_in(["stop", "length"]).all()
    assert df.select("source", "page", "task").unique().height == df.height
    for column, dtype in DESIGN_COLUMNS.items():
        assert df.schema[column] == dtype, column
    assert (df["model"] == job.model).all() and df["run_id"].n_unique() == 1
    dupes = df.filter(pl.col("reused_from").is_not_null())
    assert dupes.height == len(job.tasks) and dupes["cached"].all()  # receipt.png = its copy
    pages_table = pl.read_delta(str(out / "pages"))
    assert pages_table.height == pages
    report = pages_table.filter(pl.col("source").str.ends_with("report.pdf"))
    assert report["text_layer"].str.contains("sample report").all()
    manifest = json.loads(next((out / "_runs").glob("*.json")).read_text())
    assert manifest["summary"]["rows_ok"] == ok.height and manifest["versions"]["vllm"]
    # vLLM's CPU build held no GPU: no GPU figures, said so (summary, manifest, report)
    s = manifest["summary"]
    assert s["engine_device"] == "cpu" and (s["gpus"], s["gpu_hours"]) == (0, 0.0)
    assert "GPU-hour" not in result.stdout and "GPUs held" not in result.stdout
    assert "no GPU held" in result.stdout
    html = next((out / "_runs").glob("*.html")).read_text()
    assert "GPU-hours" not in html and "CPU, no GPU" in html
    metrics = prometheus_samples(tmp_path / "demo.prom")
    assert metrics[("vlbatch_last_run_success", ())] == 1
    assert metrics[("vlbatch_last_run_rows", (("job", "demo"), ("status", "ok")))] == ok.height
    assert metrics[("vlbatch_last_run_pages", ())] == pages
    assert manifest["summary"]["bad_answers"] == 0

    again = run_cli("run", str(ROOT / "jobs" / "demo.yaml"), "--output", str(out),
                    "--cache-dir", str(cache))
    assert again.returncode == 0
    assert pl.read_delta(str(out / "results")).height == df.height  # no new rows


def test_bad_inputs_limit_and_exit_codes(tiny_model, write_job, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    oddfiles.pdf(docs / "a.pdf", pages=3)
    oddfiles.random_bytes(docs / "b-broken.pdf")
    oddfiles.cmyk_jpeg(docs / "c.jpg")
    fields = job_fields(tiny_model, ["docs/*"])
    fields["tasks"].append({"name": "too-long", "prompt": "word " * 3000,  # over max_model_len
                            "max_tokens": 4})
    job = write_job(fields)
    result = run_cli("run", str(job), "--limit", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    df = pl.read_delta(str(tmp_path / "out" / "results"))
    assert sorted(set(zip(df["matched_path"], df["page"].fill_null(0)))) == [
        ("docs/a.pdf", 1), ("docs/a.pdf", 2), ("docs/a.pdf", 3), ("docs/b-broken.pdf", 0)]
    assert df.filter(pl.col("matched_path") == "docs/b-broken.pdf")["status"].unique().to_list() == ["error"]
    assert df.filter(pl.col("status") == "ok").height == 6
    rejected = df.filter(pl.col("task") == "too-long")
    assert rejected.height == 4 and (rejected["status"] == "error").all()
    assert rejected.filter(pl.col("page").is_not_null())["error"].str.starts_with(
        "request rejected (engine.max_model_len 2048): ").all()

    # the same limit: the refused rows stay done; a raised limit: they are tried again
    assert run_cli("run", str(job), "--limit", "4").returncode == 0
    assert pl.read_delta(str(tmp_path / "out" / "results")).sort("source", "page", "task").equals(
        df.sort("source", "page", "task"))
    fields["engine"]["max_model_len"] = 16384
    raised = run_cli("run", str(write_job(fields)), "--limit", "4")
    assert raised.returncode == 0, raised.stderr[-3000:]
    after = pl.read_delta(str(tmp_path / "out" / "results"))
    tried = after.filter(pl.col("task") == "too-long", pl.col("page").is_not_null())
    assert tried.height == 3 and (tried["attempt"] == 2).all()
    assert not tried["error"].fill_null("").str.starts_with("request rejected").any()
    others = after.filter(pl.col("task") != "too-long")
    assert others.sort("source", "page", "task").equals(
        df.filter(pl.col("task") != "too-long").sort("source", "page", "task"))

    with OutputFolder(tmp_path / "out").lock():  # another run holds the output
        locked = run_cli("run", str(job))
    assert locked.returncode == OutputLocked.exit_code == 75
    assert "another run holds" in locked.stderr and "Traceback" not in locked.stderr

    nothing = run_cli("run", str(write_job(job_fields(tiny_model, ["none/*.pdf"],
                                                      metrics_file="m/n.prom"), "n.yaml")))
    failed = prometheus_samples(tmp_path / "m" / "n.prom")  # the job's own field, beside it
    assert failed[("vlbatch_last_run_success", ())] == 0
    assert failed[("vlbatch_last_run_exit_code", ())] == nothing.returncode == 3
    assert failed[("vlbatch_last_run_status", (("job", "test"), ("status", "failed")))] == 1
    assert nothing.returncode == 3 and "no inputs matched" in nothing.stderr
    missing = run_cli("run", str(write_job(job_fields(tmp_path / "no-model", ["docs/*"]), "m.yaml")))
    assert missing.returncode == 3 and "no-model does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_prompt_token_count_equals_vllm_count(tiny_model, write_job, tmp_path):
    from PIL import Image

    from vlbatch.engine.base import Request
    from vlbatch.engine.vllm_engine import VllmEngine
    from vlbatch.pipeline.imaging import fit_to_budget

    job = load_job(write_job(job_fields(tiny_model, ["*.pdf"])))
    engine = VllmEngine(job)
    try:
        sizes = [(100, 100), (1240, 1754), (640, 300), (2000, 500), (33, 900)]
        requests, expected = [], {}
        for i, (w, h) in enumerate(sizes):
            for task in job.tasks:
                image = fit_to_budget(Image.new("RGB", (w, h), (i * 40, 90, 200)),
                                      job.render.min_pixels, job.render.max_pixels)
                text = task.render_prompt(text_layer="some text layer " * i)
                rid = f"{i}-{task.name}"
                requests.append(Request(rid, image, text, task))
                expected[rid] = engine.prompts.prompt_tokens(text, image.width, image.height)
        vllm_engine, outputs = engine.llm.llm_engine, []
        step = vllm_engine.step

        def counted_step():
            stepped = step()
            outputs.extend(stepped)
            return stepped

        vllm_engine.step = counted_step
        done = {c.request_id: c for c in engine.generate(iter(requests))}
    finally:
        engine.close()
    assert {rid: c.prompt_tokens for rid, c in done.items()} == expected
    assert all(c.error is None and c.output_tokens >= 1 for c in done.values())
    # vLLM hands over finished requests only, not one output per running request and step
    assert sum(c.output_tokens for c in done.values()) > len(done)
    assert sorted(o.request_id for o in outputs) == sorted(done)


def test_the_generation_warm_up_runs_in_engine_start_and_leaves_answers_unchanged(
        tiny_model, write_job, monkeypatch):
    """engine.warmup_pages: random-pixel pages generated (a few tokens) before the run's;
    greedy answers of the same requests are the same with and without it."""
    import vllm
    from PIL import Image

    from vlbatch.engine.base import Request
    from vlbatch.engine.vllm_engine import WARMUP_TOKENS, VllmEngine
    from vlbatch.pipeline.imaging import fit_to_budget

    generated = []
    original = vllm.LLM.generate

    def recorded(self, prompts, *args, **kwargs):
        outputs = original(self, prompts, *args, **kwargs)
        generated.extend(outputs)
        return outputs

    monkeypatch.setattr(vllm.LLM, "generate", recorded)
    answers = {}
    for pages in (3, None):  # None: the default, none on the CPU build
        fields = job_fields(tiny_model, ["*.pdf"])
        if pages is not None:
            fields["engine"]["warmup_pages"] = pages
        job = load_job(write_job(fields))
        engine = VllmEngine(job)
        try:
            requests = [Request(f"{i}-{task.name}", fit_to_budget(
                Image.new("RGB", (600, 800), (i * 60, 90, 200)), job.render.min_pixels,
                job.render.max_pixels), task.render_prompt(text_layer=""), task)
                for i in range(3) for task in job.tasks]
            answers[pages] = {c.request_id: (c.text, c.output_tokens, c.error)
                              for c in engine.generate(iter(requests))}
        finally:
            engine.close()
        if pages:  # engine start generated them: WARMUP_TOKENS each, nothing kept
            assert len(generated) == 3 and engine.warm_up_seconds > 0
            assert all(len(o.outputs[0].token_ids) == WARMUP_TOKENS for o in generated)
            assert all(len(o.prompt_token_ids) > 100 for o in generated)  # page-sized images
    assert len(generated) == 3  # none more by default here
    assert answers[3] == answers[None] and all(e is None for _, _, e in answers[None].values())


def test_hub_id_served_from_the_local_hub_cache_without_network(tiny_model, write_job, tmp_path):
    """A hub id whose snapshot is in the local Hugging Face cache runs with no network."""
    import os
    import shutil

    hub = tmp_path / "hub"
    repo = hub / "models--acme--tiny-vl"
    shutil.copytree(tiny_model, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    oddfiles.png(tmp_path / "page.png")
    job = write_job(job_fields("acme/tiny-vl", ["page.png"]))
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_ENDPOINT": "http://127.0.0.1:9"}
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "vlbatch", "run", str(job)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    df = pl.read_delta(str(tmp_path / "out" / "results"))
    assert (df["status"] == "ok").all() and (df["model"] == "acme/tiny-vl").all()


def test_input_threads_hand_vllm_what_it_builds_itself(tiny_model, write_job, monkeypatch,
                                                        caplog):
    """Pages processed by vlbatch's input threads, several at once, reach the engine as
    vLLM's own processing builds them (a second engine as vLLM ships it, its processor cache
    on): the same prompt token ids, pixel values bit for bit, image grid and placeholder,
    sampling settings; a page's second task built from its first task's processing (the HF
    processor runs once a page), and the answers the same as vLLM's as shipped.
    Fails too if vLLM renames the internals the threads use (engine/vllm_frontend.py)."""
    from concurrent.futures import Future

    import torch
    from PIL import Image

    from vlbatch.engine.base import Request
    from vlbatch.engine.vllm_engine import VllmEngine
    from vlbatch.engine.vllm_frontend import InputFront
    from vlbatch.pipeline.imaging import fit_to_budget

    fields = job_fields(tiny_model, ["*.pdf"])
    threaded = load_job(write_job(fields, "threaded.yaml"))
    fields["engine"]["frontend_threads"] = 0
    plain = load_job(write_job(fields, "plain.yaml"))
    assert threaded.engine.frontend_threads == 4  # the default
    ours, theirs = VllmEngine(threaded), VllmEngine(plain)
    try:
        # engine start warmed each input thread with a page of its own: a thread's first
        # request is not the run's
        warmed = ours._front
        assert warmed.warmed == 4 and len(warmed.pool._threads) == 4 and theirs._front is None
        front = InputFront(ours.llm.llm_engine, 4, 2)
        requests = []
        for i, (w, h) in enumerate([(1240, 1754), (640, 300), (100, 100), (2000, 500)] * 3):
            image = Image.effect_noise((w, h), 40 + i).convert("RGB")
            image = fit_to_budget(image, threaded.render.min_pixels, threaded.render.max_pixels)
            for task in threaded.tasks:
                requests.append(Request(f"{i}-{task.name}", image, task.render_prompt(
                    text_layer=f"page {i} text"), task))
        prepared = [front.prepare(r.request_id, ours.vllm_prompt(r), ours.sampling_params(r.task))
                    for r in requests]  # all at once: 4 threads work on them together
        mine = [p.result(timeout=120) for p in prepared]
        front.close()
        # each page's first task processed in full, the other built from it
        assert (front.shared, front.unshared) == (len(requests) - 12, 0)
        engine = theirs.llm.llm_engine
        reference = [engine.input_processor.process_inputs(
            r.request_id, theirs.vllm_prompt(r), theirs.sampling_params(r.task),
            supported_tasks=engine.get_supported_tasks()) for r in requests]
        with caplog.at_level(logging.INFO, logger="vlbatch"):
            answers_ours = {c.request_id: c.text for c in ours.generate(iter(requests))}
        assert any("input threads: 12 requests built from their page's first" in r.getMessage()
                   for r in caplog.records)
        assert ours._front is warmed and not warmed.closed  # the run used the warmed threads
        assert any(r.getMessage().startswith("feed start: first request processed")
                   for r in caplog.records)
        # a page's later tasks went to the engine core without its pixels (it had them)
        assert ours._pixels.capacity > 0 and ours._pixels.sent_without == 12
        theirs.llm.reset_mm_cache()  # the reference's processing filled it: the engine has none
        answers_theirs = {c.request_id: c.text for c in theirs.generate(iter(requests))}
        assert answers_ours == answers_theirs and all(answers_ours.values())
        # an input thread that fails (a library's race) costs time, not the answer: the
        # request is processed again on the engine thread
        prepare = InputFront.prepare

        def failing_prepare(front, request_id, prompt, params):
            if request_id != requests[1].request_id:
                return prepare(front, request_id, prompt, params)
            failed: Future = Future()
            failed.set_exception(RuntimeError("Already borrowed"))
            return failed

        monkeypatch.setattr(InputFront, "prepare", failing_prepare)
        done = list(ours.generate(iter(requests[:3])))
        assert sorted(c.request_id for c in done) == sorted(r.request_id for r in requests[:3])
        assert all(c.error is None and c.text for c in done), [c.error for c in done]
        assert ours._thread_failures == {"RuntimeError": 1}
    finally:
        ours.close()
        theirs.close()
    # vLLM's processor cache sends a repeated image's data once (then None: the engine core
    # has it); the threads process without it, so every request they build carries its own
    # (the engine thread leaves it out as it adds them: sent_without above)
    sent = {r.mm_features[0].identifier: r.mm_features[0].data for r in reference
            if r.mm_features[0].data is not None}
    assert len(sent) == 12
    for a, b in zip(mine, reference, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.sampling_params == b.sampling_params
        assert len(a.mm_features) == len(b.mm_features) == 1
        fa, fb = a.mm_features[0], b.mm_features[0]
        assert fa.mm_position == fb.mm_position and fa.identifier == fb.identifier
        data = sent[fb.identifier]
        assert fa.data is not None and set(fa.data) == set(data) >= {"pixel_values", "image_grid_thw"}
        for key in fa.data:
            assert torch.equal(fa.data[key].data, data[key].data), key


def test_a_pdf_only_pdfium_reads_gets_its_answers_and_the_pages_table_names_the_renderer(
        tiny_model, write_job, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    oddfiles.wrong_page_count_pdf(docs / "count0.pdf")  # MuPDF: no pages; PDFium: one
    oddfiles.pdf(docs / "fine.pdf", pages=1)
    oddfiles.png(docs / "picture.png")
    result = run_cli("run", str(write_job(job_fields(tiny_model, ["docs/*"]))))
    assert result.returncode == 0, result.stderr[-3000:]
    pages = pl.read_delta(str(tmp_path / "out" / "pages"))
    renderers = dict(zip(pages["matched_path"], pages["renderer"], strict=True))
    assert renderers == {"docs/count0.pdf": "pdfium", "docs/fine.pdf": "mupdf",
                         "docs/picture.png": "pillow"}
    drawn = pages.filter(pl.col("matched_path") == "docs/count0.pdf")
    assert drawn["error"][0] is None and "Drawn by PDFium" in drawn["text_layer"][0]
    results = pl.read_delta(str(tmp_path / "out" / "results"))
    assert results.filter(pl.col("matched_path") == "docs/count0.pdf")["page"].to_list() == [1, 1]


def test_an_fp8_kv_cache_runs_in_vllm_and_never_serves_the_model_dtypes_answers(
        tiny_model, write_job, tmp_path):
    """vLLM's CPU build takes `kv_cache_dtype: fp8`; its answers are new, not the cached ones
    that the same model with its own KV cache dtype gave (the cache folder is shared)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    oddfiles.pdf(docs / "one.pdf", pages=1)
    plain = job_fields(tiny_model, ["docs/*"], output="out-plain", cache="shared-cache")
    fp8 = job_fields(tiny_model, ["docs/*"], output="out-fp8", cache="shared-cache")
    fp8["engine"]["kv_cache_dtype"] = "fp8"
    for fields, name in ((plain, "plain.yaml"), (fp8, "fp8.yaml")):
        result = run_cli("run", str(write_job(fields, name)))
        assert result.returncode == 0, result.stderr[-3000:]
    first = pl.read_delta(str(tmp_path / "out-plain" / "results"))
    second = pl.read_delta(str(tmp_path / "out-fp8" / "results"))
    assert first.height == second.height == 2  # one page, two tasks
    assert (second["status"] == "ok").all() and not second["cached"].any()


def test_a_pages_later_tasks_are_served_from_vllms_prefix_cache_and_the_run_says_so(
        tiny_model, write_job, tmp_path):
    """Several questions a page: the later tasks' prompts share the page's image with the
    first's, and vLLM serves that part from its prefix cache. The run's summary (console and
    manifest) counts those tokens as vLLM reports them; one question a page gets none."""
    docs = tmp_path / "docs"
    docs.mkdir()
    oddfiles.pdf(docs / "two.pdf", pages=2)
    several = job_fields(tiny_model, ["docs/*"], output="out-several", cache="cache-several")
    one = job_fields(tiny_model, ["docs/*"], output="out-one", cache="cache-one")
    one["tasks"] = one["tasks"][:1]
    for fields in (several, one):  # an image prefix longer than the CPU build's 128-token blocks
        fields["render"].update(dpi=100, max_pixels=256 * 32 * 32)
    summaries = {}
    for fields, name in ((several, "several.yaml"), (one, "one.yaml")):
        result = run_cli("run", str(write_job(fields, name)))
        assert result.returncode == 0, result.stderr[-3000:]
        assert "prompt tokens from vLLM's prefix cache" in result.stdout + result.stderr
        runs = tmp_path / fields["output"] / "_runs"
        summaries[name] = json.loads(next(runs.glob("*.json")).read_text())["summary"]
        share = round(100 * summaries[name]["prompt_tokens_cached"] / summaries[name]["prompt_tokens"])
        assert (f"prompt tokens from prefix cache<b>{share}%</b>"
                in next(runs.glob("*.html")).read_text())  # the run's report says it too
    several_s, one_s = summaries["several.yaml"], summaries["one.yaml"]
    assert several_s["generated"] == 2 * one_s["generated"] >= 2
    # each page's second task: at least one cached block of its image prefix
    assert 0 < several_s["prompt_tokens_cached"] < several_s["prompt_tokens"] / 2
    assert one_s["prompt_tokens_cached"] == 0 < one_s["prompt_tokens"]


def test_every_later_task_of_a_page_reuses_its_images_prefix_however_many_pages_run_at_once(
        tiny_model, write_job, tmp_path):
    """prefix_gate.py (`engine.share_image_prefix: true`) on vLLM's CPU build: 40 distinct
    pages of 1,280 image tokens, four questions each, vLLM's GPU token budget (16,384 a
    step). Held until their page's first
    task decodes, every later task finds all ten 128-token blocks of its page's image in
    vLLM's prefix cache. With `share_image_prefix: false` (a page's tasks together), 12 of
    the 120 later tasks computed their image prefix again on this machine (138,240 cached
    tokens against 153,600), and on an H100 with 400 pages nine in ten did."""
    import numpy as np
    from PIL import Image

    docs = tmp_path / "pages"
    docs.mkdir()
    rng = np.random.default_rng(7)
    pages, tasks = 40, 4
    for i in range(pages):  # 1024x1280: exactly 1,280 image tokens, nothing resized
        Image.fromarray(rng.integers(0, 256, (1280, 1024, 3), dtype=np.uint8)).save(
            docs / f"p{i:02d}.png")
    fields = job_fields(tiny_model, ["pages/*"], tasks=[
        {"name": f"q{t}", "prompt": f"Question {t}?", "max_tokens": 4} for t in range(tasks)])
    fields["render"].update(max_pixels=1280 * 32 * 32)
    fields["engine"].update(max_num_batched_tokens=16384, share_image_prefix=True)
    result = run_cli("run", str(write_job(fields)))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(next((tmp_path / "out" / "_runs").glob("*.json")).read_text())["summary"]
    assert summary["generated"] == pages * tasks
    # each later task: its page's 1,280 image tokens (the first task: none)
    assert summary["prompt_tokens_cached"] >= (tasks - 1) * pages * 1280


def test_pixels_in_the_model_dtype_leave_a_bfloat16_models_answers_unchanged(tiny_model, write_job):
    """With a bfloat16 model the input threads hand the engine float32 pixel values in
    bfloat16 (half the bytes), the cast the model makes itself, and other pixels (0.32's
    uint8) as they are: answers equal those of vLLM as shipped."""
    import torch
    from PIL import Image

    from vlbatch.engine.base import Request
    from vlbatch.engine.vllm_engine import VllmEngine
    from vlbatch.engine.vllm_frontend import InputFront
    from vlbatch.pipeline.imaging import fit_to_budget

    fields = job_fields(tiny_model, ["*.pdf"])
    fields["engine"]["dtype"] = "bfloat16"
    fields["engine"]["pixels_in_model_dtype"] = True
    threaded = load_job(write_job(fields, "bf16-threads.yaml"))
    fields["engine"]["frontend_threads"] = 0
    plain = load_job(write_job(fields, "bf16-plain.yaml"))
    ours, theirs = VllmEngine(threaded), VllmEngine(plain)
    try:
        requests = []
        for i, (w, h) in enumerate([(1240, 1754), (640, 300), (300, 900)]):
            image = fit_to_budget(Image.effect_noise((w, h), 60 + i).convert("RGB"),
                                  threaded.render.min_pixels, threaded.render.max_pixels)
            requests += [Request(f"{i}-{t.name}", image, t.render_prompt(text_layer=f"p{i}"), t)
                         for t in threaded.tasks]
        front = InputFront(ours.llm.llm_engine, 2, 1, pixels_in_model_dtype=True)
        mine = front.prepare(requests[0].request_id, ours.vllm_prompt(requests[0]),
                             ours.sampling_params(requests[0].task)).result(timeout=120)
        front.close()
        engine = theirs.llm.llm_engine
        reference = engine.input_processor.process_inputs(
            requests[0].request_id, theirs.vllm_prompt(requests[0]),
            theirs.sampling_params(requests[0].task), supported_tasks=engine.get_supported_tasks())
        theirs.llm.reset_mm_cache()
        pixels = mine.mm_features[0].data["pixel_values"].data
        expected = reference.mm_features[0].data["pixel_values"].data
        if expected.dtype == torch.float32:  # vLLM 0.26: the processor normalises to float32
            assert pixels.dtype == torch.bfloat16
            assert torch.equal(pixels, expected.to(torch.bfloat16))
        else:  # vLLM 0.32 hands the model uint8 pixels (it normalises them itself): as they are
            assert expected.dtype == torch.uint8 and torch.equal(pixels, expected)
        answers_ours = {c.request_id: c.text for c in ours.generate(iter(requests))}
        answers_theirs = {c.request_id: c.text for c in theirs.generate(iter(requests))}
        assert answers_ours == answers_theirs and all(answers_ours.values())
    finally:
        ours.close()
        theirs.close()


def test_pixels_in_the_model_dtype_converts_float32_pixels_only():
    import torch
    from vllm.multimodal.inputs import MultiModalKwargsItem

    from vlbatch.engine.vllm_frontend import pixels_in

    reference = _processed_item()
    item = pixels_in(reference, torch.bfloat16)
    assert isinstance(item, MultiModalKwargsItem) and item is not reference
    assert item["pixel_values"].data.dtype == torch.bfloat16
    assert torch.equal(item["pixel_values"].data, reference["pixel_values"].data.to(torch.bfloat16))
    assert item["image_grid_thw"] is reference["image_grid_thw"]
    assert reference["pixel_values"].data.dtype == torch.float32  # left as it was
    as_uint8 = pixels_in(pixels_in(reference, torch.uint8), torch.bfloat16)
    assert as_uint8["pixel_values"].data.dtype == torch.uint8  # only float32 is converted


def _processed_item():
    """An image item as vLLM 0.26's processor makes it: float32 pixel values and the grid."""
    import torch
    from vllm.multimodal.inputs import MultiModalFieldElem, MultiModalKwargsItem, MultiModalSharedField

    def elem(data):
        return MultiModalFieldElem(data=data, field=MultiModalSharedField(batch_size=1))

    return MultiModalKwargsItem({"pixel_values": elem(torch.randn(64, 1536)),
                                 "image_grid_thw": elem(torch.tensor([1, 8, 8]))})
