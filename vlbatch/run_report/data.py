"""What a run report shows, read back from the output folder: the run's manifest (summary,
timings, timeline, slowest files) and its rows in the results, pages and fields tables.

Everything is bounded whatever the run's size: tables keep their top rows, histograms
count, and the gallery is a sample of pages (errors first, then a stable pseudo-random
choice), so a 100,000-page run's report is as large as a 100-page one's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from vlbatch.errors import JobCannotRunError

TOP_ROWS = 20  # rows of the errors-by-file, slowest-files and fields tables
GALLERY_PAGES = 12
GALLERY_ERROR_PAGES = 4  # of them, at most this many pages with error rows
ANSWER_CHARS = 600  # of an answer shown in the gallery


@dataclass
class GalleryPage:
    source: str
    page: int | None
    source_sha256: str | None
    page_error: str | None  # the page did not render: no thumbnail
    rows: list[dict] = field(default_factory=list)  # task, status, text, error, fields
    thumbnail: str | None = None  # a data: URI
    thumbnail_note: str | None = None  # why there is none


@dataclass
class RunData:
    manifest: dict
    output: Path
    errors_by_file: list[dict]
    output_tokens: dict[str, list[int]]  # task -> output tokens of each generated request
    fields_tables: dict[str, dict]  # task -> {"columns": [...], "rows": [[...]], "total": n}
    gallery: list[GalleryPage]

    @property
    def summary(self) -> dict:
        return self.manifest.get("summary", {})


def run_manifest(root: Path, run_id: str | None) -> dict:
    """The manifest of `run_id`, or of the newest run in the output folder."""
    runs = root / "_runs"
    if run_id is None:
        found = sorted(runs.glob("*.json")) if runs.is_dir() else []
        if not found:
            raise JobCannotRunError(f"{root} has no runs (no {runs}/*.json)")
        path = found[-1]
    else:
        path = runs / f"{run_id}.json"
        if not path.is_file():
            raise JobCannotRunError(f"{root} has no run {run_id!r} (no {path})")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise JobCannotRunError(f"cannot read the manifest {path}: {e}") from e


def _scan(folder: Path, run_id: str, columns: list[str] | None):
    """The table's current rows this run wrote (None without a table); columns None: all."""
    import polars as pl

    from vlbatch.output.table import files_of_run, is_table

    if not is_table(folder):
        return None
    files = files_of_run(folder, run_id)  # only the files this run's commits added
    if files is None:
        scan = pl.scan_delta(str(folder))
    elif files:
        scan = pl.scan_parquet([str(f) for f in files], missing_columns="insert",
                               extra_columns="ignore")
    else:
        scan = pl.scan_delta(str(folder)).head(0)
    scan = scan.filter(pl.col("run_id") == run_id)
    if columns is None:
        return scan
    have = scan.collect_schema().names()
    return scan.select([pl.col(c) if c in have else pl.lit(None).alias(c) for c in columns])


def _stable_rank(source: str, page: int | None) -> str:
    return hashlib.blake2b(f"{source}#{page}".encode(), digest_size=8).hexdigest()


def read_run(root: Path, run_id: str | None = None) -> RunData:
    import polars as pl

    root = Path(root)
    manifest = run_manifest(root, run_id)
    rid = manifest["run_id"]
    results = _scan(root / "results", rid, [
        "source", "page", "task", "status", "error", "output", "output_tokens", "cached",
        "reused_from", "source_sha256", "error_output"])
    errors_by_file, tokens, gallery = [], {}, []
    if results is not None:
        light = results.drop("output", "error_output").collect()
        errors = light.filter(pl.col("status") == "error")
        if errors.height:
            by_file = (errors.group_by("source")
                       .agg(pl.len().alias("rows_error"),
                            pl.col("error").mode().first().alias("top_reason"),
                            pl.col("page").n_unique().alias("pages"))
                       .sort(["rows_error", "source"], descending=[True, False]).head(TOP_ROWS))
            errors_by_file = by_file.to_dicts()
        generated = light.filter(~pl.col("cached") & pl.col("output_tokens").is_not_null())
        for task, frame in generated.group_by("task", maintain_order=True):
            tokens[task[0]] = frame["output_tokens"].to_list()
        gallery = _gallery(root, rid, light, results)
    return RunData(manifest, root, errors_by_file, tokens, _fields_tables(root, manifest), gallery)


