"""Dedupe and the feature cache, through the real run with a fake engine that counts
requests: copies and re-renders merge, same-template pages never do, a later run reads
pages from the feature cache, a damaged entry is rendered again."""

from __future__ import annotations

import io

import diskcache
import polars as pl
from PIL import Image

import bench_dedupe
from conftest import job_fields
from fakes import FakeEngine, fake_prompts
from vlbatch.job import Dedupe, load_job
from vlbatch.pipeline import ingest
from vlbatch.pipeline.dedupe import same_page
from vlbatch.runner import JobRun

FIELDS = ("INV-2026-00417", "2026-11-30", "Jane Smith", "1,204.50 EUR")


def write_invoice(path, fields=FIELDS):
    path.write_bytes(bench_dedupe.invoice(*fields))
    return path


def export(pdf_path, out, quality=None):
    """The page as vlbatch renders it, saved as an image file (PNG, or JPEG at `quality`)."""
    page = ingest.render_page(str(pdf_path), "pdf", 1, 150, 64 * 32 * 32, 1280 * 32 * 32, None)
    page.image().save(out, "JPEG" if quality else "PNG", **({"quality": quality} if quality else {}))
    return out


def run(job_path, **kwargs):
    engine = FakeEngine()
    stats = JobRun(load_job(job_path, **kwargs), engine_factory=lambda j, p: engine,
                   prompts_factory=fake_prompts).execute()
    return stats, engine


def one_task(fields):
    fields["tasks"] = [{"name": "read", "prompt": "Read this page.", "max_tokens": 8}]
    fields["render"] = {"dpi": 150, "workers": 2}  # the default pixel budget
    return fields


def test_copies_merge_same_template_pages_never(write_job, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    a = write_invoice(docs / "a.pdf")
    export(a, docs / "a-copy.png")  # the same pixels: an exact copy
    export(a, docs / "a-q80.jpg", quality=80)  # a JPEG re-encoding: a near copy
    b = write_invoice(docs / "b.pdf", (FIELDS[0][:-1] + "1", *FIELDS[1:]))  # one digit
    export(b, docs / "b-q80.jpg", quality=80)
    write_invoice(docs / "c.pdf", (*FIELDS[:3], "1,204.80 EUR"))  # one amount
    stats, engine = run(write_job(one_task(job_fields("fake-model", ["docs/*"]))))
    df = pl.read_parquet(tmp_path / "out" / "results" / "*.parquet").sort("source")
    assert len(engine.requests) == 3 and stats.near_duplicates == 2
    origin = dict(zip(df["source"], df["reused_from"]))
    group_a = {origin["docs/a-copy.png"], origin["docs/a-q80.jpg"], origin["docs/a.pdf"]}
    group_b = {origin["docs/b-q80.jpg"], origin["docs/b.pdf"]}
    assert len(group_a) == 2 and None in group_a  # one of the three generated, two reused it
    assert len(group_b) == 2 and None in group_b and origin["docs/c.pdf"] is None
    answers = dict(zip(df["source"], df["output"]))
    assert answers["docs/a.pdf"] == answers["docs/a-q80.jpg"] == answers["docs/a-copy.png"]
    assert len({answers["docs/a.pdf"], answers["docs/b.pdf"], answers["docs/c.pdf"]}) == 3


def test_rerender_at_another_dpi_reuses_the_answer_across_runs(write_job, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    write_invoice(docs / "a.pdf")
    fields = one_task(job_fields("fake-model", ["docs/*"]))
    run(write_job(fields))
    fields["render"]["dpi"] = 100  # another job, same cache: a smaller raster of the page
    fields["output"] = "out100"
    stats, engine = run(write_job(fields))
    assert len(engine.requests) == 0 and stats.near_duplicates == 1 and stats.cache_hits == 1
    df = pl.read_parquet(tmp_path / "out100" / "results" / "*.parquet")
    assert df["cached"].to_list() == [True] and df["reused_from"].to_list() == [None]
    # a changed field at another DPI carries another text layer: generated, not merged
    write_invoice(docs / "a.pdf", (*FIELDS[:3], "9,999.99 EUR"))
    stats, engine = run(write_job(fields))
    assert len(engine.requests) == 1 and stats.near_duplicates == 0


def test_feature_cache_skips_rendering_and_heals(write_job, tmp_path, samples):
    fields = job_fields("fake-model", [f"{samples}/*"])
    stats, _ = run(write_job(fields))
    assert stats.feature_cache_hits == 0
    first = pl.read_parquet(tmp_path / "out" / "results" / "*.parquet")
    with diskcache.Cache(str(tmp_path / "cache" / "features")) as cache:
        images = [k for k in cache.iterkeys() if str(k).startswith("image:")]
        assert len(images) == 6  # 7 pages, one an exact copy
        cache.set(images[0], b"not a png")
        Image.open(io.BytesIO(cache.get(images[1])))  # the others are real PNGs
    fields["output"] = "out2"
    fields["result_cache"] = False
    stats, engine = run(write_job(fields))
    assert stats.feature_cache_hits == 6 and stats.cache_corrupt == 1  # one rendered again
    second = pl.read_parquet(tmp_path / "out2" / "results" / "*.parquet")
    joined = first.join(second, on=["source", "page", "task"])
    assert (joined["content_hash"] == joined["content_hash_right"]).all()
    assert (joined["output"] == joined["output_right"]).all()  # the same pixels reached the engine


def test_pixel_check_on_the_benchmark_set():
    settings = Dedupe()
    cases = bench_dedupe.pairs(FIELDS)
    for kind, name, a, b in cases:
        merged = same_page(a.image, b.image, a.text, b.text, settings)
        if kind == "must":
            assert merged, name
        if kind == "never":
            assert not merged, name


def test_cache_stats_and_clear_cli(write_job, tmp_path, samples):
    import json

    from typer.testing import CliRunner

    from vlbatch.cli import app

    job = write_job(job_fields("fake-model", [f"{samples}/chart.jpg"]))
    run(job)
    stats = json.loads(CliRunner().invoke(app, ["cache", "stats", str(job), "--json"]).output)
    kinds = {row["cache"]: row["kinds"] for row in stats["caches"]}
    assert kinds["results"] == {"result": 2} and kinds["features"]["image"] == 1
    cleared = CliRunner().invoke(app, ["cache", "clear", str(job), "--only", "results"])
    assert cleared.exit_code == 0 and "removed 2 entries" in cleared.output
    _, engine = run(job, output=str(tmp_path / "fresh"))
    assert len(engine.requests) == 2  # answers gone, so generated again


def test_namespaces_never_share_answers(write_job, tmp_path, samples):
    fields = job_fields("fake-model", [f"{samples}/chart.jpg"], cache_namespace="tenant-a")
    run(write_job(fields))
    fields.update(cache_namespace="tenant-b", output="out-b")
    stats, engine = run(write_job(fields))
    assert len(engine.requests) == 2 and stats.cache_hits == 0
    fields.update(cache_namespace="tenant-a", output="out-a2")
    stats, engine = run(write_job(fields))
    assert len(engine.requests) == 0 and stats.cache_hits == 2
