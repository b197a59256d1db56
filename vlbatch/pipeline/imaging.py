"""Pixel-level helpers shared by ingest and planning: Qwen3-VL's smart resize, RGB
normalisation, and the page hashes (exact content hash and perceptual hash)."""

from __future__ import annotations

import hashlib
import math

from PIL import Image, ImageOps

# Qwen3-VL: 16-pixel patches merged 2x2, so one image token per 32x32 pixels.
COMPARE_LONG_SIDE = 1344  # pixels: the dedupe compares pages at most this large
COMPARE_PIXELS = 1280 * 32 * 32  # and fitted to at least this budget, whatever the model's
THUMB_SIDE = 64  # the thumbnail the dedupe ranks candidates by: 64x64 grey cell means
THUMB_RENDER_SIDE = 768  # pixels: the long side a PDF page is drawn at for its thumbnail
IMAGE_FACTOR = 32
MAX_ASPECT_RATIO = 200  # the model's processor refuses more extreme pages


class PageImageError(ValueError):
    """A page whose pixels the model cannot take (e.g. an extreme aspect ratio)."""


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int,
                 factor: int = IMAGE_FACTOR) -> tuple[int, int]:
    """(height, width) that Qwen3-VL's processor resizes a page to: multiples of `factor`,
    aspect ratio kept, pixel count within [min_pixels, max_pixels]."""
    if height <= 0 or width <= 0:
        raise PageImageError(f"degenerate page size {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise PageImageError(f"aspect ratio over {MAX_ASPECT_RATIO} ({width}x{height})")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """EXIF orientation applied; palette, grey, CMYK, 16-bit and alpha images become RGB
    (alpha composited over white)."""
    image = ImageOps.exif_transpose(image)
    if image.mode.startswith("I") or image.mode == "F":  # 16-bit / 32-bit grey
        import numpy as np

        values = np.asarray(image, dtype=np.float64)
        top = 65535.0 if values.max(initial=0) > 255 else 255.0
        image = Image.fromarray((np.clip(values, 0, top) * (255.0 / top)).astype(np.uint8), "L")
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB") if image.mode != "RGB" else image


def fit_to_budget(image: Image.Image, min_pixels: int, max_pixels: int) -> Image.Image:
    """Resize to the exact size the model will see, so its processor changes nothing."""
    h, w = smart_resize(image.height, image.width, min_pixels, max_pixels)
    if (w, h) == image.size:
        return image
    return image.resize((w, h), Image.Resampling.LANCZOS)


def content_hash(image: Image.Image) -> str:
    """Exact hash of the normalised pixels (size and RGB bytes)."""
    digest = hashlib.sha256(f"{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def perceptual_hash(image: Image.Image) -> str:
    """256-bit pHash (hex); finds near-duplicates, which must still be confirmed."""
    import imagehash

    return str(imagehash.phash(image, hash_size=16))


def comparison_budget(min_pixels: int, max_pixels: int) -> tuple[int, int] | None:
    """(min_pixels, max_pixels) the dedupe's view of a page is fitted to: COMPARE_PIXELS,
    where the model's budget is smaller; None where the model's image serves (the pixel
    check's thresholds are measured at this budget: scripts/bench_dedupe.py)."""
    if max_pixels >= COMPARE_PIXELS:
        return None
    return min_pixels, COMPARE_PIXELS  # min_pixels <= max_pixels < COMPARE_PIXELS


def thumbnail(image: Image.Image) -> bytes:
    """THUMB_SIDE x THUMB_SIDE grey cell means (bytes): re-renders and re-encodings of a page
    give nearly the same, pages of one template that differ in a field do not, so the dedupe
    ranks its candidates by it before any pixel check."""
    return image.convert("L").resize((THUMB_SIDE, THUMB_SIDE), Image.Resampling.BOX).tobytes()
