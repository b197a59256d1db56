"""The caches that outlive a run, in the job's `cache:` folder (diskcache): answers
(ResultCache) and rendered pages with their dedupe index (FeatureCache).

Answers are keyed by the request key (route.py: the page's pixels, the model, the prompt as
sent and the sampling settings, within a namespace). Values are bytes or JSON, never pickle, so a cache
folder can be shared; an entry that does not decode is dropped, counted and recomputed.
"""

from __future__ import annotations

import json
import queue
import threading
from functools import lru_cache
from pathlib import Path

from vlbatch.errors import JobCannotRunError


class PickledEntry(Exception):
    """A cache entry (or key) stored as pickle: vlbatch never writes one, and never loads one."""


@lru_cache(maxsize=1)
def _no_pickle_disk():
    """diskcache's Disk, less unpickling: diskcache's own Disk unpickles a pickled entry on
    read, so a shared cache folder that someone else wrote into could run their code."""
    import diskcache

    class NoPickleDisk(diskcache.Disk):
        def fetch(self, mode, filename, value, read):
            if mode == diskcache.core.MODE_PICKLE:
                raise PickledEntry
            return super().fetch(mode, filename, value, read)

        def get(self, key, raw):
            if not raw:
                raise PickledEntry
            return super().get(key, raw)

    return NoPickleDisk


def _open_cache(folder: Path, name: str, size_limit_gib: float):
    """A diskcache in folder/name, least recently used entries evicted past the limit."""
    import diskcache

    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        return diskcache.Cache(str(Path(folder) / name), size_limit=int(size_limit_gib * 2**30),
                               eviction_policy="least-recently-used", disk=_no_pickle_disk())
    except Exception as e:
        raise JobCannotRunError(f"cache folder {folder} is not usable: {e}") from None


class _JsonEntries:
    """JSON values in a diskcache; one that does not decode (or fails `valid`) is dropped
    and counted, so the caller recomputes it."""

    corrupt = 0

    def _raw(self, key: str):
        """The stored bytes, or None; a pickled entry is dropped and counted, not loaded."""
        try:
            return self._cache.get(key)
        except PickledEntry:
            self.corrupt += 1
            self._cache.delete(key)
            return None

    def _json(self, key: str, valid=lambda value: True):
        raw = self._raw(key)
        if raw is None:
            return None
        try:
            value = json.loads(raw)
            if valid(value):
                return value  # JSON null included (a page without a text layer)
        except (ValueError, TypeError, UnicodeDecodeError):
            pass
        self.corrupt += 1
        self._cache.delete(key)
        return None


class ResultCache(_JsonEntries):
    def __init__(self, folder: Path, size_limit_gib: float = 20.0):
        self.corrupt = 0
        self._cache = _open_cache(folder, "results", size_limit_gib)

    def get(self, key: str) -> dict | None:
        return self._json(key, lambda v: isinstance(v, dict) and isinstance(v.get("output"), str))

    def put(self, key: str, value: dict) -> None:
        self._cache.set(key, json.dumps(value).encode())

    def close(self) -> None:
        self._cache.close()


