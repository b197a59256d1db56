"""render: planned pages -> rendered pages (or the reason they failed), in worker processes.

The stage both executors run: locally over the run's worker pool, on Ray inside each render
actor. Pages come back in the order given. A page is read from the feature cache when an
earlier run rendered it with the same settings; each worker process opens that cache once,
as it starts (`PageStore`, the pool's initializer), with the job's size limit.

`FileTimeBudget` is render.file_timeout_s: the render seconds a file may use in all. Its
decision is made in plan order by the route stage (`admit`), so it is the same whichever
executor renders. A render stage skips a page only when pages of its file that come before
it in the plan already cost more than the budget (`used_up_before`): then the route stage
would not admit it either, in whatever order the render stages saw the pages (Ray's render
actors take blocks out of plan order).
"""

from __future__ import annotations

import base64
import dataclasses
import io
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from PIL import Image

from vlbatch.job import Job, Render
from vlbatch.pipeline import imaging, ingest
from vlbatch.pipeline.workers import CallTimedOut, WorkerDied, WorkerPool

T = TypeVar("T")


@dataclass(frozen=True)
class PageSpec:
    """What a worker needs to render one page."""

    path: str  # absolute
    kind: str
    page: int
    feature_key: str | None  # None: no feature cache


@dataclass(frozen=True)
class RenderFailure:
    """A page that did not render: the pages table's reason, the results' reason, and the
    render seconds it cost its file."""

    page_error: str
    row_error: str
    cost_s: float = 0.0


class PageStore:
    """The feature cache of one worker process, opened once by the pool's initializer."""

    opened = None  # this process's FeatureCache, or None

    @classmethod
    def open(cls, folder: str | None, size_gib: float) -> None:
        if folder is not None:
            from vlbatch.pipeline.cache import FeatureCache

            cls.opened = FeatureCache(Path(folder), size_gib)

    @classmethod
    def close(cls) -> None:
        if cls.opened is not None:
            cls.opened.close()
            cls.opened = None


def render_pool(job: Job, workers: int, lookahead: int | None = None) -> WorkerPool:
    """Worker processes for probing and rendering, each with the job's feature cache."""
    folder = str(job.tenant_cache) if job.feature_cache else None
    return WorkerPool(workers, job.render.page_timeout_s, lookahead=lookahead,
                      initializer=PageStore.open, initargs=(folder, job.cache_size_gib))


