"""Dedupe and the feature cache, through the real run with a fake engine that counts
requests: copies and re-renders merge, same-template pages never do, a later run reads
pages from the feature cache, a damaged entry is rendered again."""

from __future__ import annotations

import pytest

import io
import json
from pathlib import Path

import diskcache
import polars as pl
from PIL import Image, ImageDraw

import bench_dedupe
from conftest import job_fields
from fakes import FakeEngine, fake_prompts
from vlbatch.job import Dedupe, Render, load_job
from vlbatch.pipeline import ingest
from vlbatch.pipeline.cache import FeatureCache
from vlbatch.pipeline.dedupe import Deduper, bands, layer_key
from vlbatch.pipeline.pixelcheck import same_page
from vlbatch.pipeline.discover import file_sha256
from vlbatch.pipeline.render import PageSpec, PageStore, render_page
from vlbatch.run import run_job

FIELDS = ("INV-2026-00417", "2026-11-30", "Jane Smith", "1,204.50 EUR")
RENDER = Render(dpi=150)  # the default pixel budget


def write_invoice(path, fields=FIELDS):
    path.write_bytes(bench_dedupe.invoice(*fields))
    return path


def export(pdf_path, out, quality=None):
    """The page as vlbatch renders it, saved as an image file (PNG, or JPEG at `quality`)."""
    page = ingest.render(str(pdf_path), "pdf", 1, RENDER)
    page.image().save(out, "JPEG" if quality else "PNG", **({"quality": quality} if quality else {}))
    return out


def run(job_path, **kwargs):
    engine = FakeEngine()
    stats = run_job(load_job(job_path, **kwargs), engine_factory=lambda j, p: engine,
                    prompts_factory=fake_prompts)
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
    df = pl.read_delta(str(tmp_path / "out" / "results")).sort("source")
    assert len(engine.requests) == 3 and stats.near_copies == 2
    origin = dict(zip(df["matched_path"], df["reused_from"]))
    group_a = {origin["docs/a-copy.png"], origin["docs/a-q80.jpg"], origin["docs/a.pdf"]}
    group_b = {origin["docs/b-q80.jpg"], origin["docs/b.pdf"]}
    assert len(group_a) == 2 and None in group_a  # one of the three generated, two reused it
    assert len(group_b) == 2 and None in group_b and origin["docs/c.pdf"] is None
    answers = dict(zip(df["matched_path"], df["output"]))
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
    assert len(engine.requests) == 0 and stats.near_copies == 1 and stats.cache_hits == 1
    df = pl.read_delta(str(tmp_path / "out100" / "results"))
    assert df["cached"].to_list() == [True] and df["reused_from"].to_list() == [None]
    # a changed field at another DPI carries another text layer: generated, not merged
    write_invoice(docs / "a.pdf", (*FIELDS[:3], "9,999.99 EUR"))
    stats, engine = run(write_job(fields))
    assert len(engine.requests) == 1 and stats.near_copies == 0


def test_feature_cache_skips_rendering_and_heals(write_job, tmp_path, samples):
    fields = job_fields("fake-model", [f"{samples}/*"])
    stats, _ = run(write_job(fields))
    assert stats.pages_from_feature_cache == 0
    first = pl.read_delta(str(tmp_path / "out" / "results"))
    with diskcache.Cache(str(tmp_path / "cache" / "default" / "features")) as cache:
        images = [k for k in cache.iterkeys() if str(k).startswith("image:")]
        assert len(images) == 6  # 7 pages, one an exact copy
        cache.set(images[0], b"not a png")
        Image.open(io.BytesIO(cache.get(images[1])))  # the others are real PNGs
    fields["output"] = "out2"
    fields["result_cache"] = False
    stats, engine = run(write_job(fields))
    assert stats.pages_from_feature_cache == 6 and stats.cache_corrupt == 1  # one rendered again
    second = pl.read_delta(str(tmp_path / "out2" / "results"))
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


