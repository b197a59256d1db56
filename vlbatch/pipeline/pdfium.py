"""pdfium: the second PDF renderer (PDFium, through pypdfium2), for the files MuPDF cannot
open or reads as having no pages. On 919 files of public PDF test suites MuPDF failed 45;
PDFium opened 22 of them (issue 35). A file probed here has kind PDFIUM and is rendered
here too; the pages table says which renderer drew each page.

PDFium gives no drawing list like MuPDF's, so its pages have no drawings digest: in the
dedupe they are candidates only of pages with the same words and no drawings either
(dedupe.layer_key), and the pixel check decides.
"""

from __future__ import annotations

import math
from functools import lru_cache

from PIL import Image

from vlbatch.pipeline import imaging

PDFIUM = "pdf-pdfium"  # the probe's kind for a PDF that PDFium reads and MuPDF does not


def available() -> bool:
    try:
        import pypdfium2  # noqa: F401
    except ImportError:
        return False
    return True


def _open(path: str, password: str | None):
    import pypdfium2

    try:
        return pypdfium2.PdfDocument(path, password=password or None)
    except Exception as e:  # noqa: BLE001 - pypdfium2 raises PdfiumError and OSError kinds
        raise ValueError(str(e).strip() or type(e).__name__) from None


@lru_cache(maxsize=2)  # per worker process: the PDFs it rendered last
def _open_once(path: str, mtime_ns: int, size: int, password: str | None):
    return _open(path, password)


def page_sizes(path: str, dpi: int, password: str | None) -> list[tuple[int, int, str | None]]:
    """(width, height, error) of each page at `dpi`; ValueError when PDFium cannot open the
    file or finds no page in it."""
    from vlbatch.pipeline.ingest import PageSize

    pdf = _open(path, password)
    try:
        if len(pdf) == 0:
            raise ValueError("no pages")
        pages = []
        for i in range(len(pdf)):
            try:
                w_pt, h_pt = pdf.get_page_size(i)
                w, h = w_pt * dpi / 72, h_pt * dpi / 72
                if not (w >= 1 and h >= 1) or not math.isfinite(w * h):
                    pages.append(PageSize(i + 1, 0, 0, f"degenerate page box {w_pt}x{h_pt}"))
                else:
                    pages.append(PageSize(i + 1, round(w), round(h)))
            except Exception as e:  # noqa: BLE001
                pages.append(PageSize(i + 1, 0, 0, f"cannot read page: {e}"))
        return pages
    finally:
        pdf.close()


def render_page(path: str, page: int, dpi: int, password: str | None, min_pixels: int,
                max_pixels: int, compare_budget: tuple[int, int] | None
                ) -> tuple[Image.Image, Image.Image | None, str, Image.Image]:
    """(the model's image, the comparison image or None, the text layer, the page at its
    exact aspect ratio for the thumbnail) of one page."""
    import os

    stat = os.stat(path)
    pdf = _open_once(path, stat.st_mtime_ns, stat.st_size, password)
    pdf_page = pdf[page - 1]
    try:
        image = _image(pdf_page, dpi, min_pixels, max_pixels)
        compare = _image(pdf_page, dpi, *compare_budget) if compare_budget else None
        width, height = pdf_page.get_size()
        whole = _bitmap(pdf_page, imaging.THUMB_RENDER_SIDE / max(width, height, 1e-6))
        text_page = pdf_page.get_textpage()
        try:
            text = text_page.get_text_range()
        finally:
            text_page.close()
        return image, compare, text, whole
    finally:
        pdf_page.close()


def _image(pdf_page, dpi: int, min_pixels: int, max_pixels: int) -> Image.Image:
    """As ingest._pdf_image: at `dpi`, lowered to the budget, then fitted exactly."""
    width, height = pdf_page.get_size()
    zoom = dpi / 72
    h, w = imaging.smart_resize(round(height * zoom), round(width * zoom), min_pixels, max_pixels)
    zoom = min(zoom, max(w / width, h / height))
    return imaging.fit_to_budget(_bitmap(pdf_page, zoom), min_pixels, max_pixels)


def _bitmap(pdf_page, zoom: float) -> Image.Image:
    bitmap = pdf_page.render(scale=zoom, may_draw_forms=True)
    try:
        return bitmap.to_pil().convert("RGB")
    finally:
        bitmap.close()