def render_page(spec: PageSpec, settings: Render) -> ingest.RenderedPage:
    """In a worker: the page from the feature cache, else rendered (and then cached)."""
    cache, damaged = PageStore.opened if spec.feature_key else None, False
    if cache is not None:
        hit = cache.get_page(spec.feature_key)  # None for entries of older versions
        if hit is not None and spec.kind == "pdf" and "drawings" not in hit[0]:
            hit = None  # cached by a version without the drawings digest: rendered again
        if hit is not None:
            meta, png, compare = hit
            try:
                with Image.open(io.BytesIO(png)) as image:
                    rgb = image.convert("RGB")
                # a comparison image made on demand is made from this file as it is now
                deferred = ingest.CompareSource(
                    spec.path, spec.kind, spec.page, settings.dpi, settings.min_pixels,
                    settings.max_pixels) if meta.get("deferred") and compare is None else None
                return ingest.RenderedPage(rgb.width, rgb.height, rgb.tobytes(),
                                           meta.get("text_layer"), meta["content_hash"],
                                           meta["phash"], from_cache=True,
                                           drawings=meta.get("drawings"), compare_png=compare,
                                           thumb=base64.b64decode(meta["thumb"]),
                                           compare_source=deferred)
            except Exception:  # a damaged entry: render again, and overwrite it
                damaged = True
    rendered = ingest.render(spec.path, spec.kind, spec.page, settings, defer_comparison=True)
    rendered = dataclasses.replace(rendered, healed=damaged)
    if cache is not None:
        buf = io.BytesIO()
        rendered.image().save(buf, "PNG", compress_level=1)
        cache.put_page(spec.feature_key, {
            "content_hash": rendered.content_hash, "phash": rendered.phash,
            "text_layer": rendered.text_layer, "drawings": rendered.drawings,
            "width": rendered.width, "height": rendered.height,
            "deferred": rendered.comparison_deferred,
            "thumb": base64.b64encode(rendered.thumb).decode(),
            "image_tokens": (rendered.width // imaging.IMAGE_FACTOR)
            * (rendered.height // imaging.IMAGE_FACTOR)}, buf.getvalue(), rendered.compare_png)
    return rendered


def failure(error: Exception, page_timeout_s: float) -> RenderFailure:
    """A worker's exception as a RenderFailure: a page stopped by its time limit or a dead
    worker says so; any other failure is 'render failed: ...'."""
    if isinstance(error, CallTimedOut):
        return RenderFailure(str(error), str(error), page_timeout_s)
    if isinstance(error, WorkerDied):
        return RenderFailure(str(error), str(error))
    return RenderFailure(str(error), f"render failed: {error}")


class FileTimeBudget:
    """render.file_timeout_s: the render seconds one file may use in all. A page that ran
    past its own limit costs the whole page limit."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.spent: dict[str, float] = {}  # per file
        self.charged: dict[str, list[tuple[int, float]]] = {}  # per file: (plan rank, cost)
        self.reason = f"timeout: the file used up its time limit ({limit_s:g} s)"

    def used_up(self, path: str) -> bool:
        return self.spent.get(path, 0.0) > self.limit_s

    def used_up_before(self, path: str, rank: int) -> bool:
        """The pages of this file charged here that come before `rank` in the plan cost
        more than the budget."""
        return sum(c for r, c in self.charged.get(path, ()) if r < rank) > self.limit_s

    def charge(self, path: str, cost_s: float, rank: int = 0) -> None:
        self.spent[path] = self.spent.get(path, 0.0) + cost_s
        self.charged.setdefault(path, []).append((rank, cost_s))

    def admit(self, path: str, cost_s: float) -> bool:
        """In plan order: False for a page of a file already past its budget; else the page
        is charged to its file and admitted."""
        if self.used_up(path):
            return False
        self.charge(path, cost_s)
        return True


def cost_of(outcome: ingest.RenderedPage | RenderFailure) -> float:
    return outcome.render_s if isinstance(outcome, ingest.RenderedPage) else outcome.cost_s


def render_in_order(pool: WorkerPool, items: Iterable[T], spec_of: Callable[[T], PageSpec],
                    settings: Render, skip: FileTimeBudget, path_of: Callable[[T], str],
                    rank_of: Callable[[T], int]
                    ) -> Iterator[tuple[T, ingest.RenderedPage | RenderFailure]]:
    """(item, rendered page or failure) for each item, in the order given, except that a
    page whose file `skip` says is past its budget before it (`rank_of`: its place in the
    plan) is not rendered and comes back early (a failure, cost 0: it would not be admitted
    anyway). Every other page's cost is charged to `skip` as it comes back."""
    skipped: list[T] = []

    def to_render() -> Iterator[T]:
        for item in items:
            if skip.used_up_before(path_of(item), rank_of(item)):
                skipped.append(item)
            else:
                yield item

    def drain_skipped() -> Iterator[tuple[T, RenderFailure]]:
        while skipped:
            yield skipped.pop(0), RenderFailure(skip.reason, skip.reason)

    for item, result in pool.imap(render_page, to_render(),
                                  lambda item: (spec_of(item), settings)):
        yield from drain_skipped()
        outcome = result if isinstance(result, ingest.RenderedPage) else \
            failure(result, settings.page_timeout_s)
        skip.charge(path_of(item), cost_of(outcome), rank_of(item))
        yield item, outcome
    yield from drain_skipped()
