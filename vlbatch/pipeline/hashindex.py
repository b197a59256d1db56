"""hashindex: this run's canonical pages, for the dedupe's lookups, at a cost per lookup that
does not grow with the run.

Per page: its content hash (exact copies), its 256-bit pHash, its layer key (a PDF page's
text and drawings digest, `dedupe.layer_key`; 0 for a page without a text layer) and its
64x64 thumbnail (`imaging.thumbnail`). A lookup returns the candidates for a near copy:
- a page with a layer key: the pages with the same key (an exact match: pages with other
  text or drawings are never candidates), and pages without one (raster copies) within the
  pHash distance;
- a page without: every page within the pHash distance,
each list bounded (`MAX_SAME_LAYER`, `MAX_SCAN`), nearest thumbnail first.

The newest HOT_PAGES pages live in numpy arrays and are searched by brute force (a few
microseconds a thousand pages); older ones are spilled to files in a temporary folder
(SQLite for the content hashes, flat files read through memory maps for the rest), so
memory stays flat at 100,000 pages and beyond, and a lookup costs at most HOT_PAGES +
MAX_SCAN vector operations on pHashes, the thumbnails of the pages within the distance
among those, and one bounded query.
"""

from __future__ import annotations

import hashlib
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlbatch.pipeline import imaging

HOT_PAGES = 4096  # pages kept in memory (about 4.4 KB each) before they are spilled to disk
MAX_SAME_LAYER = 64  # spilled pages with the query's layer key looked at, newest first
MAX_SCAN = 32768  # spilled pages scanned for pHash neighbours, newest first (about 130 MB)
THUMB_BYTES = imaging.THUMB_SIDE ** 2


@dataclass(frozen=True)
class Candidate:
    content_hash: str
    thumb_distance: float  # mean absolute difference of the thumbnails (0-255)
    thumb_peak: int  # the largest cell difference (0-255)


def layer_word(layer: str | None) -> int:
    """A layer key as a non-zero int64 (0: no layer)."""
    if not layer:
        return 0
    digest = hashlib.blake2b(layer.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") & 0x7FFF_FFFF_FFFF_FFFF) or 1


def _popcount(words: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):  # numpy 2
        return np.bitwise_count(words)
    return np.unpackbits(words.view(np.uint8), axis=-1).reshape(*words.shape, 64).sum(axis=-1)


def _hex_words(text: str, words: int) -> np.ndarray:
    """A hex string as big-endian uint64 words (zero-padded on the left to `words`)."""
    return np.frombuffer(bytes.fromhex(text.rjust(16 * words, "0")), ">u8").astype(np.uint64)


def _thumb(thumb: bytes) -> np.ndarray:
    """A thumbnail as an array; one that is missing or damaged ranks as a black page (the
    pixel check still decides)."""
    found = np.frombuffer(thumb or b"", np.uint8)
    return found if found.size == THUMB_BYTES else np.full(THUMB_BYTES, 0, np.uint8)


def thumbs_of(thumbs: list[bytes]) -> np.ndarray:
    return np.array([_thumb(t) for t in thumbs], np.uint8).reshape(-1, THUMB_BYTES)


class _Growing:
    """A 2-D numpy array that grows by doubling."""

    def __init__(self, width: int, dtype):
        self.data = np.empty((1024, width), dtype)
        self.size = 0

    def append(self, values) -> int:
        if self.size == len(self.data):
            self.data = np.concatenate([self.data, np.empty_like(self.data)])
        self.data[self.size] = values
        self.size += 1
        return self.size - 1

    def view(self) -> np.ndarray:
        return self.data[:self.size]


class _HotPages:
    """The newest pages, in memory."""

    def __init__(self):
        self.content = _Growing(32, np.uint8)  # sha256 of the pixels
        self.phashes = _Growing(4, np.uint64)  # 256 bits
        self.layers = _Growing(1, np.int64)
        self.thumbs = _Growing(THUMB_BYTES, np.uint8)
        self.by_content: dict[bytes, int] = {}

    def __len__(self) -> int:
        return self.content.size

    def add(self, content_hash: str, phash: str, layer: int, thumb: bytes) -> None:
        digest = bytes.fromhex(content_hash)
        self.by_content[digest] = self.content.append(np.frombuffer(digest, np.uint8))
        self.phashes.append(_hex_words(phash, 4))
        self.layers.append(layer)
        self.thumbs.append(_thumb(thumb))

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.by_content

    def near(self, words: np.ndarray, max_distance: int, layer: int) -> np.ndarray:
        """Rows of the candidates (see the module's docstring)."""
        if not len(self):
            return np.empty(0, np.int64)
        layers = self.layers.view()[:, 0]
        close = _popcount(self.phashes.view() ^ words).sum(axis=1) <= max_distance
        if layer:
            close = (close & (layers == 0)) | (layers == layer)
        return np.flatnonzero(close)



class _Rows:
    """The content hashes of some rows, as a list that reads only the items asked for
    (`read`: row -> content hash bytes)."""

    def __init__(self, rows: np.ndarray, read):
        self.rows, self.read = rows, read

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i) -> bytes:
        return self.read(int(self.rows[i]))


