"""ingest: files -> page metadata (cheap, no rendering) and rendered pages.

`probe` reads page counts and sizes (PDF page boxes, image headers) so the plan can order
requests before anything is rendered; `render` makes the image the model will see. Both
run in worker processes (see workers.py and render.py) and return plain picklable values;
`probe` returns a failure as an error string, `render` raises with the reason, which the
render stage turns into the page's error rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from functools import lru_cache

from PIL import Image

from vlbatch import library_chatter
from vlbatch.job import DEFAULT_MAX_IMAGE_MEGAPIXELS, Render
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
    kind: str  # "pdf" (MuPDF), "pdf-pdfium" (PDFium: MuPDF failed, pdfium.py) or "image"
    pages: list[PageSize]
    error: str | None = None  # the whole file failed: no pages


@dataclass(frozen=True)
class CompareSource:
    """Where the dedupe's comparison image of a page is made from when a pixel check needs
    it (pipeline/comparison.py): the file, the page and the settings its content hash was
    rendered with (the made image is checked against that hash: a file changed since gives
    no image, so no merge)."""

    path: str
    kind: str
    page: int
    dpi: int
    min_pixels: int
    max_pixels: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value) -> CompareSource | None:
        try:
            return cls(**value) if isinstance(value, dict) else None
        except TypeError:  # written by another version
            return None


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
    drawings: str | None = None  # PDF pages: digest of where they draw (drawings_digest)
    built: Image.Image | None = field(default=None, repr=False, compare=False)
    # the dedupe's view (imaging.comparison_budget): the page at the comparison budget as
    # PNG where the model's budget is smaller, or where to make it from on demand
    # (compare_source: the pipeline defers it, most pages are never pixel-checked); and the
    # 64x64 grey thumbnail of the model's image
    compare_png: bytes | None = field(default=None, repr=False)
    thumb: bytes = field(default=b"", repr=False)
    compare_source: CompareSource | None = None

    def image(self) -> Image.Image:
        if self.built is not None:
            return self.built
        return Image.frombytes("RGB", (self.width, self.height), self.rgb)

    def with_image(self) -> RenderedPage:
        """The page with its image built and its raw bytes dropped (the render hand-over
        thread does this, so the thread that feeds the engine does not)."""
        return dataclasses.replace(self, rgb=b"", built=self.image())

    def metadata(self) -> RenderedPage:
        """The page without its pixels (for rows and counters)."""
        return dataclasses.replace(self, rgb=b"", built=None, compare_png=None)

    @property
    def comparison_deferred(self) -> bool:
        """Its comparison image is not made yet (comparison.Comparisons makes it)."""
        return self.compare_png is None and self.compare_source is not None

    def comparison(self) -> Image.Image:
        """The page as the dedupe's pixel check sees it: at its comparison size."""
        if self.comparison_deferred:
            raise ValueError("the comparison image of this page is made on demand "
                             "(pipeline/comparison.py)")
        if self.compare_png is None:
            return self.image()
        with Image.open(io.BytesIO(self.compare_png)) as image:
            return image.convert("RGB")


# which library drew a page of each probe kind (the pages table's `renderer`)
RENDERERS = {"pdf": "mupdf", "pdf-pdfium": "pdfium", "image": "pillow"}


def file_kind(path: str) -> str:
    with open(path, "rb") as f:
        head = f.read(1024)
    if PDF_MAGIC in head or path.lower().endswith(".pdf"):
        return "pdf"
    return "image"


def _open_pdf(path: str, password: str | None):
    import pymupdf

    chatter = library_chatter()  # MuPDF prints repairs it survives (a bad ICC profile) to stderr
    pymupdf.TOOLS.mupdf_display_errors(chatter)
    pymupdf.TOOLS.mupdf_display_warnings(chatter)
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