def test_marks_keep_pages_apart_and_rerenders_merge_on_the_generated_set():
    """Every layout of the generated set, one document each: its re-renders and raster
    files at other resolutions merge; a tick, signature, stamp, struck-through line,
    watermark or speck (the text layer unchanged) keeps the pages apart, in any forms.
    Seed 2 holds the two strikes that once merged at 100 dpi: through a short number and a
    two-letter label, where only one pixel of the line lies on paper (`blank_dot`)."""
    import dedupe_set

    settings, missed = Dedupe(), []
    for kind, layout, name, a, b in dedupe_set.generated_pairs(seeds=(0, 2)):
        merged = same_page(a.comparison(), b.comparison(), a.text_layer, b.text_layer, settings)
        if kind == "must":
            assert merged, (layout, name)
        elif merged:
            missed.append((layout, name))
    assert missed == []


def struck_invoice(folder: Path) -> tuple[Path, Path]:
    """The generated set's invoice of seed 3, as it is and with one line struck through: at
    100 dpi the strike leaves about one pixel on paper, so the pixel check alone merges the
    two (bench_dedupe.py --seeds 6); their drawings differ."""
    import dedupe_set

    plain, struck = folder / "plain.pdf", folder / "struck.pdf"
    dedupe_set.layout("invoice", 3).save(plain)
    dedupe_set.mark(dedupe_set.layout("invoice", 3), "strike", 3).save(struck)
    return plain, struck


def test_pdf_pages_whose_drawings_differ_never_merge(tmp_path):
    plain, struck = struck_invoice(tmp_path)
    a = ingest.render(str(plain), "pdf", 1, Render(dpi=150))
    b = ingest.render(str(struck), "pdf", 1, Render(dpi=100))
    again = ingest.render(str(plain), "pdf", 1, Render(dpi=100))
    assert a.text_layer == b.text_layer and a.drawings == again.drawings != b.drawings
    settings = Dedupe()
    assert same_page(a.image(), b.image(), a.text_layer, b.text_layer, settings)  # pixels alone
    assert not same_page(a.image(), b.image(), a.text_layer, b.text_layer, settings,
                         a.drawings, b.drawings)
    assert same_page(a.image(), again.image(), a.text_layer, again.text_layer, settings,
                     a.drawings, again.drawings)  # a re-render still merges
    image_file = export(struck, tmp_path / "struck.png")  # no drawings: the pixels decide
    assert ingest.render(str(image_file), "image", 1, RENDER).drawings is None


def test_drawings_keep_pages_apart_across_runs(write_job, tmp_path):
    """The digest travels through the feature cache's page entries and dedupe index: a run
    at 100 dpi merges the plain invoice with the last run's 150-dpi page, not the struck one;
    a page entry cached without a digest (an older version) is rendered again."""
    docs = tmp_path / "docs"
    docs.mkdir()
    plain, struck = struck_invoice(docs)
    fields = one_task(job_fields("fake-model", ["docs/plain.pdf"]))
    run(write_job(fields))
    fields["inputs"], fields["output"] = ["docs/*.pdf"], "out100"
    fields["render"]["dpi"] = 100
    stats, engine = run(write_job(fields))
    assert len(engine.requests) == 1 and stats.near_copies == 1
    df = pl.read_delta(str(tmp_path / "out100" / "results"))
    cached = dict(zip(df["matched_path"], df["cached"]))
    assert cached == {"docs/plain.pdf": True, "docs/struck.pdf": False}

    key = FeatureCache.page_key(file_sha256(str(plain)), 1, 100, RENDER.min_pixels, RENDER.max_pixels)
    with diskcache.Cache(str(tmp_path / "cache" / "default" / "features")) as cache:
        meta = json.loads(cache[key])
        assert meta["drawings"] is not None
        del meta["drawings"]
        cache[key] = json.dumps(meta).encode()
    PageStore.open(str(tmp_path / "cache" / "default"), 1.0)
    try:
        spec = PageSpec(str(plain), "pdf", 1, key)
        page = render_page(spec, Render(dpi=100))
        assert not page.from_cache and page.drawings is not None
        assert render_page(spec, Render(dpi=100)).from_cache  # and cached again, with it
    finally:
        PageStore.close()


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
    assert (tmp_path / "cache" / "default" / "features").is_dir()  # --only results
    _, engine = run(job, output=str(tmp_path / "fresh"))
    assert len(engine.requests) == 2  # answers gone, so generated again


