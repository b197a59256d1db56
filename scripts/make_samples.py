"""Write the demo documents in data/samples/ (deterministic; a few hundred KB in all).

    python scripts/make_samples.py [OUT_DIR]

- report.pdf: three pages with text and a table (a text layer PyMuPDF can extract)
- scan.jpg: a scanned-looking page (grey, speckled, slightly skewed)
- receipt.png: a small receipt
- chart.jpg: a bar chart
- receipt-copy.png: the same page as receipt.png again (a duplicate the run merges)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pymupdf
from PIL import Image, ImageDraw, ImageFilter

A4 = (595, 842)  # points


def _table(page: pymupdf.Page, top: float, rows: list[list[str]]) -> None:
    left, col_w, row_h = 72, 150, 22
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            rect = pymupdf.Rect(left + c * col_w, top + r * row_h,
                                left + (c + 1) * col_w, top + (r + 1) * row_h)
            page.draw_rect(rect, color=(0, 0, 0), width=0.7)
            page.insert_text((rect.x0 + 5, rect.y1 - 7), cell, fontsize=10,
                             fontname="hebo" if r == 0 else "helv")


def make_report(path: Path) -> None:
    doc = pymupdf.open()
    for number in range(1, 4):
        page = doc.new_page(width=A4[0], height=A4[1])
        page.insert_text((72, 90), f"Quarterly report - section {number}", fontsize=20, fontname="hebo")
        body = (f"This is page {number} of the vlbatch sample report. It has a text layer, "
                "so a task may quote it with the {text_layer} placeholder.")
        page.insert_textbox(pymupdf.Rect(72, 110, 523, 200), body, fontsize=11)
        rows = [["Region", "Units", "Revenue"]] + [
            [name, str(100 * number + i * 7), f"{(100 * number + i * 7) * 12.5:,.2f}"]
            for i, name in enumerate(["North", "South", "East", "West"])]
        _table(page, 220, rows)
        page.insert_text((72, 800), f"page {number}", fontsize=9)
    doc.save(path, garbage=4, deflate=True)


def make_receipt(path: Path) -> None:
    image = Image.new("RGB", (360, 560), "white")
    draw = ImageDraw.Draw(image)
    draw.text((110, 20), "CORNER SHOP", fill="black")
    lines = [("Bread", "2.40"), ("Milk", "1.10"), ("Apples 1kg", "3.25"), ("Coffee", "6.90")]
    for i, (item, price) in enumerate(lines):
        draw.text((30, 80 + 30 * i), item, fill="black")
        draw.text((280, 80 + 30 * i), price, fill="black")
    draw.line((30, 220, 330, 220), fill="black")
    draw.text((30, 235), "TOTAL", fill="black")
    draw.text((280, 235), "13.65", fill="black")
    draw.text((30, 500), "Receipt 0042  2026-11-30", fill="gray")
    image.save(path, optimize=True)


def make_chart(path: Path) -> None:
    image = Image.new("RGB", (640, 420), (250, 250, 245))
    draw = ImageDraw.Draw(image)
    draw.text((230, 15), "Units sold per region", fill="black")
    for i, (name, value) in enumerate([("North", 240), ("South", 180), ("East", 300), ("West", 120)]):
        x = 80 + i * 130
        draw.rectangle((x, 380 - value, x + 80, 380), fill=(60 + 40 * i, 110, 200 - 30 * i))
        draw.text((x + 20, 390), name, fill="black")
    draw.line((60, 380, 600, 380), fill="black", width=2)
    image.save(path, quality=88)


def make_scan(path: Path, pdf: Path) -> None:
    with pymupdf.open(pdf) as doc:
        pix = doc[1].get_pixmap(dpi=90, colorspace=pymupdf.csGRAY)
    grey = np.frombuffer(pix.samples, dtype=np.uint8).reshape(pix.height, pix.width).astype(np.int16)
    noise = np.random.RandomState(0).normal(0, 12, grey.shape)
    speckled = np.clip(grey * 0.92 + 10 + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(speckled, "L").rotate(0.8, fillcolor=235, expand=False)
    image.filter(ImageFilter.GaussianBlur(0.6)).save(path, quality=70)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    make_report(out / "report.pdf")
    make_scan(out / "scan.jpg", out / "report.pdf")
    make_receipt(out / "receipt.png")
    make_chart(out / "chart.jpg")
    shutil.copyfile(out / "receipt.png", out / "receipt-copy.png")
    for p in sorted(out.iterdir()):
        print(f"{p}  {p.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "data" / "samples")
