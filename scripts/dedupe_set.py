"""The generated page set of the dedupe benchmark: five layouts (invoice, two-column
article, form, chart, photo with a caption), each in several forms (the PDF rendered at
100-300 dpi, PNG and JPEG files made from renders at 150-300 dpi), and local differences
that leave the text layer as it is (a tick, a signature, a stamp, a struck-through line of
text, a watermark, a speck in the margin). Every page goes through vlbatch's own rendering
(`ingest.render` on a real file), so the pixels are the ones the dedupe sees in a run.

Pairs: "must" (the same page in two forms: re-renders at another resolution, JPEG
re-encodings, raster files against the PDF, the page scaled onto a larger page box) and
"never" (a page against itself with one local difference, in any two forms; another
document of the same layout; a statement of one template with every number different;
a status table whose one dot is red in one page and green, of the same grey, in the
other; a two-page TIFF of solid red and solid green). Every pair at a pixel budget
(`budget`: the job's render.max_pixels).
"""

from __future__ import annotations

import io
import math
import random
import tempfile
from pathlib import Path

import numpy as np
import pymupdf
from PIL import Image, ImageDraw

from vlbatch.job import Render
from vlbatch.pipeline import ingest

LAYOUTS = ("invoice", "article", "form", "chart", "photo")
BUDGETS = (64 * 32 * 32, 256 * 32 * 32, 1280 * 32 * 32)  # render.max_pixels
MARKS = ("tick", "signature", "stamp", "strike", "watermark", "speck")

WORDS = ("the of and to in is for on with as by at from this that which be are was it an or "
         "supplier invoice total amount payment delivery order quantity price report quarter "
         "revenue growth market customer contract section clause party agreement").split()

def _text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))

def layout(kind: str, seed: int) -> pymupdf.Document:
    """A one-page PDF of one of the LAYOUTS (seed: its words and numbers)."""
    rng = random.Random(seed)
    doc = pymupdf.open(); page = doc.new_page(width=595, height=842)
    if kind == "invoice":
        page.insert_text((56, 70), f"ACME Supplies {seed} - INVOICE", fontsize=18, fontname="hebo")
        for i, label in enumerate(["Invoice number", "Date", "Bill to"]):
            page.insert_text((56, 110 + 18 * i), f"{label}: {rng.randint(10000, 99999)}", fontsize=11)
        for r in range(10):
            for c in range(4):
                rect = pymupdf.Rect(56 + c * 120, 200 + r * 20, 176 + c * 120, 220 + r * 20)
                page.draw_rect(rect, color=(0, 0, 0), width=0.5)
                page.insert_text((rect.x0 + 4, rect.y1 - 6), rng.choice(WORDS) if c == 0 else f"{rng.uniform(1, 999):.2f}", fontsize=9)
        page.insert_text((56, 440), f"Total due: {rng.uniform(10, 9999):,.2f} EUR", fontsize=12, fontname="hebo")
    elif kind == "article":
        page.insert_text((56, 60), f"Quarterly report {seed}", fontsize=16, fontname="hebo")
        for col in range(2):
            y = 90
            while y < 800:
                page.insert_text((56 + col * 250, y), _text(rng, 9), fontsize=8)
                y += 11
    elif kind == "form":
        page.insert_text((56, 60), f"Application form {seed}", fontsize=16, fontname="hebo")
        for i in range(14):
            y = 100 + i * 40
            page.draw_rect(pymupdf.Rect(56, y, 68, y + 12), color=(0, 0, 0), width=0.8)
            page.insert_text((76, y + 10), _text(rng, 6), fontsize=10)
            page.draw_line((330, y + 12), (540, y + 12), color=(0, 0, 0), width=0.5)
    elif kind == "chart":
        page.insert_text((56, 60), f"Sales by region {seed}", fontsize=16, fontname="hebo")
        page.draw_line((80, 450), (540, 450), width=1); page.draw_line((80, 450), (80, 120), width=1)
        for i in range(8):
            h = rng.uniform(40, 300)
            page.draw_rect(pymupdf.Rect(100 + i * 55, 450 - h, 135 + i * 55, 450), color=None,
                           fill=(0.2 + 0.08 * i, 0.4, 0.7))
            page.insert_text((100 + i * 55, 466), f"R{i}", fontsize=8)
        for y in range(500, 800, 12):
            page.insert_text((56, y), _text(rng, 12), fontsize=9)
    elif kind == "photo":
        page.insert_text((56, 60), f"Site inspection {seed}", fontsize=16, fontname="hebo")
        noise = np.random.RandomState(seed).rand(48, 64, 3) * 255
        photo = Image.fromarray(noise.astype(np.uint8)).resize((640, 480), Image.Resampling.BICUBIC)
        buf = io.BytesIO(); photo.save(buf, "JPEG", quality=90)
        page.insert_image(pymupdf.Rect(56, 90, 536, 450), stream=buf.getvalue())
        for y in range(480, 800, 12):
            page.insert_text((56, y), _text(rng, 12), fontsize=9)
    return doc


