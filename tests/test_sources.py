"""Nights that cost what is new (issue 33): the source index in the output folder, stat-only
nights, files changed in place or only touched, `--verify`, the manifest's changes, a
damaged index, and `vlbatch plan` leaving the index alone."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from PIL import Image

from conftest import job_fields
from fakes import FakeEngine, fake_prompts
from vlbatch.job import load_job
from vlbatch.output.source_index import index_path, read_index, write_index
from vlbatch.run import run_job

HOUR_AGO_NS = time.time_ns() - 3600 * 10**9


def image(path: Path, seed: int) -> None:
    """A PNG stored without compression: its size depends only on its dimensions."""
    pixels = np.random.RandomState(seed).randint(0, 255, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, compress_level=0)


def age(path: Path, mtime_ns: int = HOUR_AGO_NS) -> None:
    """Set back the file's mtime (as a file written an hour ago): past the racy window."""
    os.utime(path, ns=(mtime_ns, mtime_ns))


def written(out: Path, run_id: str) -> list[str]:
    """The sources whose current rows this run wrote."""
    results = pl.read_delta(str(out / "results")).filter(pl.col("run_id") == run_id)
    return sorted(results["source"].to_list())


class Night:
    def __init__(self, job: Path):
        self.job, self.engines = job, 0

    def __call__(self, **options):
        engine = FakeEngine()

        def start(job, prompts):
            self.engines += 1
            return engine

        stats = run_job(load_job(self.job), engine_factory=start, prompts_factory=fake_prompts,
                        **options)
        out = self.job.parent / "out"
        manifest = json.loads((out / "_runs" / f"{stats.run_id}.json").read_text())
        return stats, engine, manifest["inputs"]


@pytest.fixture
def archive(tmp_path, write_job):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        image(docs / f"p{i}.png", i)
        age(docs / f"p{i}.png")
    fields = job_fields("fake-model", ["docs/*.png"])
    fields["tasks"] = fields["tasks"][:1]
    return docs, Night(write_job(fields)), tmp_path / "out"


def test_a_night_with_nothing_new_hashes_and_probes_nothing_and_starts_no_engine(archive):
    docs, night, out = archive
    stats, engine, inputs = night()
    assert len(engine.requests) == 4 and inputs["counts"]["new"] == 4
    assert inputs["counts"]["hashed"] == 4 and inputs["counts"]["probed"] == 4
    index = read_index(out)
    assert index.num_rows == 4 and set(index["path"].to_pylist()) == {
        str(p) for p in docs.glob("*.png")}
    before = pl.read_delta(str(out / "results"))

    stats, engine, inputs = night()
    assert night.engines == 1  # the second night started no engine
    assert inputs["counts"] == {"matched": 4, "new": 0, "changed": 0, "vanished": 0,
                                "unreadable": 0, "hashed": 0, "touched": 0, "verified": 0,
                                "probed": 0}
    assert inputs["new"] == [] and "path" not in json.dumps(inputs)  # no list of every input
    assert stats.pages_already_done == 4 and stats.rows_ok == 0
    assert pl.read_delta(str(out / "results")).sort("source").equals(before.sort("source"))


def test_a_file_changed_in_place_is_hashed_and_generated_again_one_only_touched_is_not(archive):
    docs, night, out = archive
    night()
    target = docs / "p1.png"
    size = target.stat().st_size
    image(target, 99)  # new pixels, the same size, a new mtime
    assert target.stat().st_size == size
    age(target, HOUR_AGO_NS + 10**9)
    stats, engine, inputs = night()
    assert inputs["changed"] == [str(target)] and inputs["counts"]["hashed"] == 1
    assert len(engine.requests) == 1 and written(out, stats.run_id) == [str(target)]
    results = pl.read_delta(str(out / "results"))
    assert results.height == 4
    assert results.filter(pl.col("source") == str(target))["source_sha256"][0] == \
        read_index(out).to_pylist()[[r["path"] for r in read_index(out).to_pylist()].index(
            str(target))]["sha256"]

    touched = docs / "p2.png"
    age(touched, HOUR_AGO_NS + 2 * 10**9)  # a new mtime, the same bytes
    runs_before = night.engines
    _, engine, inputs = night()
    assert inputs["counts"]["hashed"] == 1 and inputs["counts"]["touched"] == 1
    assert inputs["changed"] == [] and night.engines == runs_before  # nothing generated


