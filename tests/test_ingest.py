"""Ingest: page metadata and rendering of good, odd and broken files (no engine)."""

from __future__ import annotations

import pytest
from PIL import Image

import oddfiles
from vlbatch.job import Render
from vlbatch.pipeline import imaging, ingest

MIN, MAX = 4 * 32 * 32, 128 * 32 * 32


def render(path, page=1, dpi=72, password=None, max_pixels=MAX):
    kind = ingest.file_kind(str(path))
    settings = Render(dpi=dpi, min_pixels=MIN, max_pixels=max_pixels, pdf_password=password)
    return ingest.render(str(path), kind, page, settings)


def test_pdf_pages_sizes_and_text_layer(tmp_path):
    path = oddfiles.pdf(tmp_path / "a.pdf", pages=3)
    probe = ingest.probe(str(path), 150, None)
    assert probe.kind == "pdf" and probe.error is None
    assert [(p.page, p.width, p.height) for p in probe.pages] == [(i, 1240, 1754) for i in (1, 2, 3)]
    page = render(path, 2)
    assert "Hello page 2" in page.text_layer
    assert page.width % 32 == 0 and page.height % 32 == 0 and page.width * page.height <= MAX
    assert len(page.rgb) == page.width * page.height * 3
    assert len(page.content_hash) == 64 and len(page.phash) == 64


@pytest.mark.parametrize("chatter", ["0", "1"])
def test_mupdf_repairs_are_quiet_unless_debugging(tmp_path, chatter):
    """A page MuPDF repairs as it renders (a broken ICC profile) renders; MuPDF's messages
    are printed only with `vlbatch --debug` (a fresh process: pymupdf binds its stream at
    import)."""
    import os
    import subprocess
    import sys

    from vlbatch import LIBRARY_CHATTER_ENV

    path = oddfiles.bad_icc_pdf(tmp_path / "icc.pdf")
    code = ("import sys; from vlbatch.pipeline import ingest; from vlbatch.job import Render; "
            "assert ingest.probe(sys.argv[1], 72, None).error is None; "
            "print(ingest.render(sys.argv[1], 'pdf', 1, Render(dpi=72)).text_layer)")
    env = dict(os.environ, **{LIBRARY_CHATTER_ENV: chatter})
    done = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "broken colour profile" in done.stdout
    printed = done.stdout + done.stderr  # pymupdf writes its messages to stdout
    assert ("cmsOpenProfileFromMem" in printed) == (chatter == "1"), printed


def test_rotated_pdf_page_is_landscape(tmp_path):
    path = oddfiles.pdf(tmp_path / "r.pdf", pages=1, rotate=90)
    probe = ingest.probe(str(path), 72, None)
    assert probe.pages[0].width > probe.pages[0].height
    page = render(path)
    assert page.width > page.height


def test_huge_page_box_is_rendered_within_budget(tmp_path):
    path = oddfiles.pdf(tmp_path / "huge.pdf", pages=1, size=(14400, 14400))  # 200 x 200 inches
    page = render(path, dpi=150)
    assert page.width * page.height <= MAX


@pytest.mark.parametrize("make, reason", [
    (lambda p: oddfiles.random_bytes(p.with_suffix(".pdf")), "cannot open PDF"),
    (lambda p: oddfiles.random_bytes(p.with_suffix(".png")), "not a readable image"),
    (lambda p: oddfiles.bomb_png(p.with_suffix(".png")), "decompression bomb"),
])
def test_broken_files_give_a_reason(tmp_path, make, reason):
    path = make(tmp_path / "bad.pdf")
    probe = ingest.probe(str(path), 150, None)
    assert reason in probe.error and probe.pages == []


def test_a_large_format_scan_is_taken_and_the_bomb_limit_is_a_setting(tmp_path):
    from PIL import Image

    path = tmp_path / "scan.png"
    Image.new("1", (12000, 9000)).save(path, optimize=True)  # 108 MP, Pillow refuses it
    assert ingest.probe(str(path), 150, None).error is None
    strict = ingest.probe(str(path), 150, None, max_megapixels=50)
    assert "render.max_image_megapixels (50)" in strict.error
    page = ingest.render(str(path), "image", 1, Render(max_pixels=MAX))
    assert page.width * page.height <= MAX


def test_pdf_without_its_xref_table_is_repaired(tmp_path):
    """MuPDF rebuilds a PDF cut short just before its xref table: every page renders."""
    whole = oddfiles.pdf(tmp_path / "whole.pdf", pages=2).read_bytes()
    path = tmp_path / "cut.pdf"
    path.write_bytes(whole[:whole.rindex(b"xref")])
    probe = ingest.probe(str(path), 72, None)
    assert probe.error is None and [p.page for p in probe.pages] == [1, 2]
    assert "Hello page 2" in render(path, 2).text_layer


def test_truncated_pdf_is_reported(tmp_path):
    """A PDF cut to a third of its bytes cannot be opened: the reason says so."""
    probe = ingest.probe(str(oddfiles.truncated_pdf(tmp_path / "t.pdf")), 72, None)
    assert probe.pages == [] and probe.error.startswith("cannot open PDF")


def test_zero_page_pdf_is_an_error(tmp_path):
    probe = ingest.probe(str(oddfiles.zero_page_pdf(tmp_path / "z.pdf")), 150, None)
    assert probe.error is not None and probe.pages == []


