"""pixelcheck: are two pages, found alike by perceptual hash, the same page?

Both pages are compared as the dedupe sees them (`RenderedPage.comparison`: the page fitted
to imaging.COMPARE_PIXELS where the model's budget is smaller, so a field that the model's
small image blurs still counts), in colour and in grey, at one size (`PagePair`: the smaller
one's, at most 1344 pixels on its long side):
- ink on blank paper: what one page has where the other is blank (a tick, a signature, a
  stamp, a speck, a watermark) stands out fully, while a re-render at another resolution
  only moves edges by under a pixel, next to ink;
- ink shift: a line struck through text darkens its areas together;
- local differences: resampling and JPEG noise is spread over every glyph; a change in one
  place (a digit) stands out above the rest, in 8x8 blocks and in 4x4 ones (a point become a
  comma on two noisy scans stands out only in the smaller);
- absolute bounds: the 20th largest block difference (a change spread over the page, many
  fields at once, passes every relative rule) and the largest difference of colour alone
  (a red dot against a green one of the same grey).
A wrong merge gives one document's answer to another, so the thresholds err on the side of
not merging; a PDF's own layers count only against a merge: a different text layer, or
different drawings (`ingest.drawings_digest`).
Figures: scripts/bench_dedupe.py, docs/benchmarks.md.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
from PIL import Image, ImageFilter

from vlbatch.pipeline import imaging

BLOCK = 8  # pixels (at the comparison size)
FINE_BLOCK = 4  # the local rule again at this size: a mark of a few pixels beside a glyph (a
# comma's tail where the other page has a point) in scan noise, which an 8x8 mean dilutes
RANK = 20  # the peak is compared with the RANK-th largest block difference
NOISE_FLOOR = 1.0  # a peak below this (0-255) is noise whatever the ratio
PAPER_FLAT = 24  # levels (0-255): a 3x3 neighbourhood this even is blank paper


def _at(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    image = image.convert("RGB")
    return image if image.size == size else image.resize(size, Image.Resampling.BOX)


def _comparison_size(a: Image.Image, b: Image.Image) -> tuple[int, int] | None:
    """The size both pages are compared at (the smaller one's, at most imaging.COMPARE_LONG_SIDE);
    None when their aspect ratios differ."""
    ratio_a, ratio_b = a.width / a.height, b.width / b.height
    if abs(ratio_a - ratio_b) / max(ratio_a, ratio_b) > 0.02:
        return None
    smaller = a if a.width * a.height <= b.width * b.height else b
    scale = min(1.0, imaging.COMPARE_LONG_SIDE / max(smaller.size))
    return (max(4 * BLOCK, round(smaller.width * scale)), max(4 * BLOCK, round(smaller.height * scale)))


def _block_means(values: np.ndarray, block: int = BLOCK) -> np.ndarray:
    h, w = (values.shape[0] // block) * block, (values.shape[1] // block) * block
    return values[:h, :w].reshape(h // block, block, w // block, block).mean(axis=(1, 3))


def _neighbourhood(pixels: np.ndarray, pick) -> np.ndarray:
    """The min (pick=np.minimum) or max of each pixel's 3x3 neighbourhood."""
    padded = np.pad(pixels, 1, mode="edge")
    rows = pick(pick(padded[:-2], padded[1:-1]), padded[2:])
    return pick(pick(rows[:, :-2], rows[:, 1:-1]), rows[:, 2:])


def _marks_on_blank(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How far each pixel of `a` lies outside the range of `b` around it, counted only
    where `b` is blank there (its 3x3 neighbourhood within PAPER_FLAT levels): ink that
    `a` has on paper that `b` leaves empty. A re-render moves edges by under a pixel, which
    stays within b's range beside its ink; a tick, a signature, a stamp, a speck or a
    watermark on paper does not. (int16 arrays.)"""
    low, high = _neighbourhood(b, np.minimum), _neighbourhood(b, np.maximum)
    outside = np.maximum(np.maximum(low - a, a - high), 0)
    outside[high - low > PAPER_FLAT] = 0
    return outside


def _stand_out(values: np.ndarray) -> tuple[float, float]:
    """(largest, largest over the RANK-th largest); ratio 1 below the noise floor."""
    values = np.sort(values.ravel())
    peak = float(values[-1])
    if peak < NOISE_FLOOR:  # identical but for noise: nothing stands out
        return peak, 1.0
    return peak, peak / max(float(values[-min(RANK, values.size)]), 1e-3)


class PagePair:
    """Two pages in grey at the size they are compared at (the smaller one's, at most
    COMPARE_LONG_SIDE) and the pixel check's measures of them. Every measure is inf
    when their aspect ratios differ."""

    def __init__(self, a: Image.Image, b: Image.Image):
        self.size = _comparison_size(a, b)
        if self.size is not None:
            self.colours = (_at(a, self.size), _at(b, self.size))
            self.greys = tuple(colour.convert("L") for colour in self.colours)
            self.arrays = tuple(np.asarray(grey, np.int16) for grey in self.greys)

    def blank_marks(self) -> float:
        """The largest 8x8 block mean of what either page has where the other is blank
        (0-255): near 0 for re-renders at any resolution and re-encodings, 15 and more for
        a mark on paper."""
        if self.size is None:
            return float("inf")
        return float(_block_means(self._blank_paper_marks).max())

    def blank_dot(self) -> tuple[float, float]:
        """(largest, largest over the RANK-th largest) of the single pixels one page has where
        the other is blank paper (0-255): at a coarse resolution a line struck through a
        short label leaves one pixel on paper between its glyphs, which a block mean
        dilutes; rendering noise leaves many small ones, nothing that stands out."""
        if self.size is None:
            return float("inf"), float("inf")
        return _stand_out(self._blank_paper_marks)

    @cached_property
    def _blank_paper_marks(self) -> np.ndarray:
        """What either page has where the other is blank paper, per pixel (both measures
        above read it)."""
        a, b = self.arrays
        return np.maximum(_marks_on_blank(a, b), _marks_on_blank(b, a))

    def ink_shift(self) -> float:
        """How far the most changed 16x16 area's ink (its mean level, signed: resampling
        keeps it, JPEG keeps it) stands out above the RANK-th: a line added across a few
        words darkens its areas together, rendering noise moves ink within them. Areas
        overlap by half a side."""
        if self.size is None:
            return float("inf")
        half = _block_means((self.arrays[0] - self.arrays[1]).astype(np.float32))  # signed, 8x8
        return _stand_out(np.abs(half[:-1, :-1] + half[1:, :-1] + half[:-1, 1:] + half[1:, 1:]) / 4)[1]

    def block_difference(self) -> tuple[float, float]:
        """(peak, peak ratio) of the block differences, both pages lightly blurred: peak is
        the largest 8x8 block's mean absolute difference (0-255), the ratio that over the
        RANK-th largest. Rendering and compression noise spreads over every block with ink
        (ratio near 1-2); a change of content in one place stands out in a few blocks."""
        if self.size is None:
            return float("inf"), float("inf")
        return _stand_out(self._block_differences)

    def fine_block_difference(self) -> tuple[float, float]:
        """block_difference at FINE_BLOCK pixels: a change of a few pixels beside ink (a
        point become a comma) on two noisy scans, where an 8x8 block's mean dilutes it below
        the noise of the other blocks; re-renders and re-encodings stand out no more here
        than at 8x8 (scripts/bench_dedupe.py)."""
        if self.size is None:
            return float("inf"), float("inf")
        # less blur: the mark is a few pixels
        return _stand_out(_block_means(self._blurred_difference(0.7), FINE_BLOCK))

    @cached_property
    def _block_differences(self) -> np.ndarray:
        return _block_means(self._blurred_difference(1.0))

    def _blurred_difference(self, radius: float) -> np.ndarray:
        """|a - b| per pixel, both pages in grey blurred by `radius`."""
        blurred = [np.asarray(grey.filter(ImageFilter.GaussianBlur(radius)), np.float32)
                   for grey in self.greys]
        return np.abs(blurred[0] - blurred[1])


    def colour_difference(self) -> float:
        """The largest 8x8 block difference of colour alone (|Cb| + |Cr| of YCbCr, both
        pages lightly blurred), 0-510: what grey levels cannot see, a red dot where the
        other page has a green one of the same grey, a page in another colour. Absolute:
        re-renders and JPEG keep colour within a few levels everywhere."""
        if self.size is None:
            return float("inf")
        chroma = [np.asarray(colour.filter(ImageFilter.GaussianBlur(1.0)).convert("YCbCr"),
                             np.float32)[:, :, 1:] for colour in self.colours]
        return float(_block_means(np.abs(chroma[0] - chroma[1]).sum(axis=2)).max())

    def grey_difference(self) -> float:
        """The RANK-th largest 8x8 block difference of grey (blurred as block_difference):
        an absolute bound beside the relative rules, for changes spread over the page (many
        fields of one template, another page of similar layout), where no block stands out
        above the others because many changed."""
        if self.size is None:
            return float("inf")
        values = np.sort(self._block_differences.ravel())
        return float(values[-min(RANK, values.size)])


def words(text: str | None) -> str:
    return " ".join((text or "").split())


def same_page(a: Image.Image, b: Image.Image, text_a: str | None, text_b: str | None,
              settings, drawings_a: str | None = None, drawings_b: str | None = None) -> bool:
    """The pixel check, whatever the text layers say (an equal text layer says nothing of
    ticks, stamps and drawings; a different one does rule a merge out, as do two PDF pages
    whose drawings differ: `ingest.drawings_digest`):
    - nothing on blank paper in one page that the other lacks (`PagePair.blank_marks`),
      not even one dark pixel standing out of the noise (`PagePair.blank_dot`),
    - no area whose ink level changed more than the rest's (`PagePair.ink_shift`), and
    - no region that stands out from the rest: the largest block difference at most
      `max_peak_ratio` times the RANK-th, of 8x8 blocks and of 4x4 ones (re-rendering noise
      is spread over every glyph, a change in one place is not),
    - and absolute bounds anywhere on the page: the largest block difference at most
      `max_block_diff`, the RANK-th largest at most `max_spread_diff`, the largest
      difference of colour alone at most `max_colour_diff`."""
    if words(text_a) and words(text_b) and words(text_a) != words(text_b):
        return False
    if drawings_a is not None and drawings_b is not None and drawings_a != drawings_b:
        return False
    pair = PagePair(a, b)  # the measures cheapest to compute and likeliest to refuse first
    peak, ratio = pair.block_difference()
    if peak > settings.max_block_diff or ratio > settings.max_peak_ratio:
        return False
    if pair.fine_block_difference()[1] > settings.max_peak_ratio:
        return False
    if pair.grey_difference() > settings.max_spread_diff:
        return False
    if pair.blank_marks() > settings.max_blank_mark:
        return False
    dot, dot_ratio = pair.blank_dot()
    if dot > settings.max_blank_dot and dot_ratio > settings.max_blank_dot_ratio:
        return False
    if pair.ink_shift() > settings.max_ink_shift_ratio:
        return False
    return pair.colour_difference() <= settings.max_colour_diff