def _open_image(path: str, max_megapixels: float) -> Image.Image:
    """The image, lazily; refused past `render.max_image_megapixels` (a decompression bomb
    guard: Pillow's own limit, ~89 MP, stops large-format scans)."""
    Image.MAX_IMAGE_PIXELS = int(max_megapixels * 1e6)  # per process: each worker sets it
    warnings.simplefilter("error", Image.DecompressionBombWarning)
    try:
        return Image.open(path)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(f"image over render.max_image_megapixels ({max_megapixels:g}): "
                         f"{e}") from None
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


def probe(path: str, dpi: int, password: str | None,
          max_megapixels: float = DEFAULT_MAX_IMAGE_MEGAPIXELS) -> Probe:
    """Page count and sizes, without rendering."""
    try:
        kind = file_kind(path)
        if kind == "pdf":
            try:
                doc = _open_pdf(path, password)
            except ValueError as e:
                if str(e).startswith("encrypted PDF"):
                    raise
                return _pdfium_probe(path, dpi, password, str(e))
            with doc:
                if doc.page_count == 0:
                    return _pdfium_probe(path, dpi, password,
                                         "PDF has no pages (empty, or damaged past repair)")
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
        with _open_image(path, max_megapixels) as image:
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


def _pdfium_probe(path: str, dpi: int, password: str | None, mupdf_error: str) -> Probe:
    """MuPDF could not read the file: PDFium's pages, else MuPDF's reason and PDFium's."""
    from vlbatch.pipeline import pdfium

    if not pdfium.available():
        return Probe("unknown", [], mupdf_error)
    try:
        return Probe(pdfium.PDFIUM, pdfium.page_sizes(path, dpi, password))
    except ValueError as e:
        return Probe("unknown", [], f"{mupdf_error}; PDFium: {e}")


def drawings_digest(pdf_page) -> str | None:
    """A digest of where a PDF page draws paths and images (each operation's kind and box,
    from MuPDF's bbox log; text is left to the text layer). Two renders of one page have the
    same; a tick, a strike, a signature, a stamp or a speck adds an operation, however few
    pixels it leaves at a coarse resolution, so the dedupe never merges pages whose digests
    differ. Boxes are taken relative to the page box (to 1/10,000 of its side), so the same
    page scaled onto a larger page box has the same digest. None where MuPDF cannot list
    them (the pixel check alone decides)."""
    try:
        page_box = pdf_page.rect
        x0, y0, width, height = page_box.x0, page_box.y0, page_box.width, page_box.height
        marks = sorted((kind, round((box[0] - x0) / width, 4), round((box[1] - y0) / height, 4),
                        round((box[2] - x0) / width, 4), round((box[3] - y0) / height, 4))
                       for kind, box in pdf_page.get_bboxlog()
                       if kind.startswith(("fill-", "stroke-")) and "text" not in kind)
    except Exception:
        return None
    return hashlib.blake2b(repr(marks).encode(), digest_size=16).hexdigest()


def _finish(image: Image.Image, text: str | None, drawings: str | None = None,
            compare: Image.Image | None = None, deferred: CompareSource | None = None,
            whole: Image.Image | None = None) -> RenderedPage:
    """The model's image (fitted), its hashes, and the dedupe's view of the page: `compare`
    (fitted to the comparison budget) where the model's image is smaller, else its own, or
    `deferred`: where to make it from when a pixel check needs it; and the thumbnail of
    `whole`, the page at its exact aspect ratio (the fitted images' sides are rounded to
    the model's factor, which stretches a small image by up to a tenth)."""
    compare_png = None
    if compare is not None and compare.size != image.size:
        buf = io.BytesIO()
        compare.save(buf, "PNG", compress_level=1)
        compare_png = buf.getvalue()
    return RenderedPage(image.width, image.height, image.tobytes(), text,
                        imaging.content_hash(image), imaging.perceptual_hash(image),
                        drawings=drawings, compare_png=compare_png,
                        thumb=imaging.thumbnail(whole if whole is not None else image),
                        compare_source=deferred if compare_png is None else None)