def test_encrypted_pdf_with_and_without_password(tmp_path):
    path = oddfiles.pdf(tmp_path / "e.pdf", pages=2, encrypt_password="s3cret")
    assert "encrypted" in ingest.probe(str(path), 72, None).error
    assert "password given does not open it" in ingest.probe(str(path), 72, "wrong").error
    probe = ingest.probe(str(path), 72, "s3cret")
    assert probe.error is None and len(probe.pages) == 2
    assert "Hello page 1" in render(path, 1, password="s3cret").text_layer


def test_truncated_png_is_reported_and_fails_to_render(tmp_path):
    """Cut in half: the probe already says so (reading its metadata hits the cut), and a
    render of it raises with the same reason."""
    path = oddfiles.truncated_png(tmp_path / "t.png")
    probe = ingest.probe(str(path), 72, None)
    assert probe.pages == [] and "image file is truncated" in probe.error
    with pytest.raises(OSError, match="truncated"):
        render(path)


def test_cmyk_becomes_rgb(tmp_path):
    page = render(oddfiles.cmyk_jpeg(tmp_path / "c.jpg"))
    r, g, b = page.image().getpixel((10, 10))
    assert r > 200 and g < 60 and b < 60


def test_exif_orientation_applied(tmp_path):
    path = oddfiles.exif_rotated_jpeg(tmp_path / "x.jpg")
    size = ingest.probe(str(path), 72, None).pages[0]
    assert (size.width, size.height) == (200, 400)
    page = render(path)
    assert page.height > page.width
    assert page.image().getpixel((page.width // 2, 5))[0] < 60  # the band is now on top


def test_multiframe_tiff_every_frame_is_a_page(tmp_path):
    path = oddfiles.multi_tiff(tmp_path / "m.tiff", frames=3)
    probe = ingest.probe(str(path), 72, None)
    assert [p.page for p in probe.pages] == [1, 2, 3]
    hashes = {render(path, i).content_hash for i in (1, 2, 3)}
    assert len(hashes) == 3


def test_animated_gif_first_frame_only(tmp_path):
    probe = ingest.probe(str(oddfiles.animated_gif(tmp_path / "a.gif")), 72, None)
    assert len(probe.pages) == 1


def test_alpha_composited_over_white(tmp_path):
    page = render(oddfiles.alpha_png(tmp_path / "a.png"))
    assert page.image().getpixel((5, 5)) == (255, 255, 255)


def test_sixteen_bit_image(tmp_path):
    page = render(oddfiles.sixteen_bit_png(tmp_path / "s.png"))
    assert page.image().mode == "RGB" and page.width > 0


def test_smart_resize_matches_qwen_rules():
    assert imaging.smart_resize(1754, 1240, MIN, 1280 * 32 * 32) == (1344, 960)
    h, w = imaging.smart_resize(100, 100, 64 * 32 * 32, 1280 * 32 * 32)
    assert h * w >= 64 * 32 * 32 and h % 32 == 0 and w % 32 == 0
    with pytest.raises(imaging.PageImageError):
        imaging.smart_resize(10, 5000, MIN, MAX)


def test_content_hash_exact_and_phash_near(tmp_path):
    """One changed pixel changes the content hash; the perceptual hash barely moves for
    it and for a JPEG re-encoding, and moves far for another page."""
    import io

    from vlbatch.pipeline.dedupe import hamming

    a = render(oddfiles.pdf(tmp_path / "a.pdf", pages=1)).image()
    b = a.copy()
    b.putpixel((3, 3), (0, 0, 0))
    assert imaging.content_hash(a) == imaging.content_hash(a.copy())
    assert imaging.content_hash(a) != imaging.content_hash(b)
    buf = io.BytesIO()
    a.save(buf, "JPEG", quality=70)
    jpeg = Image.open(buf).convert("RGB")
    other = render(oddfiles.cmyk_jpeg(tmp_path / "c.jpg")).image()
    ph = {name: imaging.perceptual_hash(im) for name, im in
          (("a", a), ("b", b), ("jpeg", jpeg), ("other", other))}
    assert all(len(h) == 64 for h in ph.values())  # 256 bits, hex
    assert hamming(ph["a"], ph["b"]) <= 4 and hamming(ph["a"], ph["jpeg"]) <= 12
    assert hamming(ph["a"], ph["other"]) > 60


def test_a_pdf_mupdf_reads_as_empty_is_probed_and_drawn_by_pdfium(tmp_path):
    path = oddfiles.wrong_page_count_pdf(tmp_path / "count0.pdf")
    import pymupdf

    assert pymupdf.open(path).page_count == 0  # what MuPDF makes of it
    probe = ingest.probe(str(path), 72, None)
    assert probe.error is None and probe.kind == "pdf-pdfium" and len(probe.pages) == 1
    page = ingest.render(str(path), probe.kind, 1, Render(dpi=72, max_pixels=MAX))
    assert "Drawn by PDFium" in page.text_layer and page.width * page.height <= MAX
    ink = Image.frombytes("RGB", (page.width, page.height), page.rgb).convert("L")
    assert ink.getextrema()[0] < 100  # the text is drawn, not a blank page


def test_a_pdf_neither_renderer_reads_names_both_reasons(tmp_path):
    probe = ingest.probe(str(oddfiles.truncated_pdf(tmp_path / "t.pdf")), 72, None)
    assert probe.error.startswith("cannot open PDF") and "; PDFium: " in probe.error
