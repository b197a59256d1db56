"""survey: the job's globs -> every input file with its hash and probe, at the cost of what is
new: files are stat'ed, and only those the source index (output/source_index.py) does not
know under the same stat signature are hashed, and only those with new bytes (or probed
under other settings) are probed.

A file's signature is (size, mtime_ns, ctime_ns, inode, device). A file rewritten in place
with its mtime put back still gets a new ctime (the kernel sets it; no user can), so it is
hashed again; `--verify` (and the job's `verify_every_nights`) re-hash files whatever their
signature, for filesystems whose times cannot be trusted. A file modified within
RACY_NS of when it was hashed may have changed again within the same timestamp tick: its
signature is not trusted, and the next night hashes it again.

Everything is columnar (polars): a night over 100,000 unchanged files builds no Python
object per file beyond its path and stat.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import polars as pl

from vlbatch.errors import JobCannotRunError
from vlbatch.job import Job
from vlbatch.output.source_index import INDEX_SCHEMA, index_polars_schema, read_index_frame
from vlbatch.pipeline import ingest
from vlbatch.pipeline.discover import Source, file_sha256, iter_matches
from vlbatch.pipeline.failures import error_kind

log = logging.getLogger("vlbatch")
RACY_NS = 2_000_000_000  # coarse filesystem timestamps (FAT: 2 s)
SIGNATURE = ("size", "mtime_ns", "ctime_ns", "inode", "device")
LISTED = 1000  # paths of each kind of change the manifest names (the counts are whole)


@dataclass
class Changes:
    """What this night found changed since the index was written."""

    matched: int = 0
    new: list[str] = field(default_factory=list)  # paths the index did not hold
    changed: list[str] = field(default_factory=list)  # new bytes under a known path
    vanished: list[str] = field(default_factory=list)  # indexed paths no glob matches now
    unreadable: list[str] = field(default_factory=list)
    hashed: int = 0  # files whose bytes were read this night
    touched: int = 0  # hashed again (new signature or verified), same bytes
    verified: int = 0  # hashed again only to verify (--verify, verify_every_nights)
    probed: int = 0

    def as_dict(self) -> dict:
        counts = {"matched": self.matched, "new": len(self.new), "changed": len(self.changed),
                  "vanished": len(self.vanished), "unreadable": len(self.unreadable),
                  "hashed": self.hashed, "touched": self.touched, "verified": self.verified,
                  "probed": self.probed}
        listed = {k: sorted(getattr(self, k))[:LISTED]
                  for k in ("new", "changed", "vanished", "unreadable")}
        return {"counts": counts, **listed,
                "listed_at_most": LISTED}


@dataclass
class Survey:
    files: pl.DataFrame  # one row per input, in input order (FILE_COLUMNS)
    changes: Changes
    index: pl.DataFrame  # the index as this night leaves it
    index_changed: bool

    def source(self, row: dict) -> Source:
        return Source(row["shown"], row["path"], row["size"], row["sha256"], row["read_error"])


def probe_settings(job: Job) -> str:
    """What a probe's answer depends on besides the file's bytes."""
    r = job.render
    return f"dpi={r.dpi};password={'set' if r.pdf_password else 'none'};" \
           f"max_mp={r.max_image_megapixels};v=1"


STAT_CHUNK = 20_000  # files held as Python values before they become columns


def stat_inputs(patterns: list[str], base_dir) -> pl.DataFrame:
    """Every file the globs match (discover.match_inputs: sorted by the path as matched,
    once each by absolute path) with its stat signature, built in columns a chunk at a
    time: 100,000 paths never sit in Python lists. A file whose name is not valid UTF-8
    (the tables' paths are text) is an input that cannot be read, shown escaped."""
    schema = {"shown": pl.String, "path": pl.String, **{k: pl.Int64 for k in SIGNATURE},
              "read_error": pl.String}
    chunks, columns = [], {k: [] for k in schema}

    def flush() -> None:
        chunks.append(pl.DataFrame(columns, schema=schema))
        for values in columns.values():
            values.clear()

    for shown, path, st, error in iter_matches(patterns, base_dir):
        values = (shown, path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev,
                  error)
        if not (path.isascii() and shown.isascii()) and not _is_text(path + shown):
            values = (_escaped(shown), _escaped(path), 0, 0, 0, 0, 0,
                      "cannot read file: its name is not valid UTF-8 (shown with \\x escapes); "
                      "rename it")
        for name, value in zip(schema, values):
            columns[name].append(value)
        if len(columns["path"]) >= STAT_CHUNK:
            flush()
    flush()
    return (pl.concat(chunks).unique("path", keep="first", maintain_order=True)
            .sort("shown", maintain_order=True).with_row_index("file_order"))


def _is_text(name: str) -> bool:
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:  # os.fsdecode's surrogate escapes of undecodable bytes
        return False


def _escaped(name: str) -> str:
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _to_verify(joined: pl.DataFrame, verify: bool, verify_every: int | None) -> pl.Series:
    """Which trusted rows are hashed again anyway: all (verify), or the share of those
    hashed longest ago that makes every file hashed at least every `verify_every` nights."""
    trusted = joined["trusted"]
    if verify:
        return trusted
    if not verify_every:
        return pl.Series([False] * joined.height)
    n = math.ceil(int(trusted.sum()) / verify_every)
    ranks = joined.select(pl.when(pl.col("trusted")).then(pl.col("hashed_at_ns_was"))
                          .rank("ordinal")).to_series()
    return trusted & (ranks <= n).fill_null(False)


def survey(job: Job, output_root, probe: Callable[[list[Source]], list[ingest.Probe]],
           verify: bool = False) -> Survey:
    """Every input file with its hash and probe; `probe` probes the sources given (in the
    render pool: scope.probe_all)."""
    files = stat_inputs(job.inputs, job.base_dir)
    if files.is_empty():
        raise JobCannotRunError(f"no inputs matched {job.inputs} (relative to {job.base_dir})")
    index = read_index_frame(output_root)
    was = index.rename({c: f"{c}_was" for c in index.columns if c != "path"})
    joined = files.join(was, on="path", how="left", maintain_order="left")
    same = pl.all_horizontal([pl.col(c) == pl.col(f"{c}_was") for c in SIGNATURE])
    joined = joined.with_columns(trusted=(
        pl.col("read_error").is_null() & pl.col("sha256_was").is_not_null() & same
        & (pl.col("mtime_ns") + RACY_NS <= pl.col("hashed_at_ns_was"))).fill_null(False))
    verifying = _to_verify(joined, verify, job.verify_every_nights)
    joined = joined.with_columns(verifying=verifying)
    changes = Changes(matched=joined.height)

    # hash what is not trusted (and what is verified)
    to_hash = joined.filter(pl.col("read_error").is_null()
                            & (~pl.col("trusted") | pl.col("verifying")))
    hashes, hashed_at, errors = {}, {}, {}
    for path in to_hash["path"]:
        hashed_at[path] = time.time_ns()
        try:
            hashes[path] = file_sha256(path)
        except OSError as e:
            errors[path] = f"cannot read file: {e.strerror or e}"
    changes.hashed = len(hashes)
    hashed = pl.DataFrame({"path": list(hashed_at), "sha_new": [hashes.get(p) for p in hashed_at],
                           "hashed_at_new": list(hashed_at.values()),
                           "error_new": [errors.get(p) for p in hashed_at]},
                          schema={"path": pl.String, "sha_new": pl.String,
                                  "hashed_at_new": pl.Int64, "error_new": pl.String})
    joined = joined.join(hashed, on="path", how="left", maintain_order="left").with_columns(
        sha256=pl.when(pl.col("hashed_at_new").is_not_null()).then(pl.col("sha_new"))
        .otherwise(pl.col("sha256_was")),
        hashed_at_ns=pl.coalesce("hashed_at_new", "hashed_at_ns_was"),
        read_error=pl.coalesce("read_error", "error_new"))
    settings = probe_settings(job)
    joined = joined.with_columns(needs_probe=pl.col("read_error").is_null() & (
        (pl.col("sha256") != pl.col("sha256_was")) | pl.col("sha256_was").is_null()
        | (pl.col("probe_settings_was") != settings) | pl.col("probe_settings_was").is_null()
    ).fill_null(True))
    _count_changes(joined, index, changes)

    # probe what has new bytes (or settings)
    need = joined.filter(pl.col("needs_probe"))
    probes = probe([Source(r["shown"], r["path"], r["size"], r["sha256"])
                    for r in need.select("shown", "path", "size", "sha256").iter_rows(named=True)])
    changes.probed = len(probes)
    probed = _probe_frame(need["path"].to_list(), probes, settings)
    joined = joined.join(probed, on="path", how="left", maintain_order="left").with_columns(
        kind=pl.when(pl.col("needs_probe")).then(pl.col("kind_new")).otherwise(pl.col("kind_was")),
        probe_error=pl.when(pl.col("needs_probe")).then(pl.col("probe_error_new"))
        .otherwise(pl.col("probe_error_was")),
        pages=pl.when(pl.col("needs_probe")).then(pl.col("pages_new"))
        .otherwise(pl.col("pages_was")),
        probe_settings=pl.when(pl.col("needs_probe")).then(pl.col("probe_settings_new"))
        .otherwise(pl.col("probe_settings_was")))
    files = joined.select("file_order", "shown", "path", "size", "sha256", "read_error", "kind",
                          "probe_error", "pages")
    kept = joined.filter(pl.col("read_error").is_null())
    new_index = kept.select(INDEX_SCHEMA.names)
    index_changed = bool(changes.hashed or changes.probed or changes.vanished
                         or kept.height != index.height)
    return Survey(files, changes, new_index, index_changed)


def _count_changes(joined: pl.DataFrame, index: pl.DataFrame, changes: Changes) -> None:
    readable = pl.col("read_error").is_null()
    known = pl.col("sha256_was").is_not_null()
    hashed = pl.col("hashed_at_new").is_not_null()
    changes.new = joined.filter(~known & readable)["path"].to_list()
    changes.changed = joined.filter(known & readable & hashed
                                    & (pl.col("sha256") != pl.col("sha256_was")))["path"].to_list()
    changes.unreadable = joined.filter(~readable)["path"].to_list()
    changes.touched = joined.filter(known & readable & hashed
                                    & (pl.col("sha256") == pl.col("sha256_was"))).height
    changes.verified = int(joined["verifying"].sum())
    changes.vanished = index.join(joined.select("path"), on="path", how="anti")["path"].to_list()


def _probe_frame(paths: list[str], probes: list[ingest.Probe], settings: str) -> pl.DataFrame:
    """The new probes as columns. A probe stopped for a passing reason (its time limit, a
    worker that died) is used this night and not kept: the next night probes again."""
    rows = {"path": paths, "kind_new": [], "probe_error_new": [], "pages_new": [],
            "probe_settings_new": []}
    for p in probes:
        rows["kind_new"].append(p.kind)
        rows["probe_error_new"].append(p.error)
        rows["pages_new"].append([{"page": s.page, "width": s.width, "height": s.height,
                                   "error": s.error} for s in p.pages])
        passing = error_kind(p.error) == "transient" or any(
            error_kind(s.error) == "transient" for s in p.pages)
        rows["probe_settings_new"].append(None if passing else settings)
    page = index_polars_schema()["pages"]
    return pl.DataFrame(rows, schema={"path": pl.String, "kind_new": pl.String,
                                      "probe_error_new": pl.String, "pages_new": page,
                                      "probe_settings_new": pl.String})


def files_of(sources: list[Source], probes: list[ingest.Probe]) -> pl.DataFrame:
    """The survey's files frame for sources already hashed and probed (tests, scripts)."""
    frame = pl.DataFrame({"shown": [s.path for s in sources], "path": [s.abs_path for s in sources],
                          "size": [s.size for s in sources], "sha256": [s.sha256 for s in sources],
                          "read_error": [s.read_error for s in sources]},
                         schema={"shown": pl.String, "path": pl.String, "size": pl.Int64,
                                 "sha256": pl.String, "read_error": pl.String})
    probed = _probe_frame([s.abs_path for s in sources], probes, "")
    return frame.with_row_index("file_order").with_columns(
        kind=probed["kind_new"], probe_error=probed["probe_error_new"], pages=probed["pages_new"])
