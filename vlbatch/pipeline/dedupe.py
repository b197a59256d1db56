"""dedupe: which earlier page, if any, a page is a copy of.

Exact copies (the same normalised pixels, so the same content hash) always merge. Any other
page is looked up at a cost that does not grow with the run (`hashindex`):
1. exact pre-filters: a PDF page's text layer and drawings digest (`layer_key`) are part of
   the lookup key, so pages with other text or drawings are never candidates; a page with
   no text layer (an image file, a scan) has pHash neighbours as candidates;
2. the candidates are ranked by their 64x64 thumbnails (`imaging.thumbnail`), those whose
   thumbnail differs in some cell by more than THUMB_MAX_PEAK are dropped;
3. the pixel check (`pixelcheck.same_page`, at the comparison size, in colour) runs on at
   most MAX_PIXEL_CHECKS of them, nearest first.
A page whose safeguards (layers, comparison image) cannot be read is never merged with.
Comparison images are made only for the pages a pixel check needs (comparison.py).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Literal

from cachetools import LRUCache

from vlbatch.pipeline.comparison import Comparisons
from vlbatch.pipeline.hashindex import Candidate, PageHashIndex, rank, thumbs_of
from vlbatch.pipeline.ingest import CompareSource
from vlbatch.pipeline.pixelcheck import same_page, words

BANDS = 16  # pigeonhole: distance < 16 means at least one 16-bit band is equal
log = logging.getLogger("vlbatch")
MAX_PIXEL_CHECKS = 4  # a page costs at most this many pixel checks
THUMB_MAX_PEAK = 24  # levels (0-255): a thumbnail cell further apart rules a candidate out


def hamming(a: str, b: str) -> int:
    return (int(a, 16) ^ int(b, 16)).bit_count()


def bands(phash: str) -> list[str]:
    width = len(phash) // BANDS
    return [f"{i}:{phash[i * width:(i + 1) * width]}" for i in range(BANDS)]


def layer_key(text_layer: str | None, drawings: str | None) -> str | None:
    """A PDF page's exact pre-filter: its words and its drawings digest; None for a page
    without words (an image file, a scan), which any page may be a raster copy of."""
    text = words(text_layer)
    if not text:
        return None
    return hashlib.blake2b(f"{text}\x1f{drawings or ''}".encode(), digest_size=16).hexdigest()


Relation = Literal["new", "exact", "near"]  # to the pages seen before


class Deduper:
    """Maps each page to its canonical page: itself, an exact copy seen before in this run,
    or a confirmed near-copy, in this run or (through the feature cache) in earlier ones.

    It reads the cache's index as little as it can: not at all when the cache was empty
    when the run opened it (this run's pages are in memory), one read for a page that was
    canonical in an earlier run, and each band's or layer's members of earlier runs once per
    run (the last `memo_bands` of them kept); a candidate's image is read from the cache only
    for the few pixel checks a page may cost."""

    def __init__(self, settings, index=None, comparisons: Comparisons | None = None,
                 keep_in_memory: int = 16, memo_bands: int = 4096):
        self.settings = settings  # the job's Dedupe section
        # makes the comparison images that the render workers left for later
        self.comparisons = comparisons or Comparisons()
        self.max_distance = settings.max_phash_distance if settings.near_duplicates else 0
        self.index = index  # a FeatureCache: pages of earlier runs (or None)
        self.search_index = index is not None and not index.empty_at_open
        self.pages = PageHashIndex()  # this run's canonical pages
        # the last canonical pages (RenderedPage), for the pixel check without a cache read
        self.recent: LRUCache = LRUCache(maxsize=keep_in_memory)
        self.memo: LRUCache = LRUCache(maxsize=memo_bands)  # band or layer -> earlier members
        self.thumbs: LRUCache = LRUCache(maxsize=memo_bands)  # earlier pages' thumbnails
        # candidates' decoded views: a page checked for many later pages is decoded once
        self.views: LRUCache = LRUCache(maxsize=keep_in_memory)
        self.pixel_checks = 0  # how many this run made

    def close(self) -> None:
        """Removes the spilled part of this run's index (also done when collected)."""
        self.pages.close()
        self.comparisons.close()

    def match(self, page) -> tuple[str, Relation]:
        """(canonical content hash, how the page relates to it) for a RenderedPage."""
        content_hash = page.content_hash
        if content_hash in self.pages:
            return content_hash, "exact"
        layer = layer_key(page.text_layer, page.drawings)
        if self.max_distance > 0:
            if self.search_index and self.index.phash(content_hash):
                # canonical in an earlier run, so it stays canonical (its answers are
                # cached under it); already in the index
                self._register(page, layer, index=False)
                return content_hash, "new"
            merged = self._near_copy_of(page, layer)
            if merged is not None:
                return merged, "near"
        self._register(page, layer)
        return content_hash, "new"

    def candidates(self, page, layer: str | None) -> list[Candidate]:
        """The pages worth a pixel check, nearest thumbnail first, at most MAX_PIXEL_CHECKS."""
        found = self.pages.near(page.phash, self.max_distance, layer, page.thumb,
                                keep=MAX_PIXEL_CHECKS)
        if self.search_index:
            content, thumbs = self._earlier_candidates(page.phash, layer)
            found += rank(content, thumbs, page.thumb, MAX_PIXEL_CHECKS)
        seen, kept = {page.content_hash}, []
        for candidate in sorted(found, key=lambda c: (c.thumb_peak, c.thumb_distance)):
            if candidate.content_hash not in seen and candidate.thumb_peak <= THUMB_MAX_PEAK:
                seen.add(candidate.content_hash)
                kept.append(candidate)
        return kept[:MAX_PIXEL_CHECKS]

    def _earlier_members(self, key: str) -> list[tuple[str, str, str | None]]:
        """The index's members of a band or layer: pages of earlier runs (this run's pages
        are in self.pages), which do not change during the run."""
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = self.index.members(key)
        return found

    def _earlier_candidates(self, phash: str, layer: str | None) -> tuple[list[bytes], object]:
        """Pages of earlier runs: those of the same layer key, and those sharing a band and
        within the distance (without a layer key, for a page with one)."""
        found: list[str] = []
        if layer is not None:
            found += [content_hash for content_hash, _, _ in self._earlier_members("layer:" + layer)]
        for band in bands(phash):
            for content_hash, other, other_layer in self._earlier_members("band:" + band):
                if layer is not None and other_layer is not None:
                    continue
                if hamming(phash, other) <= self.max_distance:
                    found.append(content_hash)
        found = list(dict.fromkeys(found))
        return [bytes.fromhex(h) for h in found], thumbs_of([self._earlier_thumb(h) for h in found])

    def _earlier_thumb(self, content_hash: str) -> bytes:
        thumb = self.thumbs.get(content_hash)
        if thumb is None:
            thumb = self.thumbs[content_hash] = self.index.thumb(content_hash)
        return thumb

    def _view(self, content_hash: str):
        """(comparison image, text layer, drawings) of a canonical page, or None where they
        cannot be read (then it is never merged with)."""
        view = self.views.get(content_hash)
        if view is None:
            found = self.recent.get(content_hash)
            if found is not None:
                view = self._comparison(found), found.text_layer, found.drawings
            elif self.index is not None:
                view = self.index.comparison(content_hash)
                if view is not None and isinstance(view[0], CompareSource):  # not made yet
                    view = self.comparisons(view[0], content_hash), view[1], view[2]
            if view is None or view[0] is None:
                return None
            self.views[content_hash] = view
        return view

    def _comparison(self, page):
        """A RenderedPage's comparison image (made now where it was deferred), or None."""
        if page.comparison_deferred:
            return self.comparisons(page.compare_source, page.content_hash)
        return page.comparison()

    def _near_copy_of(self, page, layer: str | None) -> str | None:
        """The nearest earlier page that the pixel check confirms as the same, if any."""
        image, outcomes = None, []
        for candidate in self.candidates(page, layer):
            other = self._view(candidate.content_hash)
            if other is None:
                outcomes.append((candidate.content_hash[:12], "no view"))
                continue
            if image is None:
                image = self._comparison(page)
                if image is None:  # its own cannot be made: no merge
                    log.debug("dedupe: no comparison image of %s", page.content_hash[:12])
                    return None
            self.pixel_checks += 1
            if same_page(image, other[0], page.text_layer, other[1], self.settings,
                         page.drawings, other[2]):
                return candidate.content_hash
            outcomes.append((candidate.content_hash[:12], "pixel check"))
        if outcomes:
            log.debug("dedupe: %s not merged: %s", page.content_hash[:12], outcomes)
        return None

    def _register(self, page, layer: str | None, index: bool = True) -> None:
        self.pages.add(page.content_hash, page.phash, layer, page.thumb)
        if index and self.index is not None:
            self.index.add(page, bands(page.phash), layer)
        self.recent[page.content_hash] = page