def test_namespaces_share_nothing_and_clear_alone(write_job, tmp_path, samples):
    """Answers, rendered pages and the dedupe index are a namespace's own: tenant B's copy
    of tenant A's page is neither served A's answer, nor rendered from A's pages, nor
    merged with A's page; clearing A leaves B."""
    from typer.testing import CliRunner

    from vlbatch.cli import app

    fields = job_fields("fake-model", [f"{samples}/receipt.png"], cache_namespace="tenant-a")
    run(write_job(fields, "a.yaml"))
    fields.update(cache_namespace="tenant-b", output="out-b",
                  inputs=[f"{samples}/receipt-copy.png"])  # the same pixels, another file
    stats, engine = run(write_job(fields, "b.yaml"))
    assert len(engine.requests) == 2 and stats.cache_hits == 0
    assert stats.pages_from_feature_cache == 0 and stats.exact_copies == 0
    assert pl.read_delta(str(tmp_path / "out-b" / "results"))["reused_from"].is_null().all()
    fields.update(cache_namespace="tenant-a", output="out-a2", inputs=[f"{samples}/receipt.png"])
    stats, engine = run(write_job(fields, "a2.yaml"))
    assert len(engine.requests) == 0 and stats.cache_hits == 2

    cleared = CliRunner().invoke(app, ["cache", "clear", str(tmp_path / "a.yaml")])
    assert cleared.exit_code == 0 and "namespaces: tenant-a" in cleared.output
    left = CliRunner().invoke(app, ["cache", "stats", "--cache-dir", str(tmp_path / "cache"),
                                    "--all", "--json"])
    rows = {(r["namespace"], r["cache"]): r["entries"] for r in json.loads(left.output)["caches"]}
    assert rows == {("tenant-b", "results"): 2, ("tenant-b", "features"): rows[("tenant-b", "features")]}
    assert rows[("tenant-b", "features")] > 0
    refused = CliRunner().invoke(app, ["cache", "clear", "--cache-dir", str(tmp_path / "cache")])
    assert refused.exit_code == 2 and "--namespace" in refused.output


