"""Thumbnails of the gallery's pages, as data: URIs (JPEG).

A page comes from the feature cache where the run left it (the image as the model saw it);
otherwise it is rendered again from its file, in a worker process with the job's per-page
time limit (a page that hung or crashed a worker once may do it again), and only when the
file still has the hash the run saw. A page without a thumbnail says why.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import time
from pathlib import Path

from PIL import Image

THUMB_WIDTH = 300
PAGE_RENDER_S = 15.0  # a gallery page's render stops after this (or the job's limit)
ALL_RENDERS_S = 60.0  # no gallery page starts rendering after this


def _jpeg_uri(image: Image.Image, width: int = THUMB_WIDTH) -> str:
    image = image.convert("RGB")
    image.thumbnail((width, width * 3))
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=72, optimize=True)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def render_thumbnail(path: str, kind: str, page: int, render: dict) -> str:
    """In a worker: the page rendered as the run rendered it, as a data: URI."""
    from vlbatch.job import Render
    from vlbatch.pipeline import ingest

    rendered = ingest.render(path, kind, page, Render(**render))
    return _jpeg_uri(rendered.image())


def _file_sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def add_thumbnails(pages: list, config: dict) -> None:
    """Set `thumbnail` (or `thumbnail_note`) on each GalleryPage."""
    render = config.get("render", {})
    wanted = []
    cache = _feature_cache(config)
    try:
        for g in pages:
            if g.page is None or g.page_error:
                g.thumbnail_note = "no image: the page did not render"
                continue
            if cache is not None and g.source_sha256:
                from vlbatch.pipeline.cache import FeatureCache

                hit = cache.get_page(FeatureCache.page_key(
                    g.source_sha256, g.page, render.get("dpi", 150),
                    render.get("min_pixels", 0), render.get("max_pixels", 0)))
                if hit is not None:
                    try:
                        with Image.open(io.BytesIO(hit[1])) as image:
                            g.thumbnail = _jpeg_uri(image)
                        continue
                    except Exception:  # noqa: BLE001 - a damaged entry: render it
                        pass
            wanted.append(g)
    finally:
        if cache is not None:
            cache.close()
    _render_missing(wanted, render)


def _feature_cache(config: dict):
    if not config.get("feature_cache", True) or not config.get("cache"):
        return None
    folder = Path(config["cache"]) / config.get("cache_namespace", "default")
    if not (folder / "features").is_dir():
        return None  # never create a cache folder to read nothing from it
    from vlbatch.pipeline.cache import FeatureCache

    try:
        return FeatureCache(folder, config.get("cache_size_gib", 20.0), index_in_background=False)
    except Exception:  # noqa: BLE001 - unreadable: render instead
        return None


def _render_missing(pages: list, render: dict) -> None:
    from vlbatch.pipeline.ingest import file_kind

    todo = []
    for g in pages:
        if not os.path.isfile(g.source):
            g.thumbnail_note = "no image: the file is gone"
        elif g.source_sha256 and _file_sha256(g.source) != g.source_sha256:
            g.thumbnail_note = "no image: the file changed since the run"
        else:
            todo.append(g)
    if not todo:
        return
    from vlbatch.pipeline.workers import WorkerPool

    timeout = min(float(render.get("page_timeout_s", 120.0)), PAGE_RENDER_S)
    started = time.monotonic()
    with WorkerPool(1, timeout, lookahead=1) as pool:
        for g, result in pool.imap(render_thumbnail, todo,
                                   lambda g: (g.source, file_kind(g.source), g.page, render)):
            if isinstance(result, str):
                g.thumbnail = result
            else:
                g.thumbnail_note = f"no image: rendering it again failed ({result})"
            if time.monotonic() - started > ALL_RENDERS_S:
                break
    for g in todo:
        if g.thumbnail is None and g.thumbnail_note is None:
            g.thumbnail_note = "no image: out of time for the gallery's renders"
