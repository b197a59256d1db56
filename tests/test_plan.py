"""Planning: longest requests first, input order among equals, a page's tasks together."""

from __future__ import annotations

from vlbatch.job import Task
from vlbatch.pipeline.discover import Source
from vlbatch.pipeline.plan import PageUnit, order_for_generation, select_todo

TASKS = [Task(name="short", prompt="Hi."), Task(name="long", prompt="Please describe " * 20)]


def unit(order: int, w: int, h: int) -> PageUnit:
    return PageUnit(order, Source(f"f{order}.png", f"/f{order}.png", 1, "sha"), "image", 1, w, h,
                    tasks=list(TASKS))


def test_longest_first_ties_in_input_order_tasks_adjacent():
    units = [unit(0, 300, 300), unit(1, 1240, 1754), unit(2, 300, 300), unit(3, 900, 900)]
    ordered = order_for_generation(units, lambda text: len(text.split()), 64 * 1024, 1280 * 1024)
    assert [u.order for u in ordered] == [1, 3, 0, 2]
    assert all([t.name for t in u.tasks] == ["long", "short"] for u in ordered)
    tokens = [u.est_tokens for u in ordered]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] == (960 // 32) * (1344 // 32) + 40


def test_select_todo_drops_finished_and_limits():
    units = [unit(i, 300, 300) for i in range(5)]
    done = {(0, "short"), (0, "long"), (1, "short")}
    todo = select_todo(units, TASKS, lambda u, t: (u.order, t.name) in done, limit=3)
    assert [(u.order, [t.name for t in u.tasks]) for u in todo] == [(1, ["long"]), (2, ["short", "long"])]