class CountingFeatureCache(FeatureCache):
    """The real feature cache, counting the index reads the dedupe makes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, index_in_background=False, **kwargs)
        self.band_reads = self.phash_reads = 0
        self.writing = False

    def members(self, key):
        self.band_reads += not self.writing and key.startswith("band:")
        return super().members(key)

    def _write_index(self, *args):  # its own reads, before it writes, are not the dedupe's
        self.writing = True
        super()._write_index(*args)
        self.writing = False

    def phash(self, content_hash):
        self.phash_reads += 1
        return super().phash(content_hash)


def test_dedupe_reads_the_index_only_for_earlier_runs(tmp_path):
    a = write_invoice(tmp_path / "a.pdf")
    b = write_invoice(tmp_path / "b.pdf", (FIELDS[0][:-1] + "1", *FIELDS[1:]))
    near_a = export(a, tmp_path / "a-q80.jpg", quality=80)
    PageStore.open(str(tmp_path / "cache"), 1.0)  # as a render worker does
    pages = {name: render_page(PageSpec(str(path), kind, 1, name), RENDER)
             for name, path, kind in (("a", a, "pdf"), ("b", b, "pdf"), ("near_a", near_a, "image"))}
    PageStore.close()
    relations = []

    def canonical(deduper, name):
        page = pages[name]
        found, relation = deduper.match(page)
        relations.append(relation)
        return found

    # a fresh cache: nothing of earlier runs to search, yet this run's copies merge
    index = CountingFeatureCache(tmp_path / "cache")
    index.empty_at_open = True  # as when the run opened it, before its workers wrote pages
    first = Deduper(Dedupe(), index=index)
    assert canonical(first, "a") == pages["a"].content_hash
    assert canonical(first, "near_a") == pages["a"].content_hash
    assert canonical(first, "b") == pages["b"].content_hash
    assert index.band_reads == index.phash_reads == 0
    index.close()

    # the next run: a page canonical before costs one read; a near copy of an earlier page
    # is found through the bands, whose entries carry the perceptual hashes
    index = CountingFeatureCache(tmp_path / "cache")
    second = Deduper(Dedupe(), index=index)
    assert canonical(second, "b") == pages["b"].content_hash
    assert (index.band_reads, index.phash_reads) == (0, 1)
    assert canonical(second, "near_a") == pages["a"].content_hash
    assert index.band_reads == 16 and index.phash_reads == 2 and relations[-1] == "near"
    canonical(second, "near_a")  # the same bands again: read once per run
    assert index.band_reads == 16
    index.close()


def test_index_entries_without_their_safeguards_never_merge(tmp_path):
    """A canonical page of an earlier run whose layers and comparison image the cache no
    longer holds (evicted, or written by an older version), or whose band entries lack the
    layer key and thumbnail, is no candidate: a near copy of it is generated, not merged."""
    a = write_invoice(tmp_path / "a.pdf")
    PageStore.open(str(tmp_path / "cache"), 1.0)  # as a render worker does
    page = render_page(PageSpec(str(a), "pdf", 1, "a"), RENDER)
    PageStore.close()
    near = ingest.render(str(export(a, tmp_path / "a.jpg", quality=80)), "image", 1, RENDER)
    index = FeatureCache(tmp_path / "cache", index_in_background=False)
    Deduper(Dedupe(), index=index).match(page)
    index.close()

    def match_near():
        index = FeatureCache(tmp_path / "cache", index_in_background=False)
        try:
            return Deduper(Dedupe(), index=index).match(near)
        finally:
            index.close()

    assert match_near() == (page.content_hash, "near")  # all there: it merges
    with diskcache.Cache(str(tmp_path / "cache" / "features")) as cache:
        look = cache["look:" + page.content_hash]
        del cache["look:" + page.content_hash]  # evicted
    assert match_near() == (near.content_hash, "new")
    with diskcache.Cache(str(tmp_path / "cache" / "features")) as cache:
        cache["look:" + page.content_hash] = look
        del cache["phash:" + near.content_hash]  # the last call indexed the near copy
        for band in bands(page.phash):  # as an older version wrote them
            cache["band:" + band] = json.dumps([[page.content_hash, page.phash]]).encode()
    assert match_near() == (near.content_hash, "new")


def test_background_index_writes_in_batches_as_page_by_page(tmp_path):
    """The writer thread indexes queued pages a batch per transaction; the band and layer
    entries are the same as when each page is written alone, in order, the oldest dropped
    past 64."""
    import random
    from types import SimpleNamespace

    rng = random.Random(7)
    shared = "".join(rng.choice("0123456789abcdef") for _ in range(256))
    pages = []  # 100 pages sharing 12 of their 16 bands, as same-layout pages do
    for i in range(100):
        own = "".join(rng.choice("0123456789abcdef") for _ in range(64))
        pages.append(SimpleNamespace(content_hash=f"{i:064x}", phash=shared[:192] + own,
                                     text_layer=f"text {i % 3}" if i % 2 else None,
                                     drawings=None, thumb=bytes([i]) * 4096, compare_png=None,
                                     compare_source=None, comparison_deferred=False))

    def layer(page):
        return layer_key(page.text_layer, page.drawings)

    def entries(folder):
        with diskcache.Cache(str(folder / "features")) as cache:
            return {k: cache[k] for k in cache.iterkeys() if not k.startswith("image:")}

    alone = FeatureCache(tmp_path / "alone", index_in_background=False)
    for page in pages:
        alone.add(page, bands(page.phash), layer(page))
    alone.close()

    batched = FeatureCache(tmp_path / "batched")
    transactions = []
    write_index = batched._write_index
    batched._write_index = lambda items: (transactions.append(len(items)), write_index(items))
    for page in pages:
        batched.add(page, bands(page.phash), layer(page))
    batched.close()

    assert sum(transactions) == 100 and max(transactions) <= 64
    found = entries(tmp_path / "batched")
    assert found == entries(tmp_path / "alone")
    shared_band = json.loads(found["band:" + bands(pages[0].phash)[0]])
    assert [m[0] for m in shared_band] == [p.content_hash for p in pages[-64:]]
    one_layer = json.loads(found["layer:" + layer(pages[1])])
    assert [m[0] for m in one_layer] == [p.content_hash for p in pages if layer(p) == layer(pages[1])]


def test_page_hash_index_finds_what_a_scan_of_every_page_finds():
    """This run's index, from memory and from its spilled part alike, returns what a scan of
    every page finds: pages of the same layer key, and pages without one within the pHash
    distance (any page, for a query without a layer), nearest thumbnail first, at most
    `keep`. Spilled pages are looked up through bounded per-key queries."""
    import random

    from vlbatch.pipeline.dedupe import hamming
    from vlbatch.pipeline.hashindex import PageHashIndex

    rng = random.Random(7)
    memory, spilled, pages = PageHashIndex(), PageHashIndex(hot_pages=50), []
    layers = [None, None] + [f"{k:032x}" for k in range(1, 9)]  # each under MAX_SAME_LAYER
    for i in range(400):
        if pages and rng.random() < 0.5:  # a near copy of an earlier page: a few bits flipped
            value = int(rng.choice(pages)[1], 16)
            for _ in range(rng.randint(0, 12)):
                value ^= 1 << rng.randrange(256)
        else:
            value = rng.getrandbits(256)
        content, phash, layer = f"{rng.getrandbits(256):064x}", f"{value:064x}", rng.choice(layers)
        thumb = bytes([rng.randrange(256)]) * 4096  # flat: the distance is one number
        if i % 13 == 0:
            expected = sorted(
                (abs(t[0] - thumb[0]), c) for c, p, lay, t in pages
                if (layer is not None and lay == layer)
                or (lay is None or layer is None) and hamming(phash, p) <= 12 and
                (layer is None or lay is None))
            for index in (memory, spilled):
                found = index.near(phash, 12, layer, thumb, keep=5)
                assert [c.thumb_peak for c in found] == [d for d, _ in expected[:5]]
                assert {(c.thumb_peak, c.content_hash) for c in found} <= set(expected)
        for index in (memory, spilled):
            index.add(content, phash, layer, thumb)
        pages.append((content, phash, layer, thumb))
    for index in (memory, spilled):
        assert len(index) == len(pages)
        assert all(c in index for c, *_ in pages[::50]) and f"{1:064x}" not in index
    assert memory.nbytes() < 4500 * 1024  # arrays for 1,024 pages: a thumbnail and 400 bytes each
    assert spilled.nbytes() < 4500 * 1024  # memory for the hot pages only
    folder = spilled.spilled.folder.name
    spilled.close()
    assert not Path(folder).exists()


def test_one_template_pages_never_merge_at_any_budget(write_job, tmp_path):
    """Through real runs at the smallest budget: statements of one template with every
    number different (as PDFs and as raster files, where no text layer tells them apart),
    pages whose one dot is red in one file and green of the same grey in the other (PDFs,
    and image files), and the two pages of a solid red / solid green TIFF are all generated; the statement
    scaled onto a larger page box and its 100-dpi PNG raster merge with it."""
    import pymupdf

    import dedupe_set

    docs = tmp_path / "docs"
    docs.mkdir()
    for seed in (1, 2):
        dedupe_set.statement(seed).save(docs / f"statement-{seed}.pdf")
        with pymupdf.open(docs / f"statement-{seed}.pdf") as doc:
            doc[0].get_pixmap(dpi=150 if seed == 1 else 200).save(docs / f"statement-{seed}.png")
    dedupe_set.on_larger_box(dedupe_set.statement(1)).save(docs / "statement-1-larger.pdf")
    with pymupdf.open(docs / "statement-1.pdf") as doc:
        doc[0].get_pixmap(dpi=100).save(docs / "statement-1-raster.png")
    for name, colour in (("red", (255, 0, 0)), ("green", (0, 128, 0))):  # the same grey
        with dedupe_set.status_table(tuple(c / 255 for c in colour)) as doc:
            doc.save(docs / f"status-{name}.pdf")
        image = Image.new("RGB", (850, 1100), "white")
        ImageDraw.Draw(image).ellipse((400, 300, 440, 340), fill=colour)
        image.save(docs / f"dot-{name}.png")
    dedupe_set.solid_tiff(docs)
    fields = one_task(job_fields("fake-model", ["docs/*"]))
    fields["render"]["max_pixels"] = fields["render"]["min_pixels"] = 64 * 32 * 32
    stats, engine = run(write_job(fields))
    df = pl.read_delta(str(tmp_path / "out" / "results"))
    page = [f"{Path(m).name}#{p}" for m, p in zip(df["matched_path"], df["page"])]
    reused = {k: Path(v.split("#")[0]).name + "#" + v.split("#")[1]
              for k, v in zip(page, df["reused_from"]) if v is not None}

    def document(name):  # what each file is a form of
        return name.split("#")[0].split(".")[0].replace("-larger", "").replace("-raster", "") \
            + ("#" + name.split("#")[1] if name.startswith("red-green") else "")

    assert all(document(copy) == document(origin) for copy, origin in reused.items()), reused
    assert len(df) == 12 and len(reused) == 4  # statement 1: four forms; statement 2: two
    assert len(engine.requests) == 8 and stats.near_copies + stats.exact_copies == 4
    assert len({document(p) for p in page}) == 8


def test_pixel_checks_a_page_costs_are_bounded(tmp_path):
    """A page costs at most MAX_PIXEL_CHECKS pixel checks, however many pages of its
    template came before: PDF pages with other text are never candidates (no check at all),
    image files of one template are ranked by thumbnail and checked a few at most."""
    import pymupdf

    import dedupe_set
    from vlbatch.pipeline.dedupe import MAX_PIXEL_CHECKS

    settings = Render(dpi=150, max_pixels=64 * 32 * 32, min_pixels=64 * 32 * 32)
    deduper = Deduper(Dedupe(), keep_in_memory=64)
    for seed in range(30):
        path = tmp_path / f"s{seed}.pdf"
        dedupe_set.statement(seed).save(path)
        deduper.match(ingest.render(str(path), "pdf", 1, settings))
    assert deduper.pixel_checks == 0
    for seed in range(30):
        with pymupdf.open(tmp_path / f"s{seed}.pdf") as doc:
            doc[0].get_pixmap(dpi=100).save(tmp_path / f"s{seed}.png")
        before = deduper.pixel_checks
        canonical, relation = deduper.match(
            ingest.render(str(tmp_path / f"s{seed}.png"), "image", 1, settings))
        assert deduper.pixel_checks - before <= MAX_PIXEL_CHECKS
        assert relation == "near"  # its own PDF is found among the 30


def test_a_run_never_merges_with_a_page_whose_safeguards_are_gone(write_job, tmp_path):
    """Through real runs sharing a cache: a raster copy of last night's page is served its
    answer while the page's safeguards are in the feature cache; once they are gone
    (evicted), the copy is generated, not merged."""
    docs = tmp_path / "docs"
    docs.mkdir()
    a = write_invoice(docs / "a.pdf")
    fields = one_task(job_fields("fake-model", ["docs/a.pdf"]))
    run(write_job(fields))
    export(a, docs / "a-q80.jpg", quality=80)
    fields.update(inputs=["docs/a-q80.jpg"], output="out-kept")
    stats, engine = run(write_job(fields))
    assert len(engine.requests) == 0 and stats.near_copies == 1 and stats.cache_hits == 1
    with diskcache.Cache(str(tmp_path / "cache" / "default" / "features")) as cache:
        looks = [k for k in cache.iterkeys() if str(k).startswith("look:")]
        assert len(looks) == 1  # the PDF's page (the copy merged, so it was not indexed)
        del cache[looks[0]]
    fields.update(output="out-gone")
    stats, engine = run(write_job(fields))
    assert len(engine.requests) == 1 and stats.near_copies == 0
    df = pl.read_delta(str(tmp_path / "out-gone" / "results"))
    assert df["reused_from"].to_list() == [None] and df["cached"].to_list() == [False]


def test_comparison_images_are_made_on_demand_and_only_from_the_unchanged_file(write_job, tmp_path):
    """At a budget below the comparison budget the render workers leave the comparison
    image: a run of PDFs alone makes none. A raster copy in a later run has one made for it
    and for last night's page (from its file, in a render worker), kept in the feature cache,
    and merges. Once last night's file is changed in place or gone, its comparison image
    cannot be made from it: the copy is generated, not merged."""
    docs = tmp_path / "docs"
    docs.mkdir()
    a = write_invoice(docs / "a.pdf")
    write_invoice(docs / "b.pdf", ("INV-2026-00418",) + FIELDS[1:])
    fields = one_task(job_fields("fake-model", ["docs/*.pdf"]))
    fields["render"]["max_pixels"] = 256 * 32 * 32
    run(write_job(fields))
    features = tmp_path / "cache" / "default" / "features"

    def compare_entries():
        with diskcache.Cache(str(features)) as cache:
            return [k for k in cache.iterkeys() if str(k).startswith("compare:")]

    assert compare_entries() == []  # two statements with other text: no pixel check at all
    with pymupdf_open(a) as doc:
        doc[0].get_pixmap(dpi=100).save(docs / "a-raster.png")
    fields.update(inputs=["docs/a-raster.png"], output="out-copy")
    stats, engine = run(write_job(fields))
    assert len(engine.requests) == 0 and stats.near_copies == 1
    assert len(compare_entries()) == 2  # last night's page and the copy

    for key in compare_entries():  # made again on demand below, or not at all
        with diskcache.Cache(str(features)) as cache:
            del cache[key]
    original = a.read_bytes()
    write_invoice(a, FIELDS[:3] + ("1,204.58 EUR",))  # changed in place: one digit
    with pymupdf_open(a) as doc:  # and a raster of the new one
        doc[0].get_pixmap(dpi=100).save(docs / "a-changed-raster.png")
    # last night's page is a candidate (the same template), and its file now draws what
    # the copy shows, but not what last night's answer is of: no merge
    fields.update(inputs=["docs/a-changed-raster.png"], output="out-changed")
    stats, engine = run(write_job(fields))
    assert len(engine.requests) == 1 and stats.near_copies == 0
    a.write_bytes(original)
    a.rename(docs / "a-moved.pdf")  # gone from where last night's page was read
    fields.update(output="out-gone", inputs=["docs/a-raster.png"])
    stats, engine = run(write_job(fields))
    assert len(engine.requests) == 1 and stats.near_copies == 0


def pymupdf_open(path):
    import pymupdf

    return pymupdf.open(path)


def test_a_comparison_that_runs_past_the_page_limit_is_no_merge(tmp_path):
    """The on-demand comparison runs in a render worker, under the page time limit: past
    it, there is no image (and so no merge), and the pool goes on."""
    from vlbatch.pipeline.comparison import Comparisons
    from vlbatch.pipeline.workers import WorkerPool

    a = write_invoice(tmp_path / "a.pdf")
    small = Render(dpi=150, max_pixels=64 * 32 * 32, min_pixels=64 * 32 * 32)
    page = ingest.render(str(a), "pdf", 1, small, defer_comparison=True)
    assert page.comparison_deferred and page.compare_png is None
    with WorkerPool(1, timeout_s=60) as pool:
        made = Comparisons(small, pool=pool)(page.compare_source, page.content_hash)
        assert made is not None and made.size == ingest.render(str(a), "pdf", 1, small).comparison().size
    with WorkerPool(1, timeout_s=0.001) as pool:
        comparisons = Comparisons(small, pool=pool)
        assert comparisons(page.compare_source, page.content_hash) is None
        assert comparisons.failed == 1


@pytest.mark.parametrize("hot_pages", [4096, 64])
def test_candidates_tied_on_the_peak_are_ranked_by_the_mean_in_memory_and_spilled(hot_pages):
    """On an archive of one template thousands of pages tie on the largest thumbnail cell
    difference (rendering noise); the copy's original, nearest on the mean, is kept among
    the few candidates however many pages tie before it."""
    import hashlib

    import numpy as np

    from vlbatch.pipeline.hashindex import PageHashIndex

    rng = np.random.RandomState(3)
    query = rng.randint(40, 200, 4096).astype(np.int16)
    index = PageHashIndex(hot_pages=hot_pages)
    phash = "ab" * 32
    for i in range(300):  # peak 14 in one cell, and a mean of about 3 elsewhere
        other = query + rng.choice([-3, 3], 4096)
        other[i % 4096] = query[i % 4096] + 14
        index.add(hashlib.sha256(b"%d" % i).hexdigest(), phash, None,
                  other.astype(np.uint8).tobytes())
    original = query.copy()
    original[7] += 14  # the same peak, nearly no difference elsewhere
    index.add(hashlib.sha256(b"original").hexdigest(), phash, None,
              original.astype(np.uint8).tobytes())
    for i in range(300, 400):  # and more tied pages after it
        other = query + rng.choice([-3, 3], 4096)
        other[0] = query[0] + 14
        index.add(hashlib.sha256(b"%d" % i).hexdigest(), phash, None,
                  other.astype(np.uint8).tobytes())
    found = index.near(phash, 4, None, query.astype(np.uint8).tobytes(), keep=4)
    assert found[0].content_hash == hashlib.sha256(b"original").hexdigest()
    assert [c.thumb_peak for c in found] == [14] * 4
