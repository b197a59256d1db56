"""discover: the job's globs -> sources (path as matched, absolute path, size, sha256)."""

from __future__ import annotations

import glob
import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    path: str  # as the job's glob matched it (relative to the job folder when the glob is)
    abs_path: str
    size: int
    sha256: str | None  # None when the file could not be read
    read_error: str | None = None


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def iter_matches(patterns: list[str], base_dir: Path) -> Iterator[tuple[str, str, os.stat_result]]:
    """(path as matched, absolute path normalised, its stat) for each regular file (or link
    to one) each glob matches, in glob order, one stat a file; a path two globs match comes
    twice (the callers keep the first)."""
    for pattern in patterns:
        absolute_pattern = os.path.isabs(pattern)
        matches = glob.iglob(pattern, recursive=True) if absolute_pattern else \
            glob.iglob(pattern, root_dir=base_dir, recursive=True)
        for shown in matches:
            absolute = shown if absolute_pattern else os.path.join(base_dir, shown)
            try:
                st = os.stat(absolute)
            except OSError:  # a dangling link, or gone since the folder was listed
                continue
            if stat.S_ISREG(st.st_mode):
                yield shown, os.path.normpath(os.path.abspath(absolute)), st


def match_inputs(patterns: list[str], base_dir: Path) -> list[tuple[str, str]]:
    """(path as matched, absolute path) for every file the globs match, sorted, once each.

    Once each by absolute path, symlinks not resolved: a link and the file it points to
    are two inputs with rows of their own (their pages are exact copies, so the second is
    copied from the first, not generated again); two globs matching one path give it once.
    (survey.stat_inputs is the same in columns, with the stat.)"""
    found: dict[str, str] = {}
    for shown, absolute, _ in iter_matches(patterns, base_dir):
        found.setdefault(absolute, shown)
    return sorted(((shown, real) for real, shown in found.items()), key=lambda p: p[0])


def discover(patterns: list[str], base_dir: Path) -> list[Source]:
    sources = []
    for shown, absolute in match_inputs(patterns, base_dir):
        try:
            sources.append(Source(shown, absolute, os.path.getsize(absolute), file_sha256(absolute)))
        except OSError as e:
            sources.append(Source(shown, absolute, 0, None, f"cannot read file: {e.strerror or e}"))
    return sources
