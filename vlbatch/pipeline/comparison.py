"""comparison: the dedupe's comparison image of a page, made only when a pixel check needs it.

Where the model's pixel budget is below imaging.COMPARE_PIXELS, the pixel check compares
pages at that larger budget. Rendering and PNG-encoding that second image for every page cost
two thirds of a page's render time on an archive of one template, while only the few pages
that are candidates of one another are ever pixel-checked. So the render workers leave it
(`ingest.render(defer_comparison=True)`: the page carries a `CompareSource`), and this makes
it on demand: in a render worker (the time limit of a page applies; a hang or a crash gives
no image), from the file and settings the page's content hash was rendered with. The made
image is kept in the feature cache ("compare:<content hash>"), so it is made once.

The file must still render to that content hash: a file changed, moved or deleted since
gives no image, and then no merge (a missing safeguard never reads as "no check").
"""

from __future__ import annotations

import io
import logging

from PIL import Image

from vlbatch.job import Render
from vlbatch.pipeline import ingest

log = logging.getLogger("vlbatch")


class SourceChanged(ValueError):
    pass


def render_comparison(source: ingest.CompareSource, content_hash: str, settings: Render) -> bytes:
    """In a worker: the comparison image (PNG) of the page `source` names, which must still
    render to `content_hash`; kept in this worker's feature cache."""
    from vlbatch.pipeline.render import PageStore

    at = settings.model_copy(update={"dpi": source.dpi, "min_pixels": source.min_pixels,
                                     "max_pixels": source.max_pixels})
    page = ingest.render(source.path, source.kind, source.page, at)
    if page.content_hash != content_hash:
        raise SourceChanged(f"{source.path} page {source.page} no longer renders as it did")
    png = page.compare_png
    if png is None:  # the page at the comparison budget is the model's image itself
        buf = io.BytesIO()
        page.image().save(buf, "PNG", compress_level=1)
        png = buf.getvalue()
    if PageStore.opened is not None:
        PageStore.opened.put_compare(content_hash, png)
    return png


class Comparisons:
    """Makes comparison images on demand: in `pool` (a render WorkerPool, whose calls have
    the page time limit) or, without one, in this process. Called as
    `comparisons(source, content_hash)` -> RGB image, or None where it cannot be made."""

    def __init__(self, settings: Render | None = None, pool=None, make_pool=None):
        """make_pool: how to start a pool of its own at the first call (closed by close())."""
        self.settings = settings or Render()
        self.pool, self.make_pool, self.own_pool = pool, make_pool, None
        self.made = 0
        self.failed = 0

    def close(self) -> None:
        if self.own_pool is not None:
            self.own_pool.close()
            self.own_pool = self.pool = None

    def __call__(self, source: ingest.CompareSource, content_hash: str) -> Image.Image | None:
        if self.pool is None and self.make_pool is not None:
            self.pool = self.own_pool = self.make_pool()
            self.make_pool = None
        try:
            if self.pool is not None:
                png = self.pool.call(render_comparison, (source, content_hash, self.settings))
            else:
                png = render_comparison(source, content_hash, self.settings)
            with Image.open(io.BytesIO(png)) as image:
                made = image.convert("RGB")
        except Exception as e:  # changed, gone, unreadable, timed out: no image, no merge
            self.failed += 1
            log.debug("no comparison image of %s page %s: %s", source.path, source.page, e)
            return None
        self.made += 1
        return made