class FeatureCache(_JsonEntries):
    """Per page: hashes, size, text layer and the image as the model sees it (PNG), so a
    later run skips rendering; plus the perceptual-hash band index the dedupe searches.
    Opened in the main process and, read-write, in every render worker (diskcache is safe
    across processes)."""

    MAX_BAND_MEMBERS = 64
    WRITE_BATCH = 64  # pages indexed in one transaction, at most
    MAX_PENDING = 4096  # pages waiting for the index writer, at most (add() waits beyond)

    def __init__(self, folder: Path, size_limit_gib: float = 20.0, index_in_background: bool = True):
        self.corrupt = 0
        self.index_in_background = index_in_background
        self._pending: queue.Queue = queue.Queue(maxsize=self.MAX_PENDING)
        self._writer: threading.Thread | None = None
        self.write_error: str | None = None  # why the index writer stopped writing
        self.folder = Path(folder)
        self._cache = _open_cache(folder, "features", size_limit_gib)
        # nothing from earlier runs to search: this run's pages are in the dedupe's memory
        self.empty_at_open = len(self._cache) == 0

    @staticmethod
    def page_key(source_sha256: str, page: int, dpi: int, min_pixels: int, max_pixels: int) -> str:
        return f"page:{source_sha256}:{page}:{dpi}:{min_pixels}:{max_pixels}"

    def get_page(self, key: str) -> tuple[dict, bytes, bytes | None] | None:
        """(meta, the model's image as PNG, the comparison image as PNG or None); None when
        any of them is missing, or the entry was written by a version that did not keep the
        dedupe's view of the page (then it is rendered again). meta["deferred"]: the
        comparison image is made on demand (pipeline/comparison.py), and it is returned
        where it was made already."""
        meta = self._json(key)
        if not isinstance(meta, dict) or not {"content_hash", "thumb", "compare"} <= meta.keys():
            return None
        png = self._raw("image:" + meta["content_hash"])
        wanted = meta["compare"] or meta.get("deferred")
        compare = self._raw("compare:" + meta["content_hash"]) if wanted else None
        if not isinstance(png, bytes) or (meta["compare"] and not isinstance(compare, bytes)):
            return None
        return meta, png, compare if isinstance(compare, bytes) else None

    def put_compare(self, content_hash: str, png: bytes) -> None:
        """A comparison image made on demand (comparison.render_comparison)."""
        self._cache.set("compare:" + content_hash, png)

    def has_page(self, key: str) -> bool:
        return key in self._cache

    def put_page(self, key: str, meta: dict, png: bytes, compare: bytes | None = None) -> None:
        self._cache.set("image:" + meta["content_hash"], png)
        if compare is not None:
            self._cache.set("compare:" + meta["content_hash"], compare)
        self._cache.set(key, json.dumps({**meta, "compare": compare is not None}).encode())

    def comparison(self, content_hash: str) -> tuple[object, str | None, str | None] | None:
        """(comparison image, text layer, drawings digest) of a canonical page of an earlier
        run, for the dedupe's pixel check, with a CompareSource in place of the image where
        it is made on demand and was not made yet; None where any of them cannot be read
        (an entry evicted, damaged, or written by a version without them): then no merge."""
        import io

        from PIL import Image

        from vlbatch.pipeline.ingest import CompareSource

        look = self._json("look:" + content_hash)
        if not isinstance(look, dict) or not {"text", "drawings", "compare"} <= look.keys():
            return None
        deferred = None if look["compare"] else CompareSource.from_json(look.get("source"))
        png = self._raw(("compare:" if look["compare"] or deferred else "image:") + content_hash)
        if not isinstance(png, bytes):
            # made on demand (the dedupe makes it from there), or gone: then no merge
            return (deferred, look["text"], look["drawings"]) if deferred else None
        try:
            image = Image.open(io.BytesIO(png))
            image.load()
        except Exception:
            self.corrupt += 1
            return None
        return image.convert("RGB"), look["text"], look["drawings"]

    # the band and layer index (dedupe.Deduper's `index`)
    def members(self, key: str) -> list[tuple[str, str, str | None]]:
        """(content hash, perceptual hash, layer key) of the canonical pages under a
        "band:..." or "layer:..." key; entries written by a version that did not store all
        three are left out (no merge without the safeguards)."""
        found = self._json(key)
        if not isinstance(found, list):
            return []
        return [(m[0], m[1], m[2]) for m in found if isinstance(m, list) and len(m) == 3
                and isinstance(m[0], str) and isinstance(m[1], str)]

    def thumb(self, content_hash: str) -> bytes:
        """A canonical page's thumbnail (b"" where it is gone: it then ranks last)."""
        found = self._raw("thumb:" + content_hash)
        return found if isinstance(found, bytes) else b""

    def phash(self, content_hash: str) -> str | None:
        found = self._json("phash:" + content_hash)
        return found if isinstance(found, str) else None

    def add(self, page, bands: list[str], layer: str | None) -> None:
        """Index a canonical page (a RenderedPage) under its perceptual-hash bands and its
        layer key, in a background thread (indexing inline cost the route stage 12% of W1
        throughput on the H200 when it shared the engine's thread). The dedupe keeps this
        run's pages in memory, so it never waits for these writes."""
        deferred = page.compare_source.to_json() if page.comparison_deferred else None
        entry = (page.content_hash, page.phash, tuple(bands), layer, page.text_layer,
                 page.drawings, page.thumb, page.compare_png is not None, deferred)
        if not self.index_in_background:
            self._write_index([entry])
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="vlbatch-index",
                                            daemon=True)
            self._writer.start()
        while True:
            self._check_writer()
            try:
                self._pending.put(entry, timeout=0.5)
                return
            except queue.Full:
                continue

    def _check_writer(self) -> None:
        if self.write_error is not None:
            raise JobCannotRunError(f"the dedupe index in {self.folder} could not be "
                                    f"written: {self.write_error}")

    def _write_loop(self) -> None:
        """Write what is queued in batches, one transaction each: a band shared by the
        batch's pages (W1's pages share a layout) is read and written once, not per page."""
        while True:
            batch = [self._pending.get()]
            while batch[-1] is not None and len(batch) < self.WRITE_BATCH:
                try:
                    batch.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            pages = [page for page in batch if page is not None]  # None: close() ends the queue
            if pages and self.write_error is None:
                try:
                    self._write_index(pages)
                except Exception as e:  # disk full, a broken database: the run ends, saying so
                    self.write_error = f"{type(e).__name__}: {e}"
            if batch[-1] is None:  # after an error the queue is still drained, so nothing waits
                return

    def _write_index(self, pages: list[tuple]) -> None:
        joining: dict[str, list[list]] = {}  # band or layer -> pages joining it, in order
        with self._cache.transact():
            for (content_hash, phash, page_bands, layer, text, drawings, thumb, compare,
                 deferred) in pages:
                self._cache.set("phash:" + content_hash, json.dumps(phash).encode())
                # the comparison image itself is in the page entry (put_page, by the worker),
                # or made on demand from `source` (comparison.py)
                self._cache.set("look:" + content_hash, json.dumps(
                    {"text": text, "drawings": drawings, "compare": compare,
                     "source": deferred}).encode())
                self._cache.set("thumb:" + content_hash, thumb)
                member = [content_hash, phash, layer]
                for key in ["band:" + band for band in page_bands] + (
                        ["layer:" + layer] if layer is not None else []):
                    joining.setdefault(key, []).append(member)
            for key, new in joining.items():
                found = self._json(key)
                members = [m for m in found if isinstance(m, list) and len(m) == 3] \
                    if isinstance(found, list) else []
                known = {m[0] for m in members}
                added = list({m[0]: m for m in new if m[0] not in known}.values())  # each once
                if added:
                    members = (members + added)[-self.MAX_BAND_MEMBERS:]
                    self._cache.set(key, json.dumps(members).encode())

    def close(self) -> None:
        """Finish the index writes; JobCannotRunError if the writer could not write them."""
        if self._writer is not None:
            self._pending.put(None)
            self._writer.join()
            self._writer = None
        self._cache.close()
        self._check_writer()


