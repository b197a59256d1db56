"""plan: page metadata x tasks -> the work still to do, in the order to do it (pure).

Planning needs only page sizes (no rendering): each page's requests are estimated in tokens
(image tokens after the model's smart resize plus the prompt's text tokens), pages are
ordered longest first so the run has no long tail, and a page's tasks stay adjacent so the
engine reuses the page's image work (encoder and prefix caches). Nothing here changes a
PageUnit: each step returns new ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vlbatch.job import Render, Task
from vlbatch.pipeline.cache import FeatureCache
from vlbatch.pipeline.discover import Source
from vlbatch.pipeline.imaging import PageImageError, smart_resize
from vlbatch.output.history import DoneKey


@dataclass(frozen=True)
class PageUnit:
    """One page of one source (page None: the file itself failed), in input order."""

    order: int
    source: Source
    kind: str
    page: int | None
    width: int = 0  # pixels before the model's budget
    height: int = 0
    error: str | None = None
    tasks: tuple[Task, ...] = ()  # still to do
    est_tokens: int = 0

    @property
    def ref(self) -> str:
        return f"{self.source.abs_path}#{self.page}"

    def feature_key(self, render: Render) -> str:
        """This page's key in the feature cache, for the job's render settings."""
        return FeatureCache.page_key(self.source.sha256, self.page, render.dpi,
                                     render.min_pixels, render.max_pixels)


def done_key(unit: PageUnit, task: Task, task_hash: str) -> DoneKey:
    """What makes a row current across runs (write.py's History; task_hash: identity.py)."""
    return unit.source.abs_path, unit.page, task.name, unit.source.sha256, task_hash


def image_tokens(unit: PageUnit, min_pixels: int, max_pixels: int, factor: int = 32) -> int:
    """The page's image tokens once the model's smart resize fits it to the pixel budget
    (0 for a page that cannot be fitted: rendering will report it)."""
    try:
        h, w = smart_resize(unit.height, unit.width, min_pixels, max_pixels, factor)
    except PageImageError:
        return 0
    return (h // factor) * (w // factor)


def order_for_generation(units: Iterable[PageUnit], text_tokens: Callable[[str], int],
                         min_pixels: int, max_pixels: int, factor: int = 32) -> list[PageUnit]:
    """Longest first (estimated prompt tokens), input order among equals; tasks of a page
    ordered longest prompt first."""
    ordered = []
    for unit in units:
        lengths = {t.name: text_tokens(t.render_prompt(text_layer="", source=unit.source.path,
                                                       page=unit.page)) for t in unit.tasks}
        ordered.append(dataclasses.replace(
            unit, tasks=tuple(sorted(unit.tasks, key=lambda t: -lengths[t.name])),
            est_tokens=image_tokens(unit, min_pixels, max_pixels, factor)
            + max(lengths.values())))
    return sorted(ordered, key=lambda u: (-u.est_tokens, u.order))
