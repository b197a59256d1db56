"""Generate benchmark documents: A4 PDFs whose pages all differ (text, a table and a unique
pattern), so no dedupe or cache can merge them.

    python scripts/make_pages.py OUT_DIR PAGES [PAGES_PER_PDF]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pymupdf

WORDS = ("invoice total amount net tax date customer supplier order number quantity unit "
         "price description delivery address payment terms account reference due").split()


def make_pdf(path: Path, first_page: int, pages: int) -> None:
    doc = pymupdf.open()
    for n in range(first_page, first_page + pages):
        rng = random.Random(n)
        page = doc.new_page(width=595, height=842)
        page.insert_text((56, 70), f"Document page {n}", fontsize=18, fontname="hebo")
        text = " ".join(rng.choice(WORDS) for _ in range(160))
        page.insert_textbox(pymupdf.Rect(56, 90, 540, 330), text, fontsize=10)
        for r in range(12):  # a table with page-specific numbers
            for c in range(4):
                rect = pymupdf.Rect(56 + c * 120, 350 + r * 20, 176 + c * 120, 370 + r * 20)
                page.draw_rect(rect, color=(0, 0, 0), width=0.5)
                page.insert_text((rect.x0 + 4, rect.y1 - 6), f"{rng.randint(0, 99999)}", fontsize=9)
        for _ in range(30):  # a unique pattern of marks
            x, y = rng.uniform(56, 520), rng.uniform(620, 800)
            page.draw_circle((x, y), rng.uniform(2, 9), color=(rng.random(), 0.2, 0.5), fill=(0.9, 0.9, rng.random()))
    doc.save(path, deflate=True)


def _make(args: tuple[Path, int, int]) -> Path:
    make_pdf(*args)
    return args[0]


def main(out: Path, pages: int, per_pdf: int = 10) -> list[Path]:
    """Write the PDFs in parallel (one process per core); returns their paths in order."""
    from concurrent.futures import ProcessPoolExecutor

    out.mkdir(parents=True, exist_ok=True)
    jobs = [(out / f"doc-{i:05d}.pdf", first, min(per_pdf, pages - first))
            for i, first in enumerate(range(0, pages, per_pdf))]
    with ProcessPoolExecutor() as pool:
        return list(pool.map(_make, jobs, chunksize=4))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 10)
