"""ingest: files -> page metadata (cheap, no rendering) and rendered pages.

`probe` reads page counts and sizes (PDF page boxes, image headers) so the plan can order
requests before anything is rendered; `render_page` makes the image the model will see.
Both run in worker processes (see workers.py) and return plain picklable values; a failure
is returned as an error string, never raised, so one bad file never stops the run.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from vlbatch.pipeline import imaging

PDF_MAGIC = b"%PDF-"


@dataclass(frozen=True)
class PageSize:
    page: int  # 1-based
    width: int  # pixels at the job's DPI (PDF) or as stored (image), before the budget
    height: int
    error: str | None = None


@dataclass(frozen=True)
class Probe:
    kind: str  # "pdf" or "image"
    pages: list[PageSize]
    error: str | None = None  # the whole file failed: no pages


@dataclass(frozen=True)
class RenderedPage:
    width: int
    height: int
    rgb: bytes  # the normalised image as the model will see it (width x height x 3)
    text_layer: str | None
    content_hash: str
    phash: str
    from_cache: bool = False  # read from the feature cache, not rendered
    render_s: float = 0.0  # worker time spent on this page
    healed: bool = False  # its feature-cache entry was damaged, so it was rendered again
    built: Image.Image | None = field(default=None, repr=False, compare=False)

    def image(self) -> Image.Image:
        if self.built is not None:
            return self.built
        return Image.frombytes("RGB", (self.width, self.height), self.rgb)

    def with_image(self) -> RenderedPage:
        """The page with its image built and its raw bytes dropped (the render hand-over
        thread does this, so the thread that feeds the engine does not)."""
        return dataclasses.replace(self, rgb=b"", built=self.image())


class FileTimeBudget:
    """render.file_timeout_s: the render seconds one file may use in all. A page that ran
    past its own limit counts as the whole page limit."""

    def __init__(self, limit_s: float, page_timeout_s: float):
        self.limit_s, self.page_timeout_s = limit_s, page_timeout_s
        self.spent: dict[str, float] = {}  # per file path
        self.reason = f"timeout: the file used up its time limit ({limit_s:g} s)"

    def used_up(self, path: str) -> bool:
        return self.spent.get(path, 0.0) > self.limit_s

    def charge(self, path: str, result: object) -> None:
        from vlbatch.pipeline.workers import CallTimedOut

        cost = (result.render_s if isinstance(result, RenderedPage)
                else self.page_timeout_s if isinstance(result, CallTimedOut) else 0.0)
        self.spent[path] = self.spent.get(path, 0.0) + cost


def failure_reasons(error: Exception) -> tuple[str, str]:
    """(page row error, result row error) for a page that did not render: a page stopped by
    its time limit or a dead worker says so; any other failure is 'render failed: ...'."""
    from vlbatch.pipeline.workers import CallTimedOut, WorkerDied

    stopped = isinstance(error, (CallTimedOut, WorkerDied))
    return str(error), str(error) if stopped else f"render failed: {error}"


def file_kind(path: str) -> str:
    with open(path, "rb") as f:
        head = f.read(1024)
    if PDF_MAGIC in head or path.lower().endswith(".pdf"):
        return "pdf"
    return "image"


def _open_pdf(path: str, password: str | None):
    import pymupdf

    try:
        doc = pymupdf.open(path, filetype="pdf")
    except Exception as e:  # MuPDF's own reason: broken, empty, not a PDF
        raise ValueError(f"cannot open PDF: {e}") from None
    if doc.needs_pass:
        if not password:
            raise ValueError("encrypted PDF (no password given; set render.pdf_password)")
        if not doc.authenticate(password):
            raise ValueError("encrypted PDF: the password given does not open it")
    return doc


def _open_image(path: str) -> Image.Image:
    warnings.simplefilter("error", Image.DecompressionBombWarning)
    try:
        return Image.open(path)
    except Image.DecompressionBombError as e:
        raise ValueError(f"decompression bomb: {e}") from None
    except Image.DecompressionBombWarning as e:
        raise ValueError(f"decompression bomb: {e}") from None
    except Exception as e:
        raise ValueError(f"not a readable image or PDF: {e}") from None


def _degenerate_box(doc, page) -> str | None:
    """MuPDF silently replaces a page box of (nearly) zero size with US Letter; such a page
    has no real content area, so it is reported rather than rendered as a blank page."""
    kind, value = doc.xref_get_key(page.xref, "MediaBox")
    if kind != "array":
        return None
    try:
        x0, y0, x1, y1 = (float(v) for v in value.strip("[]").split())
    except ValueError:
        return f"unreadable page box {value}"
    if abs(x1 - x0) < 1 or abs(y1 - y0) < 1:
        return f"degenerate page box {value}"
    return None


def probe(path: str, dpi: int, password: str | None) -> Probe:
    """Page count and sizes, without rendering."""
    try:
        kind = file_kind(path)
        if kind == "pdf":
            with _open_pdf(path, password) as doc:
                if doc.page_count == 0:
                    return Probe(kind, [], "PDF has no pages")
                pages = []
                for i in range(doc.page_count):
                    try:
                        rect = doc[i].rect  # rotation applied
                        w, h = rect.width * dpi / 72, rect.height * dpi / 72
                        degenerate = _degenerate_box(doc, doc[i])
                        if degenerate:
                            pages.append(PageSize(i + 1, 0, 0, degenerate))
                        elif not (w >= 1 and h >= 1) or not math.isfinite(w * h):
                            pages.append(PageSize(i + 1, 0, 0, f"degenerate page box {rect}"))
                        else:
                            pages.append(PageSize(i + 1, round(w), round(h)))
                    except Exception as e:
                        pages.append(PageSize(i + 1, 0, 0, f"cannot read page: {e}"))
                return Probe(kind, pages)
        with _open_image(path) as image:
            frames = getattr(image, "n_frames", 1) if image.format in ("TIFF", "MPO") else 1
            pages = []
            for frame in range(frames):
                image.seek(frame)
                w, h = image.size
                if image.getexif().get(0x0112) in (5, 6, 7, 8):  # EXIF: rotated 90 degrees
                    w, h = h, w
                pages.append(PageSize(frame + 1, w, h))
            return Probe(kind, pages)
    except ValueError as e:
        return Probe("unknown", [], str(e))
    except Exception as e:  # anything a native library throws
        return Probe("unknown", [], f"{type(e).__name__}: {e}")


def _finish(image: Image.Image, text: str | None, min_pixels: int, max_pixels: int) -> RenderedPage:
    image = imaging.fit_to_budget(imaging.to_rgb(image), min_pixels, max_pixels)
    return RenderedPage(image.width, image.height, image.tobytes(), text,
                        imaging.content_hash(image), imaging.perceptual_hash(image))


_feature_caches: dict[str, object] = {}  # per worker process, opened once


def render_page(path: str, kind: str, page: int, dpi: int, min_pixels: int, max_pixels: int,
                password: str | None, cache_dir: str | None = None,
                cache_key: str | None = None) -> RenderedPage:
    """The page as the model sees it: from the feature cache when an earlier run rendered
    it with the same settings, else rendered (and then cached)."""
    cache, damaged = None, False
    if cache_dir and cache_key:
        from vlbatch.pipeline.cache import FeatureCache

        cache = _feature_caches.get(cache_dir) or _feature_caches.setdefault(
            cache_dir, FeatureCache(Path(cache_dir)))
        hit = cache.get_page(cache_key)
        if hit is not None:
            meta, png = hit
            try:
                with Image.open(io.BytesIO(png)) as image:
                    rgb = image.convert("RGB")
                return RenderedPage(rgb.width, rgb.height, rgb.tobytes(), meta.get("text_layer"),
                                    meta["content_hash"], meta["phash"], from_cache=True)
            except Exception:  # a damaged entry: render again, and overwrite it
                damaged = True
    started = time.monotonic()
    rendered = _render(path, kind, page, dpi, min_pixels, max_pixels, password)
    rendered = dataclasses.replace(rendered, render_s=time.monotonic() - started, healed=damaged)
    if cache is not None:
        buf = io.BytesIO()
        rendered.image().save(buf, "PNG", compress_level=1)
        cache.put_page(cache_key, {"content_hash": rendered.content_hash, "phash": rendered.phash,
                                   "text_layer": rendered.text_layer, "width": rendered.width,
                                   "height": rendered.height,
                                   "image_tokens": (rendered.width // imaging.IMAGE_FACTOR)
                                   * (rendered.height // imaging.IMAGE_FACTOR)}, buf.getvalue())
    return rendered


_open_docs: dict[tuple, object] = {}  # per worker process: the PDFs it rendered last
KEEP_OPEN = 2


def _worker_pdf(path: str, password: str | None):
    """The open document, reused across a worker's calls for pages of the same file (a
    file's pages otherwise re-open and re-parse it once per page)."""
    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size, password)
    doc = _open_docs.pop(key, None) or _open_pdf(path, password)
    _open_docs[key] = doc  # most recent last
    while len(_open_docs) > KEEP_OPEN:
        _open_docs.pop(next(iter(_open_docs))).close()
    return doc


def _render(path: str, kind: str, page: int, dpi: int, min_pixels: int, max_pixels: int,
            password: str | None) -> RenderedPage:
    """Render one page at the job's DPI, lowered when the page is larger than the pixel
    budget (never rendered big and then shrunk), then fitted to the exact model size."""
    if kind == "pdf":
        import pymupdf

        pdf_page = _worker_pdf(path, password)[page - 1]
        rect = pdf_page.rect
        zoom = dpi / 72
        h, w = imaging.smart_resize(round(rect.height * zoom), round(rect.width * zoom),
                                    min_pixels, max_pixels)
        zoom = min(zoom, max(w / rect.width, h / rect.height))  # render no larger than needed
        pix = pdf_page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), alpha=False,
                                  colorspace=pymupdf.csRGB)
        image = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
        text = pdf_page.get_text("text")
        return _finish(image, text, min_pixels, max_pixels)
    with _open_image(path) as image:
        if page > 1:
            image.seek(page - 1)
        image.load()
        return _finish(image, None, min_pixels, max_pixels)
