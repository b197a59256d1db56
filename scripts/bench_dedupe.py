"""Dedupe precision and recall on two generated sets, at the job's default thresholds:

- invoices (below): pairs that must merge (re-renders at other DPIs, JPEG re-encodings at
  quality 70-95, PNG vs JPEG), should merge (light scan-like noise) and must never merge
  (one template with one field changed; different pages of one document);
- five layouts in several forms with local marks that keep the text layer (dedupe_set.py):
  re-renders and raster files at other resolutions must merge; a tick, signature, stamp,
  struck-through line, watermark or speck must never.

Prints the pHash distance, the blank-paper marks and the block differences of every pair,
and the decisions; the summary counts merges by case.

    python scripts/bench_dedupe.py [--json OUT] [--seeds 3] [--first-seed 0]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np
import pymupdf
from PIL import Image, ImageFilter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vlbatch.job import Dedupe  # noqa: E402
from vlbatch.pipeline import imaging  # noqa: E402
import dedupe_set  # noqa: E402

from vlbatch.pipeline.dedupe import hamming  # noqa: E402
from vlbatch.pipeline.pixelcheck import PagePair, same_page  # noqa: E402

MIN, MAX = 64 * 32 * 32, 1280 * 32 * 32
DOCUMENTS = [("INV-2026-00417", "2026-11-30", "Jane Smith", "1,204.50 EUR"),
             ("INV-2025-93810", "2025-02-03", "Okonkwo Trading", "88.00 USD"),
             ("PO-7741", "2026-06-15", "Li Wei", "15,870.25 CNY")]


def invoice(number: str, date: str, name: str, amount: str, page_no: int = 1,
            price: str = "12.50") -> bytes:
    doc = pymupdf.open()
    page = doc.new_page(width=595, height=842)
    page.insert_text((56, 70), "ACME Supplies Ltd - INVOICE", fontsize=18, fontname="hebo")
    page.insert_text((56, 110), f"Invoice number: {number}", fontsize=11)
    page.insert_text((56, 128), f"Date: {date}", fontsize=11)
    page.insert_text((56, 146), f"Bill to: {name}", fontsize=11)
    for r in range(8):
        for c, text in enumerate(["Widget", "2", price if r == 3 else "12.50", "25.00"]):
            rect = pymupdf.Rect(56 + c * 120, 200 + r * 20, 176 + c * 120, 220 + r * 20)
            page.draw_rect(rect, color=(0, 0, 0), width=0.5)
            page.insert_text((rect.x0 + 4, rect.y1 - 6), text, fontsize=9)
    page.insert_text((56, 400), f"Total due: {amount}", fontsize=12, fontname="hebo")
    page.insert_text((56, 780), f"Page {page_no} of 3 - payment within 30 days", fontsize=8)
    return doc.tobytes()


class Page:
    """A page as the dedupe sees it: the fitted image and its text layer (PDFs only)."""

    def __init__(self, image: Image.Image, text: str | None):
        self.image, self.text = image, text


def render(pdf: bytes, dpi: int) -> Page:
    with pymupdf.open(stream=pdf, filetype="pdf") as doc:
        pix = doc[0].get_pixmap(dpi=dpi, colorspace=pymupdf.csRGB, alpha=False)
        text = doc[0].get_text("text")
    image = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
    return Page(imaging.fit_to_budget(image, MIN, MAX), text)


def jpeg(page: Page, quality: int) -> Page:
    buf = io.BytesIO()
    page.image.save(buf, "JPEG", quality=quality)
    image = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    return Page(imaging.fit_to_budget(image, MIN, MAX), None)  # an image file: no text layer


def scan_noise(page: Page, sigma: float, seed: int) -> Page:
    image = page.image
    noise = np.random.RandomState(seed).normal(0, sigma, (image.height, image.width, 1))
    noisy = np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    return Page(Image.fromarray(noisy).filter(ImageFilter.GaussianBlur(0.5)), None)


def scanned(pdf: bytes, dpi: int, sigma: float, seed: int) -> Page:
    """The page as a scan saved as JPEG: rendered, its own noise, blurred, quality 70."""
    return jpeg(scan_noise(Page(render(pdf, dpi).image, None), sigma, seed), 70)


def pairs(base_fields=("INV-2026-00417", "2026-11-30", "Jane Smith", "1,204.50 EUR")):
    variants = [
        ("number digit", ("INV-2026-00411", *base_fields[1:])),
        ("date", (base_fields[0], "2026-11-20", *base_fields[2:])),
        ("name", (*base_fields[:2], "Jane Smyth", base_fields[3])),
        ("amount", (*base_fields[:3], "1,204.80 EUR")),
    ]
    base_pdf = invoice(*base_fields)
    base = render(base_pdf, 150)
    must = [(f"re-render {dpi} dpi", render(base_pdf, dpi)) for dpi in (100, 120, 200, 300)]
    must += [(f"JPEG q{q}", jpeg(base, q)) for q in (70, 80, 90, 95)]
    should = [(f"scan noise sigma {s}", scan_noise(base, s, i)) for i, s in enumerate((3, 6, 10))]
    # an image of the page rasterised elsewhere (300 dpi, JPEG): no text layer to confirm it
    should += [("JPEG of a 300-dpi raster vs the PDF", jpeg(render(base_pdf, 300), 85))]
    never = [(f"one field changed: {what}", render(invoice(*fields), 150)) for what, fields in variants]
    never += [(f"one field changed: {what}, JPEG q80", jpeg(render(invoice(*fields), 150), 80))
              for what, fields in variants]
    never += [(f"one field changed: {what}, rendered at {dpi} dpi", render(invoice(*fields), dpi))
              for what, fields in variants for dpi in (100, 200)]
    comma = (base_fields[0], base_fields[1], base_fields[2], base_fields[3].replace(".", ",", 1))
    never += [("decimal point became a comma", render(invoice(*comma), 150)),
              ("decimal point became a comma, JPEG q90", jpeg(render(invoice(*comma), 150), 90))]
    # two scans with their own noise, saved as JPEG: a 9-point price's point become a comma
    # is a few pixels beside a glyph, which an 8x8 block's mean dilutes below the noise
    comma_price = invoice(*base_fields, price="12,50")
    scans = [(s, dpi, seed) for s in (3, 5, 7) for dpi in (100, 150) for seed in (0, 1)]
    never_scans = [(f"a price's point became a comma, both scanned (noise {s}, {dpi} dpi, "
                    f"JPEG q70, seed {seed})", scanned(base_pdf, dpi, s, 10 + seed),
                    scanned(comma_price, dpi, s, 20 + seed)) for s, dpi, seed in scans]
    should_scans = [(f"two scans of the page (noise {s}, {dpi} dpi, JPEG q70, seed {seed})",
                     scanned(base_pdf, dpi, s, 10 + seed), scanned(base_pdf, dpi, s, 20 + seed))
                    for s, dpi, seed in scans]
    never += [(f"another page of the document (page {n})", render(invoice(*base_fields, page_no=n), 150))
              for n in (2, 3)]
    cases = [("must", name, base, p) for name, p in must]
    png300 = render(base_pdf, 300)
    png300 = Page(png300.image, None)  # saved as a PNG file: no text layer
    cases += [("must", "PNG vs JPEG q85 of the same 300-dpi raster", png300, jpeg(png300, 85))]
    cases += [("should", name, base, p) for name, p in should]
    cases += [("never", name, base, p) for name, p in never]
    cases += [("should", name, a, b) for name, a, b in should_scans]
    cases += [("never", name, a, b) for name, a, b in never_scans]
    return cases


def all_pairs(seeds=(0, 1, 2), budget: int = MAX):
    """The invoice pairs above (three documents, at the comparison budget) and the generated
    set (dedupe_set.py) as a run at render.max_pixels = `budget` sees it: (comparison image,
    text layer, drawings digest, pHash of the model's image) a page."""
    for fields in DOCUMENTS:
        for kind, name, a, b in pairs(fields):
            yield kind, f"invoice {fields[0]}", name, (a.image, a.text, None, None), \
                (b.image, b.text, None, None)
    for kind, layout, name, a, b in dedupe_set.generated_pairs(seeds, budget=budget):
        yield kind, layout, name, seen(a), seen(b)


def seen(page) -> tuple:
    """A RenderedPage as the dedupe's pixel check sees it."""
    return page.comparison(), page.text_layer, page.drawings, page.phash


def decide(a, b, settings) -> dict:
    distance = hamming(a[3] or imaging.perceptual_hash(a[0]), b[3] or imaging.perceptual_hash(b[0]))
    pair = PagePair(a[0], b[0])
    (peak, ratio), marks, shift = pair.block_difference(), pair.blank_marks(), pair.ink_shift()
    colour, spread = pair.colour_difference(), pair.grey_difference()
    dot, dot_ratio = pair.blank_dot()
    pixels = same_page(a[0], b[0], None, None, settings)  # the pixel check and text layers
    merged = distance <= settings.max_phash_distance and same_page(
        a[0], b[0], a[1], b[1], settings, a[2], b[2])
    return {"phash_distance": distance, "blank_marks": round(marks, 1),
            "blank_dot": round(dot, 1), "blank_dot_ratio": round(dot_ratio, 2),
            "ink_shift": round(shift, 2), "peak": round(peak, 1),
            "peak_ratio": round(ratio, 2), "colour": round(colour, 1), "spread": round(spread, 1),
            "drawings_differ": None not in (a[2], b[2]) and a[2] != b[2],
            "pixel_check_merges": distance <= settings.max_phash_distance and pixels, "merged": merged}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds of the generated set")
    parser.add_argument("--first-seed", type=int, default=0, help="held-out sets: e.g. 6")
    parser.add_argument("--budgets", default=",".join(map(str, dedupe_set.BUDGETS)),
                        help="render.max_pixels values, comma-separated")
    args = parser.parse_args()
    settings = Dedupe()
    rows = []
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    for budget in map(int, args.budgets.split(",")):
        rows += [{"budget": budget, **row} for row in budget_rows(seeds, budget, settings)]
    summary = {"settings": settings.model_dump(),
               **{f"budget {b}": summarise([r for r in rows if r["budget"] == b])
                  for b in map(int, args.budgets.split(","))}}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "pairs": rows}, indent=1))