def statement(seed: int) -> pymupdf.Document:
    """One template (a bank statement), every number drawn from `seed`: the account number
    and all 14 amounts differ between two seeds, the layout and the labels do not."""
    rng = random.Random(seed)
    doc = pymupdf.open(); page = doc.new_page(width=595, height=842)
    page.insert_text((56, 70), "Northbank - Monthly statement", fontsize=18, fontname="hebo")
    page.insert_text((56, 100), f"Account {rng.randint(10**7, 10**8 - 1)}", fontsize=11)
    for r in range(14):
        rect = pymupdf.Rect(56, 140 + r * 22, 536, 162 + r * 22)
        page.draw_rect(rect, color=(0, 0, 0), width=0.5)
        page.insert_text((62, rect.y1 - 7), f"Item {r + 1}", fontsize=10)
        page.insert_text((440, rect.y1 - 7), f"{rng.uniform(1, 9999):9.2f}", fontsize=10)
    return doc


def status_table(dot: tuple[float, float, float]) -> pymupdf.Document:
    """A status table with one coloured dot; red (1, 0, 0) and green (0, 0.502, 0) have the
    same grey level (76 and 75 of 255)."""
    doc = pymupdf.open(); page = doc.new_page(width=595, height=842)
    page.insert_text((56, 70), "Service status", fontsize=18, fontname="hebo")
    for r, name in enumerate(["Billing", "Search", "Storage", "Mail", "Reports"]):
        y = 120 + r * 30
        page.insert_text((56, y), name, fontsize=12)
        colour = dot if r == 2 else (0, 0.502, 0)
        page.draw_circle((300, y - 4), 7, color=colour, fill=colour)
    return doc


def on_larger_box(doc: pymupdf.Document, scale: float = 1.5) -> pymupdf.Document:
    """The document's page placed, scaled, on a page box `scale` times as large."""
    out = pymupdf.open(); src = doc[0]
    page = out.new_page(width=src.rect.width * scale, height=src.rect.height * scale)
    page.show_pdf_page(page.rect, doc, 0)
    return out


def solid_tiff(folder: Path) -> Path:
    """A two-page TIFF: solid red, then solid green of the same grey."""
    path = folder / "red-green.tif"
    red, green = Image.new("RGB", (850, 1100), (255, 0, 0)), Image.new("RGB", (850, 1100), (0, 130, 0))
    red.save(path, save_all=True, append_images=[green])
    return path

def _overlay(page, draw_fn, rect) -> None:
    """Drawn with Pillow on a transparent image placed on the page: no text is added."""
    w, h = int(rect.width * 4), int(rect.height * 4)
    img = Image.new("RGBA", (w, h), (0, 0, 0, 0)); draw_fn(ImageDraw.Draw(img), w, h)
    buf = io.BytesIO(); img.save(buf, "PNG"); page.insert_image(rect, stream=buf.getvalue())

