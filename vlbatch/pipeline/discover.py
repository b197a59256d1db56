"""discover: the job's globs -> sources (path as matched, absolute path, size, sha256)."""

from __future__ import annotations

import errno
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


def iter_matches(patterns: list[str], base_dir: Path
                 ) -> Iterator[tuple[str, str, os.stat_result, str | None]]:
    """(path as matched, absolute path normalised, its stat, why it cannot be read or None)
    for each file each glob matches, in glob order, one stat a file; a path two globs match
    comes twice (the callers keep the first). Folders are not inputs. A link to nothing (a
    share not mounted) or a loop of links, and what is not a regular file (a FIFO, a socket,
    a device: opening one can block for ever), are inputs that cannot be read: never opened,
    with the reason (and the link's own stat)."""
    for pattern in patterns:
        absolute_pattern = os.path.isabs(pattern)
        matches = glob.iglob(pattern, recursive=True) if absolute_pattern else \
            glob.iglob(pattern, root_dir=base_dir, recursive=True)
        for shown in matches:
            absolute = shown if absolute_pattern else os.path.join(base_dir, shown)
            normal = os.path.normpath(os.path.abspath(absolute))
            try:
                st = os.stat(absolute)
            except OSError as e:
                try:
                    link = os.lstat(absolute)
                except OSError:  # gone since the folder was listed
                    continue
                if stat.S_ISLNK(link.st_mode):
                    yield shown, normal, link, _broken_link(absolute, e)
                continue
            if stat.S_ISREG(st.st_mode):
                yield shown, normal, st, None
            elif not stat.S_ISDIR(st.st_mode):
                yield shown, normal, st, f"cannot read file: not a regular file ({_kind(st)})"


def _broken_link(path: str, error: OSError) -> str:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    if error.errno == errno.ELOOP:
        return f"cannot read file: a loop of links ({target})"
    if error.errno == errno.ENOENT:
        return f"cannot read file: a link to {target}, which does not exist"
    return f"cannot read file: a link to {target}, which cannot be followed ({error.strerror})"


def _kind(st: os.stat_result) -> str:
    mode = st.st_mode
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")


def match_inputs(patterns: list[str], base_dir: Path) -> list[tuple[str, str]]:
    """(path as matched, absolute path) for every file the globs match, sorted, once each.

    Once each by absolute path, symlinks not resolved: a link and the file it points to
    are two inputs with rows of their own (their pages are exact copies, so the second is
    copied from the first, not generated again); two globs matching one path give it once.
    (survey.stat_inputs is the same in columns, with the stat.)"""
    return [(shown, absolute) for shown, absolute, _ in _matched(patterns, base_dir)]


def _matched(patterns: list[str], base_dir: Path) -> list[tuple[str, str, str | None]]:
    found: dict[str, tuple[str, str | None]] = {}
    for shown, absolute, _, error in iter_matches(patterns, base_dir):
        found.setdefault(absolute, (shown, error))
    return sorted(((shown, real, error) for real, (shown, error) in found.items()),
                  key=lambda p: p[0])


def discover(patterns: list[str], base_dir: Path) -> list[Source]:
    sources = []
    for shown, absolute, error in _matched(patterns, base_dir):
        if error is not None:  # never opened (iter_matches)
            sources.append(Source(shown, absolute, 0, None, error))
            continue
        try:
            sources.append(Source(shown, absolute, os.path.getsize(absolute), file_sha256(absolute)))
        except OSError as e:
            sources.append(Source(shown, absolute, 0, None, f"cannot read file: {e.strerror or e}"))
    return sources