def _gallery(root: Path, run_id: str, light, results) -> list[GalleryPage]:
    import polars as pl

    pages = (light.group_by("source", "page", maintain_order=True)
             .agg(pl.col("status").eq("error").any().alias("has_error"),
                  pl.col("error").drop_nulls().first().alias("reason"),
                  pl.col("source_sha256").first()))
    pages = pages.with_columns(pl.struct("source", "page").map_elements(
        lambda r: _stable_rank(r["source"], r["page"]), return_dtype=pl.String).alias("rank"))
    errors = pages.filter("has_error").sort("rank")
    one_per_reason = errors.unique("reason", keep="first", maintain_order=True)
    chosen = one_per_reason.head(GALLERY_ERROR_PAGES).to_dicts()
    chosen += pages.filter(~pl.col("has_error")).sort("rank").head(
        GALLERY_PAGES - len(chosen)).to_dicts()
    if len(chosen) < GALLERY_PAGES:  # few pages without errors: more error pages
        taken = {(r["source"], r["page"]) for r in chosen}
        chosen += [r for r in errors.to_dicts() if (r["source"], r["page"]) not in taken][
            :GALLERY_PAGES - len(chosen)]
    if not chosen:
        return []
    keys = pl.DataFrame({"source": [r["source"] for r in chosen],
                         "page": [r["page"] for r in chosen]},
                        schema={"source": pl.String, "page": pl.Int32})
    rows = results.join(keys.lazy(), on=["source", "page"], how="semi", nulls_equal=True).collect()
    page_errors = _page_errors(root, run_id, keys)
    out = []
    for r in chosen:
        mine = rows.filter((pl.col("source") == r["source"]) & (
            pl.col("page").is_null() if r["page"] is None else pl.col("page") == r["page"]))
        shown = []
        for row in mine.sort("task").iter_rows(named=True):
            text = row["output"] if row["status"] == "ok" else row["error_output"]
            shown.append({"task": row["task"], "status": row["status"], "error": row["error"],
                          "cached": row["cached"], "reused_from": row["reused_from"],
                          "text": _clip(text), "full_text": text})
        out.append(GalleryPage(r["source"], r["page"], r["source_sha256"],
                               page_errors.get((r["source"], r["page"]),
                                               "the file could not be opened"
                                               if r["page"] is None else None), shown))
    return out


def _page_errors(root: Path, run_id: str, keys) -> dict:
    import polars as pl

    pages = _scan(root / "pages", run_id, ["source", "page", "error"])
    if pages is None:
        return {}
    found = pages.join(keys.lazy(), on=["source", "page"], how="semi").filter(
        pl.col("error").is_not_null()).collect()
    return {(r["source"], r["page"]): r["error"] for r in found.iter_rows(named=True)}


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= ANSWER_CHARS:
        return text
    return text[:ANSWER_CHARS] + f" … ({len(text):,} characters in all)"


def _fields_tables(root: Path, manifest: dict) -> dict[str, dict]:
    import polars as pl

    from vlbatch.output.table import is_table

    tables = {}
    for task in manifest.get("config", {}).get("tasks", []):
        if not (task.get("schema") or task.get("fields")):
            continue
        scan = None
        folder = root / "fields" / task["name"]
        if is_table(folder):
            scan = _scan(folder, manifest["run_id"], None)
        if scan is None:
            tables[task["name"]] = {"columns": [], "rows": [], "total": 0}
            continue
        total = scan.select(pl.len()).collect().item()
        head = scan.drop("run_id", "content_hash", "task").head(TOP_ROWS).collect()
        tables[task["name"]] = {"columns": head.columns, "total": total,
                                "rows": [[_cell(v) for v in row] for row in head.iter_rows()]}
    return tables


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value, default=str, ensure_ascii=False)
    return str(value)
