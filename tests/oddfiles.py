"""Generators of odd and broken input files, for the ingest tests."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pymupdf
from PIL import Image


def pdf(path: Path, pages: int = 2, size=(595, 842), rotate: int = 0, text: str = "Hello page",
        encrypt_password: str | None = None) -> Path:
    doc = pymupdf.open()
    for i in range(pages):
        page = doc.new_page(width=size[0], height=size[1])
        page.insert_text((50, 72), f"{text} {i + 1}", fontsize=14)
        if rotate:
            page.set_rotation(rotate)
    kwargs = {}
    if encrypt_password:
        kwargs = dict(encryption=pymupdf.PDF_ENCRYPT_AES_256, user_pw=encrypt_password,
                      owner_pw=encrypt_password + "-owner")
    doc.save(path, **kwargs)
    return path


def truncated_pdf(path: Path) -> Path:
    data = pdf(path).read_bytes()
    path.write_bytes(data[: len(data) // 3])
    return path


def zero_page_pdf(path: Path) -> Path:
    path.write_bytes(b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n"
                     b"2 0 obj<</Type/Pages/Kids[]/Count 0>>endobj\n"
                     b"trailer<</Root 1 0 R>>\n%%EOF\n")
    return path


def wrong_page_count_pdf(path: Path, text: str = "Drawn by PDFium") -> Path:
    """A one-page PDF whose page tree says /Count 0: MuPDF reads no pages, PDFium finds the
    page (a damage seen in public PDF test suites)."""
    import re

    doc = pymupdf.open()
    doc.new_page().insert_text((72, 72), text, fontsize=24)
    data = doc.tobytes(garbage=0, deflate=False)
    path.write_bytes(re.sub(rb"/Count \d+", b"/Count 0", data))
    return path


def random_bytes(path: Path, n: int = 4096) -> Path:
    path.write_bytes(np.random.RandomState(1).bytes(n))
    return path


def png(path: Path, size=(300, 400), mode="RGB", color=(200, 30, 30)) -> Path:
    Image.new(mode, size, color if mode == "RGB" else None).save(path)
    return path


def truncated_png(path: Path) -> Path:
    buf = io.BytesIO()
    noise = np.random.RandomState(2).randint(0, 255, (300, 300, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buf, "PNG")
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    return path


def bomb_png(path: Path) -> Path:
    """A small file that claims 20000 x 20000 pixels (above Pillow's bomb limit)."""
    Image.new("1", (20000, 20000)).save(path, optimize=True)
    return path


def cmyk_jpeg(path: Path) -> Path:
    Image.new("CMYK", (200, 300), (0, 255, 255, 0)).save(path, "JPEG")  # red in CMYK
    return path


def exif_rotated_jpeg(path: Path) -> Path:
    """Stored 400 wide x 200 high, EXIF orientation 6: shown 200 wide x 400 high."""
    image = Image.new("RGB", (400, 200), "white")
    image.paste((0, 0, 0), (0, 0, 100, 200))  # black band on the stored left
    exif = Image.Exif()
    exif[0x0112] = 6
    image.save(path, "JPEG", exif=exif.tobytes())
    return path


def multi_tiff(path: Path, frames: int = 3) -> Path:
    images = [Image.new("RGB", (200 + 10 * i, 300), (40 * i, 80, 120)) for i in range(frames)]
    images[0].save(path, save_all=True, append_images=images[1:])
    return path


def alpha_png(path: Path) -> Path:
    Image.new("RGBA", (100, 100), (255, 0, 0, 0)).save(path)  # fully transparent red
    return path


def sixteen_bit_png(path: Path) -> Path:
    values = (np.arange(200 * 100, dtype=np.uint32).reshape(100, 200) * 3 % 65535).astype(np.uint16)
    Image.fromarray(values).save(path)  # uint16: mode I;16
    return path


def animated_gif(path: Path) -> Path:
    frames = [Image.new("P", (120, 80), i) for i in range(3)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    return path


def degenerate_box_pdf(path: Path) -> Path:
    """Page 1 has a sliver of a page box (595 x 0.2 points); page 2 is A4."""
    path.write_bytes(b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n"
                     b"2 0 obj<</Type/Pages/Kids[3 0 R 4 0 R]/Count 2>>endobj\n"
                     b"3 0 obj<</Type/Page/Parent 2 0 R/MediaBox[0 0 595 0.2]>>endobj\n"
                     b"4 0 obj<</Type/Page/Parent 2 0 R/MediaBox[0 0 595 842]>>endobj\n"
                     b"trailer<</Root 1 0 R>>\n%%EOF\n")
    return path


def bad_icc_pdf(path: Path) -> Path:
    """One page with text over an image whose ICC profile is garbage: MuPDF renders it (in
    the default colour space) and prints 'MuPDF error: ... cmsOpenProfileFromMem failed'."""
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(buffer, "PNG")
    doc = pymupdf.open()
    page = doc.new_page()
    page.insert_image(page.rect, stream=buffer.getvalue())
    page.insert_text((50, 50), "a page with a broken colour profile")
    profile = doc.get_new_xref()
    doc.update_object(profile, "<< /N 3 >>")
    doc.update_stream(profile, b"not an ICC profile " * 8)
    doc.xref_set_key(page.get_images()[0][0], "ColorSpace", f"[/ICCBased {profile} 0 R]")
    doc.save(path)
    return path