def test_a_change_with_the_mtime_put_back_is_found_and_verify_finds_what_times_hide(archive):
    docs, night, out = archive
    night()
    target = docs / "p3.png"
    mtime = target.stat().st_mtime_ns
    image(target, 77)
    age(target, mtime)  # the mtime put back: the kernel's ctime still moved
    _, engine, inputs = night()
    assert inputs["changed"] == [str(target)] and len(engine.requests) == 1

    # a filesystem whose times say nothing (ctime kept, inode reused): the index is made to
    # match the file's new stat after a second change, as such a filesystem would show it
    image(target, 78)
    age(target, mtime)
    st = target.stat()
    index = read_index(out).to_pylist()
    for row in index:
        if row["path"] == str(target):
            row.update(size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns,
                       inode=st.st_ino, device=st.st_dev)
    import pyarrow as pa

    from vlbatch.output.source_index import INDEX_SCHEMA
    write_index(out, pa.Table.from_pylist(index, schema=INDEX_SCHEMA))
    _, engine, inputs = night()
    assert inputs["counts"]["hashed"] == 0 and len(engine.requests) == 0  # times trusted
    stats, engine, inputs = night(verify=True)
    assert inputs["counts"]["verified"] == 4 and inputs["changed"] == [str(target)]
    assert len(engine.requests) == 1 and written(out, stats.run_id) == [str(target)]


def test_verify_every_nights_hashes_every_file_within_that_many_nights(tmp_path, write_job):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(5):
        image(docs / f"p{i}.png", i)
        age(docs / f"p{i}.png")
    fields = job_fields("fake-model", ["docs/*.png"], verify_every_nights=2)
    fields["tasks"] = fields["tasks"][:1]
    night = Night(write_job(fields))
    night()
    hashed_at = {r["path"]: r["hashed_at_ns"] for r in read_index(tmp_path / "out").to_pylist()}
    counts = [night()[2]["counts"] for _ in range(2)]
    assert [c["verified"] for c in counts] == [3, 3]  # ceil(5 / 2) a night
    after = {r["path"]: r["hashed_at_ns"] for r in read_index(tmp_path / "out").to_pylist()}
    assert all(after[p] > hashed_at[p] for p in hashed_at)  # each hashed again in 2 nights
    assert all(c["changed"] == 0 for c in counts) and night.engines == 1


def test_new_vanished_and_racy_files_and_a_damaged_index(archive):
    docs, night, out = archive
    night()
    (docs / "p0.png").unlink()
    image(docs / "p9.png", 9)  # written now: within the racy window of its hashing
    _, engine, inputs = night()
    assert inputs["new"] == [str(docs / "p9.png")] and inputs["vanished"] == [str(docs / "p0.png")]
    assert len(engine.requests) == 1
    results = pl.read_delta(str(out / "results"))
    assert sorted(Path(s).name for s in results["source"]) == ["p1.png", "p2.png", "p3.png", "p9.png"]
    _, _, inputs = night()  # the racy file is hashed once more, nothing else
    assert inputs["counts"]["hashed"] == 1 and inputs["counts"]["touched"] == 1

    index_path(out).write_bytes(b"not parquet")
    engines = night.engines
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("vlbatch")
    logger.addHandler(handler)
    try:
        _, _, inputs = night()
    finally:
        logger.removeHandler(handler)
    assert any("source index" in m for m in said) and inputs["counts"]["hashed"] == 4
    assert night.engines == engines  # hashed again, nothing generated
    assert read_index(out).num_rows == 4


def test_plan_costs_a_night_and_leaves_the_index_alone(archive):
    from vlbatch.dry_run import plan_job

    docs, night, out = archive
    night()
    image(docs / "p7.png", 7)
    written = index_path(out).stat().st_mtime_ns
    plan = plan_job(load_job(night.job))
    assert plan.inputs_matched == 5 and plan.pages_to_do == 1 and plan.pages_already_done == 4
    assert index_path(out).stat().st_mtime_ns == written


