"""dedupe: which earlier page, if any, a page is a copy of.

Exact copies (the same normalised pixels, so the same content hash) always merge. A
perceptual hash finds near-copies (re-renders at another DPI, JPEG re-encodings, PNG vs
JPEG), but it cannot tell them from pages of one template that differ in a single field:
those hash alike too. So every near-copy is confirmed at pixel level before it merges, on
three measures, both pages at one size (`PagePair`, `same_page`):
- ink on blank paper: what one page has where the other is blank (a tick, a signature, a
  stamp, a speck, a watermark) stands out fully, while a re-render at another resolution
  only moves edges by under a pixel, next to ink;
- ink shift: a line struck through text darkens its areas together;
- local differences: resampling and JPEG noise is spread over every glyph; a change in one
  place (a digit) stands out above the rest.
A wrong merge gives one document's answer to another, so the thresholds err on the side of
not merging; a PDF's own layers count only against a merge: a different text layer, or
different drawings (`ingest.drawings_digest`: a strike through a short label at 100 dpi
leaves about one pixel on paper, below what the pixel check can tell from rendering noise,
but it is one more path in the PDF).
Figures: scripts/bench_dedupe.py, docs/benchmarks.md.
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal

import numpy as np
from cachetools import LRUCache
from PIL import Image, ImageFilter

from vlbatch.pipeline.hashindex import PageHashIndex

BANDS = 16  # pigeonhole: distance < 16 means at least one 16-bit band is equal
COMPARE_LONG_SIDE = 1344  # pixels: pages are compared at most this large
BLOCK = 8  # pixels (at the comparison size)
RANK = 20  # the peak is compared with the RANK-th largest block difference
NOISE_FLOOR = 1.0  # a peak below this (0-255) is noise whatever the ratio
PAPER_FLAT = 24  # levels (0-255): a 3x3 neighbourhood this even is blank paper


def hamming(a: str, b: str) -> int:
    return (int(a, 16) ^ int(b, 16)).bit_count()


def bands(phash: str) -> list[str]:
    width = len(phash) // BANDS
    return [f"{i}:{phash[i * width:(i + 1) * width]}" for i in range(BANDS)]


def _grey(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    grey = image.convert("L")
    if grey.size != size:
        grey = grey.resize(size, Image.Resampling.BOX)
    return grey


def _comparison_size(a: Image.Image, b: Image.Image) -> tuple[int, int] | None:
    """The size both pages are compared at (the smaller one's, at most COMPARE_LONG_SIDE);
    None when their aspect ratios differ."""
    ratio_a, ratio_b = a.width / a.height, b.width / b.height
    if abs(ratio_a - ratio_b) / max(ratio_a, ratio_b) > 0.02:
        return None
    smaller = a if a.width * a.height <= b.width * b.height else b
    scale = min(1.0, COMPARE_LONG_SIDE / max(smaller.size))
    return (max(4 * BLOCK, round(smaller.width * scale)), max(4 * BLOCK, round(smaller.height * scale)))


def _block_means(values: np.ndarray) -> np.ndarray:
    h, w = (values.shape[0] // BLOCK) * BLOCK, (values.shape[1] // BLOCK) * BLOCK
    return values[:h, :w].reshape(h // BLOCK, BLOCK, w // BLOCK, BLOCK).mean(axis=(1, 3))


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
            self.greys = (_grey(a, self.size), _grey(b, self.size))
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
        blurred = [np.asarray(grey.filter(ImageFilter.GaussianBlur(1.0)), np.float32) for grey in self.greys]
        return _stand_out(_block_means(np.abs(blurred[0] - blurred[1])))


def _words(text: str | None) -> str:
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
      `max_peak_ratio` times the RANK-th (re-rendering noise is spread over every glyph,
      a change in one place is not) and at most `max_block_diff`."""
    if _words(text_a) and _words(text_b) and _words(text_a) != _words(text_b):
        return False
    if drawings_a is not None and drawings_b is not None and drawings_a != drawings_b:
        return False
    pair = PagePair(a, b)
    if pair.blank_marks() > settings.max_blank_mark:
        return False
    dot, dot_ratio = pair.blank_dot()
    if dot > settings.max_blank_dot and dot_ratio > settings.max_blank_dot_ratio:
        return False
    if pair.ink_shift() > settings.max_ink_shift_ratio:
        return False
    peak, ratio = pair.block_difference()
    return peak <= settings.max_block_diff and ratio <= settings.max_peak_ratio


Relation = Literal["new", "exact", "near"]  # to the pages seen before


class Deduper:
    """Maps each page to its canonical page: itself, an exact copy seen before in this run,
    or a confirmed near-copy, in this run or (through the feature cache) in earlier ones.

    It reads the cache's index as little as it can: not at all when the cache was empty
    when the run opened it (this run's pages are in memory), one read for a page that was
    canonical in an earlier run, and each band's members of earlier runs once per run (the
    last `memo_bands` of them kept)."""

    def __init__(self, settings, index=None, keep_in_memory: int = 16, memo_bands: int = 4096):
        self.settings = settings  # the job's Dedupe section
        self.max_distance = settings.max_phash_distance if settings.near_duplicates else 0
        self.index = index  # a FeatureCache: pages of earlier runs (or None)
        self.search_index = index is not None and not index.empty_at_open
        self.pages = PageHashIndex()  # this run's canonical pages
        # the images of the last canonical pages, for the pixel check without a cache read
        self.recent: LRUCache = LRUCache(maxsize=keep_in_memory)
        self.memo: LRUCache = LRUCache(maxsize=memo_bands)  # band -> earlier runs' members

    def close(self) -> None:
        """Removes the spilled part of this run's index (also done when collected)."""
        self.pages.close()

    def _page(self, content_hash: str) -> tuple[Image.Image, str | None, str | None] | None:
        found = self.recent.get(content_hash)
        if found is not None:
            return found
        return self.index.image(content_hash) if self.index is not None else None

    def _earlier_members(self, band: str) -> list[tuple[str, str | None]]:
        """The index's members of a band: pages of earlier runs (this run's pages are in
        self.pages), which do not change during the run."""
        found = self.memo.get(band)
        if found is None:
            found = self.memo[band] = self.index.members(band)
        return found

    def _earlier_candidates(self, phash: str) -> dict[str, str | None]:
        """Pages of earlier runs sharing a band with this one: content hash -> perceptual
        hash (None where the index does not hold it alongside)."""
        found: dict[str, str | None] = {}
        if self.search_index:
            for band in bands(phash):
                for content_hash, other in self._earlier_members(band):
                    if found.get(content_hash) is None:
                        found[content_hash] = other
        return found

    def match(self, content_hash: str, phash: str, image: Image.Image,
              text_layer: str | None = None, drawings: str | None = None) -> tuple[str, Relation]:
        """(canonical content hash, how the page relates to it); text_layer and drawings:
        a PDF page's (`RenderedPage`), None for an image file."""
        layers = (text_layer, drawings)
        if content_hash in self.pages:
            return content_hash, "exact"
        if self.max_distance > 0:
            if self.search_index and self.index.phash(content_hash):
                # canonical in an earlier run, so it stays canonical (its answers are
                # cached under it); already in the index
                self._register(content_hash, phash, image, layers, index=False)
                return content_hash, "new"
            merged = self._near_copy_of(content_hash, phash, image, layers)
            if merged is not None:
                return merged, "near"
        self._register(content_hash, phash, image, layers)
        return content_hash, "new"

    def _near_copy_of(self, content_hash: str, phash: str, image: Image.Image,
                      layers: tuple[str | None, str | None]) -> str | None:
        """The closest earlier page that the pixel check confirms as the same, if any."""
        close = dict((c, d) for d, c in self.pages.near(phash, self.max_distance))
        for candidate, other in self._earlier_candidates(phash).items():
            if candidate == content_hash or candidate in close:
                continue
            if other is None and self.index is not None:
                other = self.index.phash(candidate)
            if other is not None and (distance := hamming(phash, other)) <= self.max_distance:
                close[candidate] = distance
        close.pop(content_hash, None)
        for _, candidate in sorted((d, c) for c, d in close.items()):
            other = self._page(candidate)
            if other is None:
                continue
            if same_page(image, other[0], layers[0], other[1], self.settings, layers[1], other[2]):
                return candidate
        return None

    def _register(self, content_hash: str, phash: str, image: Image.Image,
                  layers: tuple[str | None, str | None], index: bool = True) -> None:
        self.pages.add(content_hash, phash)
        if index and self.index is not None:
            self.index.add(content_hash, phash, bands(phash), *layers)
        self.recent[content_hash] = (image, *layers)
