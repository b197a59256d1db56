"""The report's plots: matplotlib figures drawn to SVG text (fonts as text, no external
files), embedded in the page as they are. Each function takes plain data and returns an
`<svg>` string, or None when there is nothing to plot."""

from __future__ import annotations

import io
from collections.abc import Sequence

WIDTH_IN, HEIGHT_IN = 7.5, 2.6
COLOURS = ("#3b6ea8", "#d0813b", "#4f9a5b", "#b8474b", "#7d5ea8", "#8c6d4f", "#c26fa8")


def _figure(height_in: float = HEIGHT_IN, rows: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, height_in), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(axis="y", alpha=0.3)
    return fig, axes


def _svg(fig) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "vlbatch",
                                "font.size": 9}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]  # the XML prologue does not belong inside HTML


def throughput(timeline: dict) -> str | None:
    """Pages/s (over a sliding window) and the requests waiting on the engine, over the run."""
    rows = timeline.get("rows") or []
    if len(rows) < 2:
        return None
    col = {name: i for i, name in enumerate(timeline["columns"])}
    t = [r[col["t_s"]] for r in rows]
    pages = [r[col["pages"]] for r in rows]
    waiting = [r[col["waiting_on_engine"]] for r in rows]
    window = max(5.0, (t[-1] - t[0]) / 40)  # seconds the rate is averaged over
    rate, j = [], 0
    for i in range(len(t)):
        while t[i] - t[j] > window:
            j += 1
        k = max(0, j - 1) if i == j else j
        span = t[i] - t[k]
        rate.append((pages[i] - pages[k]) / span if span > 0 else 0.0)
    fig, (top, bottom) = _figure(HEIGHT_IN * 1.6, rows=2)
    top.plot(t, rate, color=COLOURS[0], linewidth=1.4)
    top.set_ylabel("pages/s")
    top.set_title(f"pages finished per second (over {window:.0f} s)", loc="left", fontsize=9)
    bottom.fill_between(t, waiting, step="post", color=COLOURS[1], alpha=0.5, linewidth=0)
    bottom.step(t, waiting, where="post", color=COLOURS[1], linewidth=1)
    bottom.set_ylabel("requests")
    bottom.set_title("requests waiting on the engine (sent, not yet answered)", loc="left",
                     fontsize=9)
    bottom.set_xlabel("seconds since the run started")
    return _svg(fig)


def bars(values: dict[str, float], title: str, unit: str = "") -> str | None:
    """Horizontal bars, one per entry, in the order given; None when every value is 0."""
    items = [(k, v) for k, v in values.items() if v is not None]
    if not items or not any(v for _, v in items):
        return None
    fig, (ax,) = _figure(0.6 + 0.28 * len(items))
    labels = [k for k, _ in items][::-1]
    numbers = [v for _, v in items][::-1]
    ax.barh(labels, numbers, color=COLOURS[0])
    ax.grid(axis="y", alpha=0)
    ax.grid(axis="x", alpha=0.3)
    top = max(numbers)
    for y, v in enumerate(numbers):
        ax.text(v + top * 0.01, y, f"{v:,.4g}{unit}", va="center", fontsize=8)
    ax.set_xlim(0, top * 1.15)
    ax.set_title(title, loc="left", fontsize=9)
    return _svg(fig)


def token_histogram(tokens: dict[str, Sequence[int]]) -> str | None:
    """Output tokens of each generated request, one histogram per task (stacked)."""
    tokens = {task: list(v) for task, v in tokens.items() if v}
    if not tokens:
        return None
    import numpy as np

    fig, (ax,) = _figure()
    top = max(max(v) for v in tokens.values())
    edges = np.histogram_bin_edges(np.arange(top + 2), bins=min(40, top + 1))
    ax.hist(list(tokens.values()), bins=edges, stacked=True, label=list(tokens),
            color=COLOURS[:len(tokens)] if len(tokens) <= len(COLOURS) else None)
    ax.set_xlabel("output tokens of a generated request")
    ax.set_ylabel("requests")
    ax.set_title("output tokens per page and task", loc="left", fontsize=9)
    ax.legend(frameon=False, fontsize=8)
    return _svg(fig)
