"""The report as one self-contained HTML page: inline CSS, plots as inline SVG, thumbnails
as data: URIs; no script and nothing fetched, so it opens offline and from a mail."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from html import escape

from vlbatch.run_report import plots
from vlbatch.run_report.data import RunData

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1100px;padding:16px 24px;color:#222}
h1{font-size:22px;margin:8px 0}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:6px 0}td,th{padding:3px 10px;border-bottom:1px solid #eee;
text-align:left;vertical-align:top}th{background:#f6f6f6}td.n{text-align:right;font-variant-numeric:tabular-nums}
.status{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-weight:600}
.finished{background:#3a8a4a}.failed,.error_budget_exceeded,.engine_failed{background:#b8474b}
.interrupted{background:#c98a2b}.tiles{display:flex;flex-wrap:wrap;gap:10px}
.tile{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:120px}
.tile b{display:block;font-size:19px}.plot svg{max-width:100%;height:auto}
.gallery{display:grid;grid-template-columns:1fr;gap:14px}
.page{display:flex;gap:14px;border:1px solid #ddd;border-radius:6px;padding:10px}
.page img{width:300px;height:auto;border:1px solid #ccc;flex:none}
.noimg{width:300px;flex:none;background:#f3f3f3;color:#777;padding:20px;box-sizing:border-box}
.answers{flex:1;min-width:0}.answer{margin-bottom:8px}pre{white-space:pre-wrap;word-break:break-word;
background:#fafafa;padding:6px;margin:2px 0;font-size:12px;max-height:260px;overflow:auto}
.err{color:#b8474b}.muted{color:#777}
"""


def _table(header: list[str], rows: list[list], numeric: set[int] = frozenset()) -> str:
    if not rows:
        return "<p class=muted>none</p>"
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(
        f"<td class=n>{escape(_fmt(v))}</td>" if i in numeric else f"<td>{escape(_fmt(v))}</td>"
        for i, v in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.3f}".rstrip("0").rstrip(".") if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def _plot(svg: str | None, plot_id: str, empty: str) -> str:
    if svg is None:
        return f'<p class=muted id="{plot_id}">{escape(empty)}</p>'
    return f'<div class=plot id="{plot_id}">{svg}</div>'


def _tiles(s: dict) -> str:
    gen_rate = (s.get("pages_finished", 0) / s["generation_s"]) if s.get("generation_s") else None
    tiles = [("pages processed", s.get("pages_finished")), ("rows ok", s.get("rows_ok")),
             ("rows error", s.get("rows_error")),
             ("of them transient", s.get("rows_transient")),
             ("pages/s", s.get("pages_per_s")), ("pages/s while generating", gen_rate),
             ("output tokens", s.get("output_tokens")), ("seconds", s.get("seconds"))]
    if s.get("prompt_tokens"):  # a page's later tasks reuse its image in vLLM's prefix cache
        tiles.append(("prompt tokens from prefix cache",
                      f"{100 * s.get('prompt_tokens_cached', 0) / s['prompt_tokens']:.0f}%"))
    if s.get("engine_device") == "cpu":  # vLLM's CPU build: no GPU figures to give
        tiles.append(("engine ran on", "CPU, no GPU"))
    else:
        tiles += [("GPU-hours", s.get("gpu_hours")), ("pages per GPU-hour", s.get("pages_per_gpu_hour"))]
    if s.get("cost_per_gpu_hour") is not None and s.get("engine_device") != "cpu":
        tiles += [("cost", s.get("cost")), ("cost per million pages", s.get("cost_per_million_pages"))]
    return "<div class=tiles>" + "".join(
        f"<div class=tile>{escape(name)}<b>{escape(_fmt(v))}</b></div>" for name, v in tiles) + "</div>"


def _gallery(data: RunData, schema_tasks: set[str]) -> str:
    if not data.gallery:
        return "<p class=muted>no pages</p>"
    cards = []
    for g in data.gallery:
        where = f"{g.source} — page {g.page if g.page is not None else '(file)'}"
        if g.thumbnail:
            image = f'<img src="{g.thumbnail}" alt="{escape(where)}">'
        else:
            image = f"<div class=noimg>{escape(g.thumbnail_note or g.page_error or 'no image')}</div>"
        answers = [f"<div class=muted>{escape(where)}</div>"]
        if g.page_error:
            answers.append(f"<div class=err>page: {escape(g.page_error)}</div>")
        for r in g.rows:
            label = f"<b>{escape(r['task'])}</b>"
            if r["reused_from"]:
                label += f" <span class=muted>(the answer of {escape(r['reused_from'])})</span>"
            elif r["cached"]:
                label += " <span class=muted>(from the result cache)</span>"
            if r["status"] == "error":
                label += f" <span class=err>error: {escape(r['error'] or '')}</span>"
            body = ""
            if r["status"] == "ok" and r["task"] in schema_tasks:
                body = _fields_of(r["full_text"])
            if not body and r["text"] is not None:
                body = f"<pre>{escape(r['text'])}</pre>"
            answers.append(f"<div class=answer>{label}{body}</div>")
        cards.append(f"<div class=page>{image}<div class=answers>{''.join(answers)}</div></div>")
    return f"<div class=gallery id=gallery>{''.join(cards)}</div>"


