"""migrate: an output folder of the earlier layout (append-only `part-*.parquet` files in
results/, pages/, fields/<task>/) converted once into tables, every row kept.

Each earlier run becomes one version, oldest first (by its manifest's `finished_at`, else
its run id, which begins with its UTC start), so the table's history holds every row ever written and its newest
version the current row per key, as the earlier "newest row per key" query gave it. A
compacted part holds rows of many runs: rows are grouped by their own run_id.

Built beside the live folder (`.<name>.migrating`), then swapped in: the live folder is
renamed `.<name>.legacy`, the new table takes its name, the legacy folder is removed. A
migration killed at any step is finished or undone by the next one.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pyarrow as pa

from vlbatch.output.folder import OutputFolder, fsync_folder
from vlbatch.output.schemas import FIELDS_KEY, PAGE_KEY, PAGE_SCHEMA, RESULT_KEY, RESULT_SCHEMA
from vlbatch.output.table import commit_properties, is_table, key_predicate, last_per_key

log = logging.getLogger("vlbatch")


def needs_migration(output: OutputFolder) -> bool:
    return any(not is_table(p) and any(p.glob("part-*.parquet")) for p in output.tables()) or \
        any(output.root.glob(".*.legacy")) or any(output.fields.glob(".*.legacy"))


def migrate_output(output: OutputFolder) -> dict[str, int]:
    """Converts each table folder still made of parts (call with the lock held); {table
    folder: versions written}."""
    _finish_swaps(output)
    done = {}
    for path in output.tables():
        parts = sorted(path.glob("part-*.parquet"))
        if is_table(path) or not parts:
            continue
        key, schema = _key_and_schema(output, path)
        done[str(path)] = _migrate_table(path, parts, key, schema, _run_times(output))
        log.info("migrated %s: %d parts into a table of %d versions", path, len(parts),
                 done[str(path)])
    return done


def _run_times(output: OutputFolder) -> dict[str, str]:
    """run id -> when it finished, from the manifests that read."""
    import json

    times = {}
    for path in output.runs.glob("*.json"):
        try:
            manifest = json.loads(path.read_text())
            times[manifest["run_id"]] = str(manifest.get("finished_at") or "")
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return times


def _key_and_schema(output: OutputFolder, path: Path):
    if path == output.results:
        return RESULT_KEY, RESULT_SCHEMA
    if path == output.pages:
        return PAGE_KEY, PAGE_SCHEMA
    return FIELDS_KEY, None  # a fields table: the columns its parts have


def _read_parts(parts: list[Path], schema: pa.Schema | None):
    import polars as pl

    frames = []
    for order, path in enumerate(parts):
        frame = pl.read_parquet(path)
        frames.append(frame.with_columns(pl.lit(order).alias("_part"))
                      .with_row_index("_row"))
    merged = pl.concat(frames, how="diagonal_relaxed")
    if schema is not None:  # columns an older part lacks read as null, in today's schema
        missing = [pl.lit(None).cast(pl.from_arrow(schema.empty_table()).schema[f.name]).alias(f.name)
                   for f in schema if f.name not in merged.columns]
        merged = merged.with_columns(missing)
    return merged


def _migrate_table(path: Path, parts: list[Path], key: tuple[str, ...],
                   schema: pa.Schema | None, run_times: dict[str, str]) -> int:
    import polars as pl
    from deltalake import DeltaTable, write_deltalake

    rows = _read_parts(parts, schema)
    columns = list(schema.names) if schema is not None else \
        [c for c in rows.columns if c not in ("_part", "_row")]
    order = ["finished_at"] if "finished_at" in rows.columns else []
    staging = path.parent / f".{path.name}.migrating"
    shutil.rmtree(staging, ignore_errors=True)
    versions = 0
    runs = sorted(rows["run_id"].unique().to_list(),
                  key=lambda r: (r is not None, run_times.get(r or "", ""), r or ""))
    for run_id in runs:
        of_run = rows.filter(pl.col("run_id").eq_missing(run_id)) \
            .sort([*order, "_part", "_row"], nulls_last=False).select(columns)
        batch = last_per_key(of_run.to_arrow(), key)
        if schema is not None:
            batch = batch.cast(schema)
        props = commit_properties(run_id or "unknown", "migrate", rows=batch.num_rows)
        if versions == 0:
            write_deltalake(str(staging), batch, mode="append", commit_properties=props)
        else:
            updates = {c: f"s.{c}" for c in batch.column_names}
            (DeltaTable(str(staging)).merge(batch, key_predicate(key), source_alias="s",
                                            target_alias="t", merge_schema=True,
                                            commit_properties=props)
             .when_matched_update(updates=updates).when_not_matched_insert(updates=updates)
             .execute())
        versions += 1
    fsync_folder(staging)
    _swap(staging, path)
    return versions


def _swap(staging: Path, path: Path) -> None:
    legacy = path.parent / f".{path.name}.legacy"
    path.rename(legacy)
    staging.rename(path)
    fsync_folder(path.parent)
    shutil.rmtree(legacy)


def _finish_swaps(output: OutputFolder) -> None:
    """What a migration killed mid-swap left: a legacy folder beside its new table is
    removed; one whose table never took its name is put back (and migrated again)."""
    for legacy in [*output.root.glob(".*.legacy"), *output.fields.glob(".*.legacy")]:
        live = legacy.parent / legacy.name[1:-len(".legacy")]
        if is_table(live):
            shutil.rmtree(legacy)
        elif not live.exists() or not any(live.iterdir()):
            if live.exists():
                live.rmdir()
            legacy.rename(live)
