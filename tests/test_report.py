"""The run report (OUTPUT/_runs/<run_id>.html), its cost figures and `vlbatch plan`: after a
real run of the CPU engine, read in a real headless browser (Debian's chromium)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest
import yaml
from conftest import job_fields, run_cli

from vlbatch.pipeline.runlog import Timeline

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("VLBATCH_REQUIRE_BROWSER") != "1",
    reason="no chromium here (apt-get install chromium; .ci/run installs it)")


@pytest.fixture(scope="module")
def night(tiny_model, tmp_path_factory):
    """A real run: a typed-fields task, a free-text task, a broken file and $2.50/GPU-hour."""
    import make_samples

    folder = tmp_path_factory.mktemp("night")
    samples = folder / "samples"
    make_samples.main(samples)
    (samples / "broken.pdf").write_bytes(b"%PDF-1.7 this is not a pdf")
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(job_fields(tiny_model, [f"{samples}/*"], tasks=[
        {"name": "flags", "prompt": "Is it paid? What is it?", "max_tokens": 40,
         "fields": {"paid": "boolean", "kind": ["invoice", "receipt", "other"]}},
        {"name": "text", "prompt": "Transcribe this page.", "max_tokens": 24}],
        cost_per_gpu_hour=2.5)))
    before = run_cli("plan", str(job), "--json")
    result = run_cli("run", str(job))
    assert result.returncode == 0, result.stderr[-3000:]
    return {"job": job, "out": folder / "out", "plan_before": before, "run": result}


def _report(out: Path) -> tuple[dict, Path]:
    [manifest_path] = (out / "_runs").glob("*.json")
    manifest = json.loads(manifest_path.read_text())
    return manifest, out / "_runs" / f"{manifest['run_id']}.html"


def test_plan_says_what_a_run_would_do_without_writing_or_starting_the_engine(night):
    before = night["plan_before"]
    assert before.returncode == 0, before.stderr[-3000:]
    plan = json.loads(before.stdout)
    # 5 sample files (7 pages) + broken.pdf, which does not open
    assert (plan["inputs_matched"], plan["pages_in_scope"], plan["pages_already_done"]) == (6, 8, 0)
    assert plan["pages_unopenable"] == 1 and plan["requests"] == 7 * 2
    assert plan["requests_by_task"] == {"flags": 7, "text": 7}
    assert plan["prompt_tokens"] > 7 * 2 * 20 and "tokenizer" in plan["prompt_tokens_note"]
    assert plan["output_tokens"] == 7 * 40 + 7 * 24  # max_tokens: nothing earlier to go by
    assert plan["estimated_seconds"] is None
    manifest, _ = _report(night["out"])  # the plan wrote nothing: the run's is the only one
    assert manifest["summary"]["pages_already_done"] == 0

    again = run_cli("plan", str(night["job"]), "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    after = json.loads(again.stdout)
    assert after["pages_already_done"] == 8 and after["requests"] == 0
    more = run_cli("plan", str(night["job"]), "--json", "--retry-errors")
    retry = json.loads(more.stdout)  # broken.pdf again: an error row, nothing to generate
    assert (retry["pages_to_do"], retry["pages_unopenable"], retry["requests"]) == (1, 1, 0)

    changed = night["job"].parent / "changed.yaml"  # text asks for more: its rows are stale
    fields = yaml.safe_load(night["job"].read_text())
    fields["tasks"][1]["max_tokens"] = 30
    changed.write_text(yaml.safe_dump(fields))
    stale = json.loads(run_cli("plan", str(changed), "--json").stdout)
    assert stale["requests_by_task"] == {"text": 7} and stale["rows_stale"] >= 7
    results = pl.read_delta(str(night["out"] / "results"))
    text = results.filter(pl.col("task") == "text")["output_tokens"]
    assert stale["output_tokens"] == round(text.mean() * 7)  # earlier answers, not max_tokens
    assert stale["estimated_seconds"] > 0 and manifest["run_id"] in stale["estimate_note"]
    assert not (night["out"] / "_runs" / "changed").exists()

    table = run_cli("plan", str(night["job"]))
    assert table.returncode == 0 and "pages already done" in table.stdout


def test_plan_of_a_job_with_a_missing_model_exits_3_and_makes_no_output(write_job, tmp_path,
                                                                        samples):
    job = write_job(job_fields("./no-such-model", [f"{samples}/*"]))
    result = run_cli("plan", str(job))
    assert result.returncode == 3 and "no-such-model" in result.stderr
    assert not (tmp_path / "out").exists()


def test_cost_in_the_summary_and_the_manifest(night):
    manifest, _ = _report(night["out"])
    s = manifest["summary"]
    # vLLM's CPU build: the run held no GPU, so no GPU-hours and nothing at the GPU rate
    # (a GPU engine's figures: test_cost_of_a_run_on_a_gpu_engine_and_of_one_from_the_cache)
    assert s["engine_device"] == "cpu" and s["cost_per_gpu_hour"] == 2.5
    assert (s["gpus"], s["gpu_hours"], s["pages_per_gpu_hour"], s["cost"]) == (0, 0.0, None, 0.0)
    assert "no GPU held" in night["run"].stdout
    assert "GPU-hours" not in night["run"].stdout and "cost per million" not in night["run"].stdout


def test_the_report_is_written_at_the_end_of_the_run(night):
    manifest, path = _report(night["out"])
    html = path.read_text()
    assert path.stat().st_size < 1_000_000
    assert 'id="throughput"><svg' in html and 'id="timings"><svg' in html
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", html)  # nothing fetched
    gallery = html[html.index("id=gallery"):]
    pages = manifest["summary"]["pages_total"]
    assert gallery.count("<div class=page>") == pages == 8
    assert gallery.count('<img src="data:image/') == 7  # broken.pdf has none
    assert "broken.pdf" in gallery and "Transcribe" not in gallery
    assert "<table class=fields>" in gallery and "paid" in gallery  # answers as tables
    assert "Typed fields" in html and "OUTPUT/fields/flags/" in html
    assert "CPU, no GPU" in html and "cost per million pages" not in html  # no GPU held
    timeline = manifest["timeline"]
    assert timeline["columns"][:3] == ["t_s", "pages", "requests"]
    assert timeline["rows"][-1][1] == manifest["summary"]["pages_finished"]
    assert {f["source"] for f in manifest["slowest_files"]} <= set(manifest["inputs"]["new"])
    assert manifest["inputs"]["counts"]["new"] == manifest["inputs"]["counts"]["matched"] == 6
    assert "inputs new / changed / vanished" in html

    path.unlink()  # `vlbatch report` writes it again; an unknown run exits 3
    again = run_cli("report", str(night["out"]))
    assert again.returncode == 0 and path.is_file() and str(path) in again.stdout.replace("\n", "")
    missing = run_cli("report", str(night["out"]), "--run", "19990101T000000Z-000000")
    assert missing.returncode == 3 and "has no run" in missing.stderr


def _chromium(*args: str, page: Path) -> subprocess.CompletedProcess:
    assert CHROMIUM is not None, "VLBATCH_REQUIRE_BROWSER=1 but no chromium on PATH"
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", "--enable-logging=stderr", "--v=0",
                           "--virtual-time-budget=5000", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=120)


def _console(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


# run in the page after it loads: each gallery image decoded, each plot laid out
CHECK = """<script>addEventListener('load', () => {
  const imgs = [...document.querySelectorAll('#gallery img')];
  const broken = imgs.filter(i => !i.complete || i.naturalWidth < 50);
  const plots = [...document.querySelectorAll('.plot svg')];
  const flat = plots.filter(s => { const b = s.getBoundingClientRect();
                                   return b.width < 200 || b.height < 80; });
  console.log(`vlbatch-check images=${imgs.length} broken=${broken.length} ` +
              `plots=${plots.length} flat=${flat.length} texts=${document.querySelectorAll('svg text').length}`);
});</script>"""


@needs_browser
def test_the_report_opens_in_a_real_browser(night, tmp_path):
    from PIL import Image

    _, path = _report(night["out"])
    shot = tmp_path / "report.png"
    loaded = _chromium("--window-size=1200,3000", f"--screenshot={shot}", page=path)
    assert shot.is_file(), loaded.stderr[-2000:]
    assert _console(loaded) == []  # the page logs no errors (it has no script at all)
    with Image.open(shot) as image:
        small = image.convert("RGB").resize((120, 300))
    pixels = list(small.getdata())
    ink = sum(1 for p in pixels if min(p) < 200) / len(pixels)
    assert 0.02 < ink < 0.8 and len(set(pixels)) > 50  # text, plots and thumbnails drawn

    dom = _chromium("--dump-dom", page=path).stdout
    assert dom.count("<svg") >= 5 and 'id="gallery"' in dom
    assert "<table class=\"fields\">" in dom

    checked = tmp_path / "checked.html"  # the same page with a probe script
    checked.write_text(path.read_text().replace("</body>", CHECK + "</body>"))
    [line] = [c for c in _console(_chromium("--dump-dom", page=checked)) if "vlbatch-check" in c]
    figures = dict(re.findall(r"(\w+)=(\d+)", line))
    assert figures["images"] == "7" and figures["broken"] == "0", line
    assert int(figures["plots"]) >= 5 and figures["flat"] == "0", line
    assert int(figures["texts"]) > 20, line  # axis labels and titles are text


@needs_browser
def test_the_console_check_catches_an_error(tmp_path):
    """The browser check above can fail: a page that logs an error is seen."""
    page = tmp_path / "bad.html"
    page.write_text("<html><body><p>x</p><script>console.error('boom')</script></body></html>")
    assert any("boom" in line for line in _console(_chromium("--dump-dom", page=page)))


def test_the_report_of_a_100k_page_run_stays_small(night, tmp_path):
    """100,000 pages, a 5,000-sample timeline and 3,000 error reasons: the report samples."""
    from deltalake import write_deltalake

    from vlbatch.output.schemas import PAGE_SCHEMA, RESULT_SCHEMA
    from vlbatch.run_report import write_report

    manifest, _ = _report(night["out"])
    out, run_id, n = tmp_path / "big", manifest["run_id"], 100_000
    for folder in ("results", "pages", "_runs"):
        (out / folder).mkdir(parents=True)
    manifest["timeline"]["rows"] = [[i * 0.5, i * 20, i * 20, 64, i * 900, i]
                                    for i in range(5_000)]
    manifest["summary"]["error_reasons"] = {f"reason {i}": 1 for i in range(3_000)}
    manifest["slowest_files"] = [{"source": f"/in/doc-{i}.pdf", "pages": 10, "render_s": 1.0,
                                  "output_tokens": 5, "rows_error": 0} for i in range(20)]
    (out / "_runs" / f"{run_id}.json").write_text(json.dumps(manifest))
    source = [f"/in/doc-{i // 10}.pdf" for i in range(n)]
    status = ["error" if i % 7 == 0 else "ok" for i in range(n)]
    rows = {"source": source, "page": [i % 10 for i in range(n)], "task": ["text"] * n,
            "output": ["word " * 400 if s == "ok" else None for s in status],
            "status": status, "error": [f"reason {i % 3000}" if s == "error" else None
                                        for i, s in enumerate(status)],
            "run_id": [run_id] * n, "output_tokens": [i % 500 for i in range(n)],
            "cached": [False] * n, "source_sha256": ["0" * 64] * n}
    table = pa.table({f.name: rows.get(f.name, [None] * n) for f in RESULT_SCHEMA},
                     schema=RESULT_SCHEMA)
    write_deltalake(str(out / "results"), table)
    pages = pa.table({f.name: rows.get(f.name, [None] * n) if f.name != "error" else [None] * n
                      for f in PAGE_SCHEMA},
                     schema=PAGE_SCHEMA)
    write_deltalake(str(out / "pages"), pages)

    html = write_report(out, run_id).read_text()
    assert len(html.encode()) < 1_500_000
    gallery = html[html.index("id=gallery"):]
    assert gallery.count("<div class=page>") == 12
    assert gallery.count("no image: the file is gone") == 12  # said, not drawn
    errors_table = html[html.index("<h3>By file</h3>"):html.index("<h2>Slowest files")]
    assert errors_table.count("<tr>") == 1 + 20  # header + the top 20 files


def test_the_timeline_keeps_a_bounded_number_of_samples():
    now = [0.0]
    timeline = Timeline(interval_s=1.0, max_samples=100, clock=lambda: now[0])
    for second in range(10_000):
        now[0] = float(second)
        timeline.sample(second, second, 3, 0, 0)
    now[0] = 10_000.5
    timeline.sample(10_000, 10_000, 0, 0, 0, force=True)
    rows = timeline.as_dict()["rows"]
    assert len(rows) < 100 and rows[0][0] == 0.0 and rows[-1][:2] == [10_000.5, 10_000]
    times = [r[0] for r in rows]
    assert times == sorted(times) and max(b - a for a, b in zip(times, times[1:])) <= 256
    assert timeline.interval_s == 128.0


def test_no_report_when_turned_off_and_a_report_failure_is_not_a_failed_run(
        samples, write_job, tmp_path, caplog, monkeypatch):
    from fakes import FakeEngine, fake_prompts

    from vlbatch.job import load_job
    from vlbatch.run import run_job

    def run(fields, output):
        job = load_job(write_job(fields), output=str(tmp_path / output))
        return run_job(job, engine_factory=lambda job, prompts: FakeEngine(),
                       prompts_factory=fake_prompts)

    stats = run(job_fields("fake-model", [f"{samples}/*"], report=False), "quiet")
    assert stats.rows_ok == 14 and stats.gpus == 1 and stats.cost is None
    assert list((tmp_path / "quiet" / "_runs").glob("*.html")) == []

    # every answer from the result cache: no engine started, no GPU-hours, nothing to pay
    stats = run(job_fields("fake-model", [f"{samples}/*"], cost_per_gpu_hour=3.0), "cached")
    assert stats.cache_hits == 14 and (stats.gpus, stats.gpu_hours, stats.cost) == (0, 0.0, 0.0)
    [html] = (tmp_path / "cached" / "_runs").glob("*.html")
    assert "cost per million pages" in html.read_text()

    import vlbatch.run_report.page as page  # a report that fails to draw

    monkeypatch.setattr(page, "render_page",
                        lambda data: (_ for _ in ()).throw(RuntimeError("plot failed")))
    with caplog.at_level("WARNING", logger="vlbatch"):
        stats = run(job_fields("fake-model", [f"{samples}/*"], result_cache=False), "failing")
    assert stats.rows_ok == 14 and "run report not written: plot failed" in caplog.text
    runs = tmp_path / "failing" / "_runs"
    assert len(list(runs.glob("*.json"))) == 1 and not list(runs.glob("*.html"))
    assert not list(runs.glob(".*.tmp"))


def test_cost_of_a_run_on_a_gpu_engine_and_of_one_from_the_cache(samples, write_job, tmp_path):
    """An engine on a GPU: GPUs held, GPU-hours over the run's wall time, the cost at the
    job's rate, in the summary table and the report."""
    from fakes import FakeEngine, fake_prompts

    from vlbatch.cost import cost_rows
    from vlbatch.job import load_job
    from vlbatch.run import run_job

    class GpuEngine(FakeEngine):
        device = "gpu"

    job = load_job(write_job(job_fields("fake-model", [f"{samples}/*"], cost_per_gpu_hour=2.5)))
    s = run_job(job, engine_factory=lambda job, prompts: GpuEngine(), prompts_factory=fake_prompts)
    assert s.engine_device == "gpu" and s.gpus == 1
    assert s.gpu_hours == pytest.approx(s.seconds / 3600, abs=1e-6)
    assert s.cost == pytest.approx(s.gpu_hours * 2.5, rel=0.01, abs=1e-7)
    assert s.cost_per_million_pages == pytest.approx(s.cost / s.pages_finished * 1e6, rel=0.01)
    shown = dict(cost_rows(s))
    assert shown["GPUs held"] == "1" and "cost per million pages" in shown
    [html] = (tmp_path / "out" / "_runs").glob("*.html")
    assert "GPU-hours" in html.read_text() and "cost per million pages" in html.read_text()