def _fields_of(text: str | None) -> str:
    try:
        values = json.loads(text or "")
    except ValueError:
        return ""
    if not isinstance(values, dict):
        return ""
    rows = [[k, json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict)) else v]
            for k, v in values.items()]
    return _table(["field", "value"], rows).replace("<table>", "<table class=fields>", 1)


def _inputs(inputs) -> list[list]:
    """What the night saw of its inputs (survey.Changes); a list in manifests of earlier
    versions."""
    if isinstance(inputs, list):
        return [["inputs matched", len(inputs)]]
    counts = (inputs or {}).get("counts", {})
    return [["inputs matched", counts.get("matched")],
            ["inputs new / changed / vanished", " / ".join(
                str(counts.get(k, 0)) for k in ("new", "changed", "vanished"))],
            ["inputs hashed / probed", f"{counts.get('hashed', 0)} / {counts.get('probed', 0)}"]]


def render_page(data: RunData) -> str:
    m, s = data.manifest, data.summary
    status = m.get("status", "unknown")
    schema_tasks = {t["name"] for t in m.get("config", {}).get("tasks", [])
                    if t.get("schema") or t.get("fields")}
    versions = m.get("versions", {})
    meta = [["job", m.get("job")], ["run", m.get("run_id")], ["status", status],
            ["reason", m.get("reason")], ["finished at", m.get("finished_at")],
            ["model", versions.get("model")], ["vLLM", versions.get("vllm")],
            ["vlbatch", versions.get("vlbatch")], *_inputs(m.get("inputs")),
            ["limit", m.get("limit")], ["retry errors", m.get("retry_errors")]]
    timings = {k.removesuffix("_s").replace("_", " "): v
               for k, v in s.get("timings", {}).items()}
    if s.get("engine_start_s") is not None:
        timings["engine start (beside probing)"] = s["engine_start_s"]
    if s.get("generation_s"):
        timings["generating (engine ready to last answer)"] = s["generation_s"]
    answers_from = {"generated": s.get("generated"), "copies (this run)": s.get("copied"),
                    "cache hits (earlier runs)": s.get("cache_hits"),
                    "kept as errors (looped, broke schema)": s.get("bad_answers"),
                    "rejected by the engine": s.get("rejected"),
                    "failed in the engine": s.get("failed")}
    pages_from = {"exact copies": s.get("exact_copies"), "near copies": s.get("near_copies"),
                  "from the feature cache": s.get("pages_from_feature_cache")}
    reasons = dict(sorted(s.get("error_reasons", {}).items(), key=lambda kv: -kv[1])[:10])
    slow = [[f["source"], f["pages"], f["render_s"], f["output_tokens"], f["rows_error"]]
            for f in m.get("slowest_files", [])]
    by_file = [[f["source"], f["pages"], f["rows_error"], f["top_reason"]]
               for f in data.errors_by_file]
    fields = []
    for task, table in data.fields_tables.items():
        fields.append(f"<h3>{escape(task)} <span class=muted>({table['total']:,} rows in this "
                      f"run; OUTPUT/fields/{escape(task)}/)</span></h3>")
        fields.append(_table(table["columns"], table["rows"]))
    title = f"vlbatch run {m.get('run_id')} — {m.get('job')}"
    parts = [
        f"<h1>{escape(title)}</h1>",
        f'<p><span class="status {escape(status)}">{escape(status)}</span> '
        f"{escape(m.get('reason') or '')}</p>",
        _tiles(s), _table(["", ""], meta).replace("<thead><tr><th></th><th></th></tr></thead>", ""),
        "<h2>Over the run</h2>",
        _plot(plots.throughput(m.get("timeline", {})), "throughput", "too short to plot"),
        "<h2>Stage timings</h2>",
        _plot(plots.bars(timings, "seconds per stage", " s"), "timings", "no timings"),
        "<h2>Where answers came from</h2>",
        _plot(plots.bars(answers_from, "rows by where their answer came from"), "answers",
              "no rows"),
        _plot(plots.bars(pages_from, "pages not generated again"), "copies",
              "no copies, near copies or feature-cache pages"),
        "<h2>Errors</h2>",
        _plot(plots.bars(reasons, "error rows by reason"), "errors", "no error rows"),
        "<h3>By file</h3>",
        _table(["file", "pages", "error rows", "most common reason"], by_file, {1, 2}),
        "<h2>Slowest files</h2><p class=muted>render seconds in worker processes</p>",
        _table(["file", "pages", "render s", "output tokens", "error rows"], slow, {1, 2, 3, 4}),
        "<h2>Output tokens per request</h2>",
        _plot(plots.token_histogram(data.output_tokens), "tokens", "nothing generated"),
    ]
    if fields:
        parts += ["<h2>Typed fields</h2>", *fields]
    parts += ["<h2>Sample pages</h2><p class=muted>up to 12 pages: pages with errors first "
              "(one per reason), the rest a stable random sample</p>",
              _gallery(data, schema_tasks),
              f"<p class=muted>written {datetime.now(timezone.utc).isoformat(timespec='seconds')}"
              f" from {escape(str(data.output))}</p>"]
    return (f'<!doctype html><html lang=en><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")
