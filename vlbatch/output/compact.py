"""`vlbatch compact OUTPUT`: the small data files nightly flushes leave merged into large
ones (delta-rs optimize/compact), then the files no version within the retention window
needs deleted (vacuum), for results, pages and each fields/<task>.

Under the output's lock (no run writes meanwhile). Compaction is a commit like any other:
a reader sees the version before it or after it, the same rows either way. Vacuum keeps
every file a version of the last `retain_days` days reads (default 7), so the history of
that window stays readable (`pl.scan_delta(path, version=N)`); older versions stay listed
in `vlbatch inspect` but their files are gone. It also removes the data files of commits
that never happened (a run killed mid-flush), once older than the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vlbatch.errors import JobCannotRunError
from vlbatch.output.folder import OutputFolder
from vlbatch.output.table import commit_properties, open_table

RETAIN_DAYS = 7.0


@dataclass
class Compacted:
    table: str  # results, pages, fields/<task>
    files_before: int
    files_after: int
    rows: int
    files_vacuumed: int
    version: int  # the table's version after


def compact_output(root: Path, retain_days: float = RETAIN_DAYS) -> list[Compacted]:
    root = Path(root)
    if not (root / "results").is_dir():
        raise JobCannotRunError(f"{root} is not a vlbatch output folder (no results/)")
    output = OutputFolder(root)
    done = []
    with output.lock():
        output.check_tables()
        for path in output.tables():
            compacted = compact_table(path, output.root, retain_days)
            if compacted is not None:
                done.append(compacted)
    return done


def compact_table(path: Path, root: Path, retain_days: float) -> Compacted | None:
    table = open_table(path)
    if table is None:
        return None
    before = len(table.file_uris())
    table.optimize.compact(commit_properties=commit_properties("compact", "compact"))
    table.update_incremental()
    vacuumed = table.vacuum(retention_hours=int(retain_days * 24), dry_run=False,
                            enforce_retention_duration=False, full=True,
                            commit_properties=commit_properties("compact", "vacuum"))
    table.update_incremental()
    rows = table.to_pyarrow_dataset().count_rows()
    return Compacted(str(path.relative_to(root)), before, len(table.file_uris()), rows,
                     len(vacuumed), table.version())