def namespaces(folder: Path) -> list[str]:
    """The tenants with a cache in this folder (CACHE/<namespace>/results|features)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(d.name for d in folder.iterdir()
                  if d.is_dir() and any((d / name).is_dir() for name in ("results", "features")))


def cache_stats(folder: Path, tenants: list[str]) -> list[dict]:
    """Entries and bytes per namespace, cache and kind of entry, for `vlbatch cache stats`.
    Keys are read from diskcache's SQLite table as stored: nothing is unpickled."""
    import sqlite3

    rows = []
    for tenant in tenants:
        for name in ("results", "features"):
            db = Path(folder) / tenant / name / "cache.db"
            row = {"namespace": tenant, "cache": name, "entries": 0, "bytes": 0, "kinds": {}}
            if db.exists():
                with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
                    for key, raw, size in con.execute("SELECT key, raw, size FROM Cache"):
                        kind = str(key).split(":", 1)[0] if raw and isinstance(key, str) else "pickled"
                        row["kinds"][kind] = row["kinds"].get(kind, 0) + 1
                        row["entries"] += 1
                        row["bytes"] += size or 0
                con.close()
            rows.append(row)
    return rows


def clear_cache(folder: Path, tenants: list[str], which: str = "all") -> int:
    import shutil

    removed = 0
    for tenant in tenants:
        for name in ("results", "features"):
            path = Path(folder) / tenant / name
            if which in ("all", name) and path.exists():
                cache = _open_cache(path.parent, name, 1.0)
                removed += len(cache)
                cache.close()
                shutil.rmtree(path)
    return removed