def _pdf_whole(pdf_page) -> Image.Image:
    """The page at its exact aspect ratio, THUMB_RENDER_SIDE pixels on its long side (for
    the thumbnail)."""
    import pymupdf

    rect = pdf_page.rect
    zoom = imaging.THUMB_RENDER_SIDE / max(rect.width, rect.height, 1e-6)
    pix = pdf_page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), alpha=False,
                              colorspace=pymupdf.csRGB)
    return Image.frombytes("RGB", (pix.width, pix.height), pix.samples)


def _pdf_image(pdf_page, dpi: int, min_pixels: int, max_pixels: int) -> Image.Image:
    """The page at `dpi`, lowered when it is larger than the pixel budget (never rendered
    big and then shrunk), then fitted to the exact model size."""
    import pymupdf

    rect = pdf_page.rect
    zoom = dpi / 72
    h, w = imaging.smart_resize(round(rect.height * zoom), round(rect.width * zoom),
                                min_pixels, max_pixels)
    zoom = min(zoom, max(w / rect.width, h / rect.height))  # render no larger than needed
    pix = pdf_page.get_pixmap(matrix=pymupdf.Matrix(zoom, zoom), alpha=False,
                              colorspace=pymupdf.csRGB)
    image = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
    return imaging.fit_to_budget(image, min_pixels, max_pixels)


@lru_cache(maxsize=2)  # per worker process: the PDFs it rendered last
def _open_pdf_once(path: str, mtime_ns: int, size: int, password: str | None):
    return _open_pdf(path, password)


def _worker_pdf(path: str, password: str | None):
    """The open document, reused across a worker's calls for pages of the same file (a
    file's pages otherwise re-open and re-parse it once per page)."""
    stat = os.stat(path)
    return _open_pdf_once(path, stat.st_mtime_ns, stat.st_size, password)


def render(path: str, kind: str, page: int, settings: Render,
           defer_comparison: bool = False) -> RenderedPage:
    """Render one page for the model (at the job's DPI and pixel budget) and, where that
    budget is below imaging.COMPARE_PIXELS, once more at that budget for the dedupe's pixel
    check (`imaging.comparison_budget`), so its decisions do not depend on render.max_pixels.
    defer_comparison: that second render is left for when a pixel check needs it (the
    pipeline's render workers: on an archive of one template it was two thirds of a page's
    render time, and few pages are ever pixel-checked); the page says where from."""
    dpi, min_pixels, max_pixels = settings.dpi, settings.min_pixels, settings.max_pixels
    compare_budget = imaging.comparison_budget(min_pixels, max_pixels)
    deferred = None
    if compare_budget is not None and defer_comparison:
        deferred = CompareSource(path, kind, page, dpi, min_pixels, max_pixels)
        compare_budget = None
    started = time.monotonic()
    if kind == "pdf-pdfium":  # a file MuPDF could not read (pdfium.py)
        from vlbatch.pipeline import pdfium

        image, compare, text, whole = pdfium.render_page(
            path, page, dpi, settings.pdf_password, min_pixels, max_pixels, compare_budget)
        rendered = _finish(image, text, None, compare, deferred, whole)
    elif kind == "pdf":
        pdf_page = _worker_pdf(path, settings.pdf_password)[page - 1]
        image = _pdf_image(pdf_page, dpi, min_pixels, max_pixels)
        compare = _pdf_image(pdf_page, dpi, *compare_budget) if compare_budget else None
        rendered = _finish(image, pdf_page.get_text("text"), drawings_digest(pdf_page), compare,
                           deferred, _pdf_whole(pdf_page))
    else:
        with _open_image(path, settings.max_image_megapixels) as image:
            if page > 1:
                image.seek(page - 1)
            image.load()
            source = imaging.to_rgb(image)
            compare = imaging.fit_to_budget(source, *compare_budget) if compare_budget else None
            rendered = _finish(imaging.fit_to_budget(source, min_pixels, max_pixels), None,
                               compare=compare, deferred=deferred, whole=source)
    return dataclasses.replace(rendered, render_s=time.monotonic() - started)