def mark(doc: pymupdf.Document, what: str, seed: int = 0) -> pymupdf.Document:
    """One of the MARKS added to the page; the text layer stays as it is."""
    page = doc[0]; rng = random.Random(seed)
    if what == "tick":
        x, y = 300 + rng.randint(0, 150), 480 + rng.randint(0, 250)
        # a small check mark, 10 pt
        page.draw_polyline([(x, y + 5), (x + 3, y + 9), (x + 10, y)], color=(0, 0, 0), width=1.2)
    elif what == "signature":
        x, y = 330, 760
        pts = [(x + i * 4, y + 8 * math.sin(i * 0.9 + seed)) for i in range(30)]
        page.draw_polyline(pts, color=(0.05, 0.1, 0.5), width=1.0)
    elif what == "stamp":
        def stamp(d, w, h):
            d.ellipse((4, 4, w - 4, h - 4), outline=(200, 0, 0, 200), width=10)
            d.line((30, h // 2, w - 30, h // 2), fill=(200, 0, 0, 200), width=14)
        _overlay(page, stamp, pymupdf.Rect(400, 600, 500, 680))
    elif what == "strike":  # through the middle of one line of text, end to end
        lines = [l["bbox"] for b in page.get_text("dict")["blocks"] for l in b.get("lines", [])]
        x0, y0, x1, y1 = rng.choice(lines[1:])
        y = y0 + 0.6 * (y1 - y0)
        page.draw_line((x0, y), (x1, y), color=(0, 0, 0), width=0.8)
    elif what == "watermark":
        def water(d, w, h):
            for i in range(6):
                d.line((0, h - i * 40 - 200, w, -i * 40 + 200), fill=(0, 0, 0, 40), width=50)
        _overlay(page, water, pymupdf.Rect(56, 200, 536, 700))
    elif what == "speck":  # a 1.6-pt dot in the right margin
        x, y = 560 + rng.randint(0, 20), 100 + rng.randint(0, 600)
        page.draw_circle((x, y), 0.8, color=(0, 0, 0), fill=(0, 0, 0))
    return doc


class Forms:
    """A document's page in the forms a corpus holds it in, rendered the way a run renders
    each file (a PDF at the job's DPI; an image file made elsewhere from a raster)."""

    count = 0

    def __init__(self, doc: pymupdf.Document, folder: Path, budget: int = BUDGETS[-1]):
        Forms.count += 1
        self.pdf = folder / f"doc{Forms.count}.pdf"
        doc.save(self.pdf)
        self.doc, self.folder, self.done, self.budget = doc, folder, {}, budget

    def settings(self, dpi: int) -> Render:
        return Render(dpi=dpi, max_pixels=self.budget, min_pixels=min(64 * 32 * 32, self.budget))

    def pdf_at(self, dpi: int):
        key = ("pdf", dpi)
        if key not in self.done:
            self.done[key] = _seen(ingest.render(str(self.pdf), "pdf", 1, self.settings(dpi)))
        return self.done[key]

    def file(self, dpi: int, kind: str, quality: int = 85):
        """The page rasterised at `dpi` and saved as a PNG or JPEG file; no text layer."""
        key = (kind, dpi, quality)
        if key not in self.done:
            pix = self.doc[0].get_pixmap(dpi=dpi, colorspace=pymupdf.csRGB, alpha=False)
            image = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
            path = self.folder / f"{self.pdf.stem}-{dpi}-{quality}.{kind}"
            image.save(path, "JPEG" if kind == "jpg" else "PNG",
                       **({"quality": quality} if kind == "jpg" else {}))
            self.done[key] = _seen(ingest.render(str(path), "image", 1, self.settings(dpi)))
        return self.done[key]


def _seen(page) -> "ingest.RenderedPage":
    return page


FORM_PAIRS = {  # name: (form a, form b) as (kind, dpi[, quality])
    "PDF 150 dpi / PDF 100 dpi": (("pdf", 150), ("pdf", 100)),
    "PDF 150 dpi / PDF 300 dpi": (("pdf", 150), ("pdf", 300)),
    "PNG 150 dpi / JPEG 200 dpi": (("png", 150), ("jpg", 200)),
    "PNG 150 dpi / PNG 300 dpi": (("png", 150), ("png", 300)),
    "PDF 150 dpi / JPEG q70 150 dpi": (("pdf", 150), ("jpg", 150, 70)),
    "JPEG 200 dpi / PDF 100 dpi": (("jpg", 200), ("pdf", 100)),
}
MARK_PAIRS = ("PDF 150 dpi / PDF 100 dpi", "PNG 150 dpi / JPEG 200 dpi",
              "PDF 150 dpi / JPEG q70 150 dpi")


def _form(forms: Forms, spec: tuple):
    return forms.pdf_at(spec[1]) if spec[0] == "pdf" else forms.file(spec[1], spec[0], *spec[2:])


TEMPLATE_PAIRS = ("PNG 150 dpi / JPEG 200 dpi", "PDF 150 dpi / JPEG q70 150 dpi",
                  "PNG 150 dpi / PNG 300 dpi")


def template_pairs(seeds, folder: Path, budget: int):
    """The cases of one template: statements with every number different (in raster forms,
    where no text layer tells them apart), the coloured dot, the larger page box."""
    for seed in seeds:
        ours, theirs = Forms(statement(seed), folder, budget), Forms(statement(seed + 100), folder, budget)
        yield "must", "statement", "on a 1.5x larger page box, PDF 150 dpi both", ours.pdf_at(150), \
            Forms(on_larger_box(statement(seed)), folder, budget).pdf_at(150)
        yield "never", "statement", "every number changed, PDF 150 dpi both", ours.pdf_at(150), theirs.pdf_at(150)
        for name in TEMPLATE_PAIRS:
            a, b = FORM_PAIRS[name]
            yield "never", "statement", f"every number changed, {name}", _form(ours, a), _form(theirs, b)
    red, green = (Forms(status_table(c), folder, budget) for c in ((1, 0, 0), (0, 0.502, 0)))
    yield "never", "status", "red dot vs green dot, PDF 150 dpi both", red.pdf_at(150), green.pdf_at(150)
    for name in ("PNG 150 dpi / PNG 300 dpi", "PDF 150 dpi / JPEG q70 150 dpi"):
        a, b = FORM_PAIRS[name]
        yield "never", "status", f"red dot vs green dot, {name}", _form(red, a), _form(green, b)
    tiff = str(solid_tiff(folder))
    settings = Render(max_pixels=budget, min_pixels=min(64 * 32 * 32, budget))
    yield "never", "solid", "two-page TIFF: solid red / solid green", \
        ingest.render(tiff, "image", 1, settings), ingest.render(tiff, "image", 2, settings)


def generated_pairs(seeds=(0, 1, 2), layouts=LAYOUTS, marks=MARKS, budget: int = BUDGETS[-1]):
    """(kind, layout, case, page a, page b) for the generated set: RenderedPages, as a run
    with render.max_pixels = `budget` renders them."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        yield from template_pairs(seeds, folder, budget)
        for kind in layouts:
            for seed in seeds:
                page = Forms(layout(kind, seed), folder, budget)
                for name, (a, b) in FORM_PAIRS.items():
                    yield "must", kind, name, _form(page, a), _form(page, b)
                # the same form on both sides: identical but for the mark
                yield "never", kind, "another document", page.pdf_at(150), \
                    Forms(layout(kind, seed + 100), folder, budget).pdf_at(150)
                for what in marks:
                    marked = Forms(mark(layout(kind, seed), what, seed), folder, budget)
                    yield "never", kind, f"{what}, PDF 150 dpi both", page.pdf_at(150), marked.pdf_at(150)
                    for name in MARK_PAIRS:
                        a, b = FORM_PAIRS[name]
                        yield "never", kind, f"{what}, {name}", _form(page, a), _form(marked, b)