def test_a_file_name_that_is_not_utf8_is_an_error_row_and_the_night_goes_on(archive):
    docs, night, out = archive
    bad = os.fsdecode(bytes(docs) + b"/scan\xff.png")
    image(Path(bad), 5)
    age(Path(bad))
    stats, engine, inputs = night()
    assert len(engine.requests) == 4 and inputs["counts"]["unreadable"] == 1
    results = pl.read_delta(str(out / "results"))
    failed = results.filter(pl.col("status") == "error")
    assert failed["source"].to_list() == [str(docs) + "/scan\\xff.png"]
    assert "not valid UTF-8" in failed["error"][0]
    assert results.filter(pl.col("status") == "ok").height == 4
    _, engine, inputs = night()  # the next night: the same error row, nothing generated
    assert engine.requests == [] and inputs["counts"]["unreadable"] == 1


def test_a_link_to_nothing_and_a_fifo_are_error_rows_and_the_link_mended_is_read(archive):
    """A share not mounted leaves links to nothing; a FIFO blocks whoever opens it. Both
    are error rows with their reason, never opened, and the night goes on; the night the
    link's target is back, its pages are answered and its error row is gone."""
    docs, night, out = archive
    shared = docs.parent / "share"
    (docs / "mounted.png").symlink_to(shared / "scan.png")
    os.mkfifo(docs / "pipe.png")
    stats, engine, inputs = night()
    assert len(engine.requests) == 4 and inputs["counts"]["unreadable"] == 2
    results = pl.read_delta(str(out / "results"))
    failed = dict(results.filter(pl.col("status") == "error").select("source", "error").rows())
    assert failed == {
        str(docs / "mounted.png"): f"cannot read file: a link to {shared / 'scan.png'}, "
                                   "which does not exist",
        str(docs / "pipe.png"): "cannot read file: not a regular file (a FIFO)"}
    shared.mkdir()
    image(shared / "scan.png", 9)
    age(shared / "scan.png")
    stats, engine, inputs = night()
    assert len(engine.requests) == 1 and inputs["counts"]["unreadable"] == 1
    assert str(docs / "mounted.png") in written(out, stats.run_id)
    results = pl.read_delta(str(out / "results"))
    assert results.filter(pl.col("source") == str(docs / "mounted.png"))["status"].to_list() \
        == ["ok"]
    assert results.filter(pl.col("status") == "error")["source"].to_list() == [str(docs / "pipe.png")]


def test_the_index_schema_in_polars_types_is_the_arrow_schema():
    from vlbatch.output.source_index import INDEX_SCHEMA, index_polars_schema

    assert pl.from_arrow(INDEX_SCHEMA.empty_table()).schema == pl.Schema(index_polars_schema())


def test_matched_files_in_columns_are_the_matched_inputs(tmp_path):
    from vlbatch.pipeline.discover import match_inputs
    from vlbatch.pipeline.survey import stat_inputs

    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("z.png", "a/y.png", "a/b/x.png", "a/w.txt"):
        (tmp_path / name).write_bytes(b"x" * len(name))
    (tmp_path / "link.png").symlink_to(tmp_path / "z.png")
    (tmp_path / "dangling.png").symlink_to(tmp_path / "gone.png")
    (tmp_path / "dir.png").mkdir()
    patterns = ["**/*.png", str(tmp_path / "z.png"), "a/*"]
    frame = stat_inputs(patterns, tmp_path)
    assert list(zip(frame["shown"], frame["path"])) == match_inputs(patterns, tmp_path)
    assert frame["shown"].to_list() == ["a/b/x.png", "a/w.txt", "a/y.png", "dangling.png",
                                        "link.png", "z.png"]
    assert frame["read_error"].to_list()[3].endswith("gone.png, which does not exist")
    assert frame["read_error"].null_count() == 5
    assert frame.filter(pl.col("read_error").is_null())["size"].to_list() == [9, 7, 7, 5, 5]