def budget_rows(seeds, budget: int, settings) -> list[dict]:
    rows = []
    for kind, document, name, a, b in all_pairs(seeds, budget):
        row = {"kind": kind, "document": document, "case": name, **decide(a, b, settings)}
        rows.append(row)
        print(f"{document[:22]:22} {kind:6} {name:46} phash {row['phash_distance']:3d}  "
              f"blank {row['blank_marks']:5.1f}  dot {row['blank_dot']:5.1f}/{row['blank_dot_ratio']:5.2f}  ink {row['ink_shift']:5.2f}  peak {row['peak']:5.1f}  ratio "
              f"{row['peak_ratio']:8.2f}  colour {row['colour']:5.1f}  spread {row['spread']:5.1f}  "
              f"{'MERGED' if row['merged'] else 'kept apart'}", flush=True)
    return rows


def summarise(rows: list[dict]) -> dict:
    by_case: dict[str, list] = {}
    for row in rows:
        group = row["case"].split(",")[0] if row["kind"] == "never" else row["case"]
        by_case.setdefault(f"{row['kind']}: {group}", []).append(row["merged"])
    return {"must_merge": _ratio(r["merged"] for r in rows if r["kind"] == "must"),
            "should_merge": _ratio(r["merged"] for r in rows if r["kind"] == "should"),
            "wrong_merges": _ratio(r["merged"] for r in rows if r["kind"] == "never"),
            "wrong_merges_pixel_check_alone": _ratio(
                r["pixel_check_merges"] for r in rows if r["kind"] == "never"),
            "raster_rerenders_merged": _ratio(
                r["merged"] for r in rows if r["kind"] == "must" and r["case"].startswith(("PNG", "JPEG"))),
            "merged_by_case": {case: _ratio(merged) for case, merged in sorted(by_case.items())}}


def _ratio(merged) -> str:
    merged = list(merged)
    return f"{sum(merged)}/{len(merged)}"


if __name__ == "__main__":
    main()