class _SpilledPages:
    """Older pages on disk in a temporary folder: content hashes and layer keys in SQLite
    (its page cache is SQLite's default, about 2 MB), pHashes, layer keys and thumbnails in
    flat files read through memory maps, so a lookup scans at most MAX_SCAN of the newest
    (the operating system's page cache holds them, not the process)."""

    def __init__(self, folder: str | None = None):
        self.folder = tempfile.TemporaryDirectory(prefix="vlbatch-pages-", dir=folder)
        base = Path(self.folder.name)
        self.db = sqlite3.connect(base / "pages.sqlite", check_same_thread=False)
        self.db.executescript(
            "PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;"
            "CREATE TABLE pages (id INTEGER PRIMARY KEY, content BLOB UNIQUE, layer INTEGER);"
            "CREATE INDEX pages_layer ON pages (layer, id);")
        self.files = {name: base / f"{name}.bin" for name in ("phashes", "layers", "thumbs")}
        self.size = 0
        self.maps: dict[str, np.ndarray] = {}

    def add(self, hot: _HotPages) -> None:
        n, first = len(hot), self.size
        with self.db:
            self.db.executemany("INSERT INTO pages VALUES (?, ?, ?)", (
                (first + r, hot.content.data[r].tobytes(), int(hot.layers.data[r, 0]))
                for r in range(n)))
        for name, values in (("phashes", hot.phashes.view()), ("layers", hot.layers.view()),
                             ("thumbs", hot.thumbs.view())):
            with open(self.files[name], "ab") as f:
                f.write(np.ascontiguousarray(values).tobytes())
        self.size += n
        self.maps = {name: np.memmap(self.files[name], dtype=dtype, mode="r").reshape(self.size, -1)
                     for name, dtype in (("phashes", np.uint64), ("layers", np.int64),
                                         ("thumbs", np.uint8))}

    def __contains__(self, digest: bytes) -> bool:
        return self.db.execute("SELECT 1 FROM pages WHERE content = ?", (digest,)).fetchone() is not None

    def near(self, words: np.ndarray, max_distance: int, layer: int, thumb: bytes, keep: int
             ) -> list[Candidate]:
        """The `keep` nearest candidates (see the module's docstring), each read bounded:
        the newest MAX_SAME_LAYER pages of the query's layer key, the newest MAX_SCAN pages
        scanned for pHash neighbours."""
        ids = [i for (i,) in self.db.execute(
            "SELECT id FROM pages WHERE layer = ? ORDER BY id DESC LIMIT ?",
            (layer, MAX_SAME_LAYER))] if layer else []
        start = max(0, self.size - MAX_SCAN)
        layers = self.maps["layers"][start:, 0]
        close = _popcount(self.maps["phashes"][start:] ^ words).sum(axis=1) <= max_distance
        if layer:
            close &= layers == 0
        rows = np.union1d(np.asarray(ids, np.int64), np.flatnonzero(close) + start)
        found = rank(_Rows(rows, self.content), self.maps["thumbs"][rows], thumb, keep)
        return found

    def content(self, row: int) -> bytes:
        return self.db.execute("SELECT content FROM pages WHERE id = ?", (row,)).fetchone()[0]

    def close(self) -> None:
        self.maps = {}
        self.db.close()
        self.folder.cleanup()


def rank(content: list[bytes], thumbs: np.ndarray, thumb: bytes, keep: int) -> list[Candidate]:
    """The `keep` candidates nearest by thumbnail: smallest largest cell difference first
    (a re-render stays within a few levels in every cell, a page with another field does
    not), then smallest mean difference."""
    if not content:
        return []
    query = _thumb(thumb)
    diff = np.maximum(thumbs, query)
    diff -= np.minimum(thumbs, query)  # |a - b| in uint8
    peaks = diff.max(axis=1)
    means = diff.mean(axis=1, dtype=np.float32)
    # both keys over every candidate: on an archive of one template thousands of pages tie
    # on the peak (rendering noise), and the mean is what tells the copy's original apart
    best = np.lexsort((np.arange(len(peaks)), means, peaks))[:keep]
    return [Candidate(content[i].hex(), float(means[i]), int(peaks[i])) for i in best]


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

    def add(self, content_hash: str, phash: str, layer: str | None = None, thumb: bytes = b"") -> None:
        self.hot.add(content_hash, phash, layer_word(layer), thumb)
        if len(self.hot) >= self.hot_pages:
            if self.spilled is None:
                self.spilled = _SpilledPages(self.spill_folder)
            self.spilled.add(self.hot)
            self.hot = _HotPages()

    def __contains__(self, content_hash: str) -> bool:
        digest = bytes.fromhex(content_hash)
        return digest in self.hot or (self.spilled is not None and digest in self.spilled)

    def near(self, phash: str, max_distance: int, layer: str | None = None,
             thumb: bytes = b"", keep: int = 8) -> list[Candidate]:
        """The `keep` candidates for a near copy of a page nearest by thumbnail (see the
        module's docstring and `rank`)."""
        words, word = _hex_words(phash, 4), layer_word(layer)
        rows = self.hot.near(words, max_distance, word)
        found = rank(_Rows(rows, lambda r: self.hot.content.data[r].tobytes()),
                     self.hot.thumbs.data[rows], thumb, keep)
        if self.spilled is not None:
            found += self.spilled.near(words, max_distance, word, thumb, keep)
            found.sort(key=lambda c: (c.thumb_peak, c.thumb_distance))
        return found[:keep]

    def nbytes(self) -> int:
        """Bytes in memory (the spilled pages are on disk)."""
        hot = self.hot
        return (hot.content.data.nbytes + hot.phashes.data.nbytes + hot.layers.data.nbytes
                + hot.thumbs.data.nbytes + 150 * len(hot.by_content))

    def close(self) -> None:
        if self.spilled is not None:
            self.spilled.close()
            self.spilled = None
