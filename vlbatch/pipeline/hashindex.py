"""hashindex: this run's pages by content hash and perceptual-hash band. The newest
HOT_PAGES pages live in numpy arrays (about 300 bytes a page, against about 6 KB in dicts of
strings); older ones are spilled to an SQLite file in a temporary folder, so the dedupe's
memory stays flat at 100,000 pages and beyond.

A page's 256-bit pHash is cut into 16 bands of 16 bits (`dedupe.bands`); two pages within
Hamming distance 15 share at least one band, so the pages sharing a band with a new page are
its only candidates. Lookups are binary searches in sorted arrays plus a scan of a short
unsorted tail, merged into the sorted part when it fills up.
"""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import numpy as np

TAIL = 16384  # entries before they are merged into the sorted arrays
BANDS = 16
HOT_PAGES = 16384  # pages kept in memory before they are spilled to disk


class SortedMultimap:
    """uint64 key -> uint32 rows, many rows a key: sorted arrays, and a small dict of the
    latest entries (at most TAIL) merged into them when it fills up."""

    def __init__(self):
        self.keys = np.empty(0, np.uint64)
        self.rows = np.empty(0, np.uint32)
        self.tail: dict[int, list[int]] = {}
        self.tail_size = 0

    def add(self, keys, row: int) -> None:
        for key in keys:
            self.tail.setdefault(int(key), []).append(row)
        self.tail_size += len(keys)
        if self.tail_size >= TAIL:
            self._merge()

    def _merge(self) -> None:
        tail_keys = [key for key, rows in self.tail.items() for _ in rows]
        tail_rows = [row for rows in self.tail.values() for row in rows]
        new_keys, new_rows = np.array(tail_keys, np.uint64), np.array(tail_rows, np.uint32)
        by_key = np.argsort(new_keys, kind="stable")
        new_keys, new_rows = new_keys[by_key], new_rows[by_key]
        at = np.searchsorted(self.keys, new_keys, side="right")  # after equal keys: row order
        self.keys, self.rows = np.insert(self.keys, at, new_keys), np.insert(self.rows, at, new_rows)
        self.tail, self.tail_size = {}, 0

    def rows_of(self, keys) -> np.ndarray:
        """The rows under any of `keys`, each once, in the order they were added."""
        keys = np.asarray(keys, np.uint64)
        starts = np.searchsorted(self.keys, keys, side="left")
        ends = np.searchsorted(self.keys, keys, side="right")
        found = [self.rows[a:b] for a, b in zip(starts.tolist(), ends.tolist()) if b > a]
        for key in keys.tolist():
            if key in self.tail:
                found.append(np.array(self.tail[key], np.uint32))
        if not found:
            return np.empty(0, np.uint32)
        return np.unique(np.concatenate(found))

    def nbytes(self) -> int:
        return self.keys.nbytes + self.rows.nbytes + 120 * self.tail_size


class _Growing:
    """A 2-D numpy array that grows by doubling."""

    def __init__(self, width: int, dtype):
        self.data = np.empty((1024, width), dtype)
        self.size = 0

    def append(self, values: np.ndarray) -> int:
        if self.size == len(self.data):
            self.data = np.concatenate([self.data, np.empty_like(self.data)])
        self.data[self.size] = values
        self.size += 1
        return self.size - 1


def _popcount(words: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):  # numpy 2
        return np.bitwise_count(words)
    return np.unpackbits(words.view(np.uint8), axis=-1).reshape(*words.shape, 64).sum(axis=-1)


def _hex_words(text: str, words: int) -> np.ndarray:
    """A hex string as big-endian uint64 words (zero-padded on the left to `words`)."""
    return np.frombuffer(bytes.fromhex(text.rjust(16 * words, "0")), ">u8").astype(np.uint64)


def _band_keys_of(words: np.ndarray) -> np.ndarray:
    """Each pHash's (rows of 4 words) band keys: band number << 16 | the band's 16 bits."""
    shifts = np.arange(3, -1, -1, dtype=np.uint64) * np.uint64(16)
    values = (words[:, :, None] >> shifts[None, None, :]) & np.uint64(0xFFFF)  # 4 words x 4 bands
    return (np.arange(BANDS, dtype=np.uint64) << np.uint64(16)) | values.reshape(len(words), BANDS)


