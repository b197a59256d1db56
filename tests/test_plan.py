"""Planning: longest requests first, input order among equals, a page's tasks together."""

from __future__ import annotations

from vlbatch.job import Task
from vlbatch.pipeline.discover import Source
from vlbatch.pipeline.plan import PageUnit, order_for_generation

TASKS = [Task(name="short", prompt="Hi."), Task(name="long", prompt="Please describe " * 20)]


def unit(order: int, w: int, h: int) -> PageUnit:
    return PageUnit(order, Source(f"f{order}.png", f"/f{order}.png", 1, "sha"), "image", 1, w, h,
                    tasks=tuple(TASKS))


def test_longest_first_ties_in_input_order_tasks_adjacent():
    units = [unit(0, 300, 300), unit(1, 1240, 1754), unit(2, 300, 300), unit(3, 900, 900)]
    ordered = order_for_generation(units, lambda text: len(text.split()), 64 * 1024, 1280 * 1024)
    assert [t.name for t in units[0].tasks] == ["short", "long"] and units[0].est_tokens == 0
    assert [u.order for u in ordered] == [1, 3, 0, 2]
    assert all([t.name for t in u.tasks] == ["long", "short"] for u in ordered)
    tokens = [u.est_tokens for u in ordered]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] == (960 // 32) * (1344 // 32) + 40


def test_limit_is_counted_in_input_order_before_what_is_done(tmp_path):
    from vlbatch.job import Job
    from vlbatch.pipeline.ingest import PageSize, Probe
    from vlbatch.pipeline.scope import make_plan

    job = Job(name="t", inputs=["*"], output=tmp_path, model="m", tasks=list(TASKS))
    sources = tuple(Source(f"f{i}.png", f"/f{i}.png", 1, f"sha{i}") for i in range(4))
    probes = [Probe("image", [PageSize(1, 300, 300)]) for _ in sources]
    import polars as pl

    from vlbatch.pipeline.identity import task_hashes
    from vlbatch.pipeline.survey import files_of

    hashes = task_hashes(job)
    current = pl.DataFrame([{"source": "/f0.png", "page": 1, "task": t.name, "source_sha256": "sha0",
                             "task_hash": hashes[t.name], "status": "ok", "error_kind": None,
                             "attempt": 1, "error": None} for t in TASKS],
                           schema_overrides={"page": pl.Int32, "error_kind": pl.String,
                                             "error": pl.String})
    plan = make_plan(job, files_of(list(sources), probes), current, limit=3)
    assert plan.pages_in_scope == 3 and [u.source.path for u in plan.todo] == ["f1.png", "f2.png"]
    assert plan.pages.num_rows == 4  # every input page stays current, the limit aside


def test_file_time_budget_skips_only_what_plan_order_would_refuse():
    """A render stage that sees a file's pages out of plan order (Ray's render actors) may
    skip a page only when pages before it in the plan used the budget up; the route stage,
    in plan order, then refuses it too."""
    from vlbatch.pipeline.render import FileTimeBudget

    seen_late = FileTimeBudget(1.0)
    seen_late.charge("f", 5.0, rank=7)  # a late page, rendered first
    assert not seen_late.used_up_before("f", 2) and seen_late.used_up_before("f", 8)
    route = FileTimeBudget(1.0)
    assert route.admit("f", 5.0) and not route.admit("f", 0.0)  # rank 2, then rank 7
    assert not route.admit("f", 0.1) and route.admit("g", 0.5)