class _HotPages:
    """The newest pages, in memory: content hashes (exact copies) and pHashes (the
    candidates for near copies)."""

    def __init__(self):
        self.content = _Growing(32, np.uint8)  # sha256 of the pixels
        self.phashes = _Growing(4, np.uint64)  # 256 bits
        self.by_content = SortedMultimap()  # its first 8 bytes -> rows
        self.by_band = SortedMultimap()  # band number << 16 | band value -> rows

    def __len__(self) -> int:
        return self.content.size

    @staticmethod
    def _band_keys(words: np.ndarray) -> np.ndarray:
        return _band_keys_of(words[None, :])[0]

    def add(self, content_hash: str, phash: str) -> None:
        digest = bytes.fromhex(content_hash)
        words = _hex_words(phash, 4)
        row = self.content.append(np.frombuffer(digest, np.uint8))
        self.phashes.append(words)
        self.by_content.add([int.from_bytes(digest[:8], "big")], row)
        self.by_band.add(self._band_keys(words), row)

    def __contains__(self, content_hash: str) -> bool:
        digest = np.frombuffer(bytes.fromhex(content_hash), np.uint8)
        rows = self.by_content.rows_of([int.from_bytes(digest[:8].tobytes(), "big")])
        return any(np.array_equal(self.content.data[r], digest) for r in rows)

    def near(self, phash: str, max_distance: int) -> list[tuple[int, str]]:
        """(Hamming distance, content hash) of the pages sharing a band with `phash` and
        within `max_distance` of it, nearest first."""
        words = _hex_words(phash, 4)
        rows = self.by_band.rows_of(self._band_keys(words))
        if rows.size == 0:
            return []
        distances = _popcount(self.phashes.data[rows] ^ words).sum(axis=1)
        close = distances <= max_distance
        return sorted((int(d), self.content.data[r].tobytes().hex())
                      for d, r in zip(distances[close], rows[close]))

    def nbytes(self) -> int:
        return (self.content.data.nbytes + self.phashes.data.nbytes
                + self.by_content.nbytes() + self.by_band.nbytes())


class _SpilledPages:
    """Older pages in an SQLite file (its page cache is SQLite's default, about 2 MB)."""

    def __init__(self, folder: str | None = None):
        self.folder = tempfile.TemporaryDirectory(prefix="vlbatch-pages-", dir=folder)
        self.db = sqlite3.connect(Path(self.folder.name) / "pages.sqlite", check_same_thread=False)
        self.db.executescript(
            "PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;"
            "CREATE TABLE pages (id INTEGER PRIMARY KEY, content BLOB UNIQUE, phash BLOB);"
            "CREATE TABLE bands (key INTEGER, id INTEGER);"
            "CREATE INDEX bands_key ON bands (key);")
        self.size = 0

    def add(self, hot: _HotPages) -> None:
        """The hot pages, row by row (no list of them all in memory)."""
        n, first = len(hot), self.size
        keys = _band_keys_of(hot.phashes.data[:n]).astype(np.int64)  # n x BANDS
        with self.db:
            self.db.executemany("INSERT INTO pages VALUES (?, ?, ?)", (
                (first + r, hot.content.data[r].tobytes(), hot.phashes.data[r].astype(">u8").tobytes())
                for r in range(n)))
            self.db.executemany("INSERT INTO bands VALUES (?, ?)", (
                (int(key), first + r) for r in range(n) for key in keys[r].tolist()))
        self.size += n

    def __contains__(self, digest: bytes) -> bool:
        return self.db.execute("SELECT 1 FROM pages WHERE content = ?", (digest,)).fetchone() is not None

    def near(self, words: np.ndarray, max_distance: int) -> list[tuple[int, str]]:
        keys = [int(k) for k in _HotPages._band_keys(words).astype(np.int64)]
        found = self.db.execute(
            "SELECT content, phash FROM pages WHERE id IN (SELECT id FROM bands WHERE key IN "
            f"({','.join('?' * len(keys))}))", keys).fetchall()
        if not found:
            return []
        others = np.frombuffer(b"".join(p for _, p in found), ">u8").astype(np.uint64).reshape(-1, 4)
        distances = _popcount(others ^ words).sum(axis=1)
        return [(int(d), c.hex()) for d, (c, _) in zip(distances, found) if d <= max_distance]

    def close(self) -> None:
        self.db.close()
        self.folder.cleanup()


class PageHashIndex:
    """This run's canonical pages: the newest `hot_pages` in memory, older ones spilled to
    an SQLite file in a temporary folder (`spill_folder`, else the system's), removed at
    `close` or when the index is collected."""

    def __init__(self, hot_pages: int = HOT_PAGES, spill_folder: str | None = None):
        self.hot_pages, self.spill_folder = hot_pages, spill_folder
        self.hot = _HotPages()
        self.spilled: _SpilledPages | None = None

    def __len__(self) -> int:
        return len(self.hot) + (self.spilled.size if self.spilled else 0)

    def add(self, content_hash: str, phash: str) -> None:
        self.hot.add(content_hash, phash)
        if len(self.hot) >= self.hot_pages:
            if self.spilled is None:
                self.spilled = _SpilledPages(self.spill_folder)
            self.spilled.add(self.hot)
            self.hot = _HotPages()

    def __contains__(self, content_hash: str) -> bool:
        if content_hash in self.hot:
            return True
        return self.spilled is not None and bytes.fromhex(content_hash) in self.spilled

    def near(self, phash: str, max_distance: int) -> list[tuple[int, str]]:
        """(Hamming distance, content hash) of the pages sharing a band with `phash` and
        within `max_distance` of it, nearest first."""
        found = self.hot.near(phash, max_distance)
        if self.spilled is not None:
            found = sorted(found + self.spilled.near(_hex_words(phash, 4), max_distance))
        return found

    def nbytes(self) -> int:
        """Bytes in memory (the spilled pages are on disk)."""
        return self.hot.nbytes()

    def close(self) -> None:
        if self.spilled is not None:
            self.spilled.close()
            self.spilled = None
